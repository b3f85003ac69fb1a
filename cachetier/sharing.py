"""Pages that running requests share: a prompt prefix held once, in both tiers.

Requests whose contexts begin with the same full pages (an agent's system prompt and repository context, n > 1,
sibling sub-agents) have the same classical entries in those pages: a C4 or HCA entry and an indexer key depend
only on the tokens up to their page's end (what the prefix cache relies on too). So they can hold those pages
once: the device page (indexer keys, HCA entries; C4 entries too with the tier off) and, with the tier on, the
host block with the C4 entries.

A page is shared only while it is *full and behind every holder's end*: decoding writes entries at and after a
request's context end, so nothing ever writes a shared page. Where two contexts diverge (and in the partial last
page) each request has a page of its own, written from its own layout: that page is the copy in copy-on-write,
made when the request is filled rather than at its first write, because its first write is certain. A holder's
shared pages are always the first pages of its block table (a chain key names its whole prefix).

Naming: a page is named by its chain key (`cachetier.prefix.page_keys`), which the frontend sends with each
reservation. A request registers its full context pages when it is filled; a later reservation whose keys match
takes references to them at once (its handoff leaves them out: `held_tokens`), and one filled after pages it
could have shared were registered (siblings reserved together) gives its own copies back and takes references.

Ownership: a shared page and its host block belong to `OWNER` in the allocators and to this registry, which
counts holders; the last holder to leave frees them. The hot tier's entry map is addressed per holder, not per
page (each holder has its own hot buffer, so two holders of a page hold different slots for its entries): the
first holder addresses a page's entries by the page itself, every later one by a *map block* of its own, taken
from a fixed pool beside the arena's (`Geometry.share_maps`). With no map block free a reservation shares fewer
pages (its own copies take the rest). Plain bookkeeping, no torch: the store moves the bytes and holds the lock.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

OWNER = "shared"
"""The owner of shared pages and host blocks in the allocators."""


@dataclass
class SharedPage:
    key: str
    """Its chain key: names its whole prefix."""
    page: int
    """The device page."""
    host_block: int
    """The host block of its C4 entries (-1 with the tier off)."""
    holders: set[str] = field(default_factory=set)
    """Requests whose block tables hold it (running or paused)."""


class Sharing:
    """The shared pages of one store, by chain key, and the map blocks of holders after the first."""

    def __init__(self, map_base: int, num_maps: int) -> None:
        self.pages: dict[str, SharedPage] = {}
        self.map_base, self.num_maps = map_base, num_maps
        self._free_maps = list(range(map_base, map_base + num_maps))
        heapq.heapify(self._free_maps)
        self.map_owner: dict[int, str] = {}
        self.count = {"registered": 0, "shared_pages": 0, "shared_at_fill": 0, "freed": 0, "no_map_block": 0}
        """Pages registered; references taken to a registered page (at reservation, at fill); shared pages freed by
        their last holder; references a reservation gave up for want of a map block."""

    def match(self, keys: tuple[str, ...], start: int = 0, limit: int | None = None) -> int:
        """How many of `keys`, from `start`, name registered pages (up to `limit` in all): a chain key names its
        whole prefix, so the registered ones are a run from the start."""
        end = len(keys) if limit is None else min(len(keys), limit)
        m = start
        while m < end and keys[m] in self.pages:
            m += 1
        return m - start

    @property
    def maps_free(self) -> int:
        return len(self._free_maps)

    def take(self, holder: str, keys: tuple[str, ...], at_fill: bool = False,
             mapped: bool = True) -> tuple[list[SharedPage], list[int]]:
        """References for `holder` to the registered pages `keys` (all registered; with `mapped`, the tier's entry map
        in use, a map block for each must be free): -> the pages, the blocks addressing their entries in the
        holder's entry map (without an entry map, the pages themselves)."""
        pages = [self.pages[k] for k in keys]
        if mapped and len(pages) > len(self._free_maps):
            raise RuntimeError(f"{len(pages)} map blocks asked for, {len(self._free_maps)} free")
        maps = [heapq.heappop(self._free_maps) for _ in pages] if mapped else [p.page for p in pages]
        for p, m in zip(pages, maps):
            p.holders.add(holder)
            if mapped:
                self.map_owner[m] = holder
        self.count["shared_at_fill" if at_fill else "shared_pages"] += len(pages)
        return pages, maps

    def register(self, holder: str, keys: tuple[str, ...], pages: list[int], host_blocks: list[int]) -> None:
        """A filled request's own full context pages become shared (it stays their first holder)."""
        for key, page, hb in zip(keys, pages, host_blocks, strict=True):
            if key in self.pages:
                raise RuntimeError(f"page {key[:12]} is registered already")
            self.pages[key] = SharedPage(key, page, hb, {holder})
        self.count["registered"] += len(keys)

    def release(self, holder: str, keys: tuple[str, ...], maps: list[int]) -> list[SharedPage]:
        """`holder` leaves: its references and map blocks go back -> the pages nobody holds now (the caller frees
        them in the allocators)."""
        gone = []
        for key in keys:
            p = self.pages[key]
            p.holders.discard(holder)
            if not p.holders:
                del self.pages[key]
                gone.append(p)
        for m in maps:
            if m >= self.map_base and self.map_owner.pop(m, None) == holder:
                heapq.heappush(self._free_maps, m)
        self.count["freed"] += len(gone)
        return gone

    def refs(self) -> int:
        return sum(len(p.holders) for p in self.pages.values())

    def stats(self) -> dict:
        return {"shared_pages_now": len(self.pages), "shared_refs_now": self.refs(), "share_maps_free": self.maps_free,
                **{f"share_{k}": v for k, v in self.count.items()}}
