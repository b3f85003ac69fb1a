"""Finished requests' prompt pages, kept on a decode worker for the follow-up turn that extends them.

A chat's next prompt is the previous prompt, the answer and a new message: its first pages are the previous
prompt's, whose classical entries (C4 and HCA entries, indexer keys) this worker already wrote when that prompt
was handed to it. Those entries depend only on the tokens up to their page's end (`cachetier.prefix`), so the
next prefill computes the same values for them. When a request finishes here its prompt's full pages are kept:
- their C4 entries stay where they are, in the host pool's blocks (no copy), now owned by the kept entry;
- their indexer keys and HCA entries (device pages) are copied into host memory;
- the device pages and the state group return to the pool at once.

A kept entry is named by its pages' chain keys (`cachetier.prefix.page_keys`, the names the prefill side's
prefix cache gives them), which the frontend computes from the prompt and sends with the reservation. A
reservation whose prompt extends a kept entry takes it over (`TieredStore.reserve`): its host blocks become the
request's first ones, the prefill side leaves those pages out of the handoff (`cachetier.layout.without_prefix`),
and `fill` puts them back from here (`with_prefix`). Each kept entry serves one follow-up: the one it goes to
owns its blocks from then on.

With shared prefixes (`cachetier.sharing`) a finishing request's shared pages are kept too: one it held last gives
its host block to the kept entry, one that running requests still hold is copied into a block of the entry's own
(`TieredStore._keep_shared`).

Budget (`TierConfig.retain_bytes`): host blocks plus copied pages; least recently kept first out. Kept entries
are also the first to go when an admission needs host blocks, and `capacity` counts their blocks as free. Plain
bookkeeping, no device work: the store moves the bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class Kept:
    """One finished request's prompt pages, as kept."""

    owner: str
    """Who owns its host blocks in the host allocator while it is kept."""
    keys: tuple[str, ...]
    """Chain keys of its pages, shallowest first: keys[-1] names the whole prefix."""
    host_blocks: list[int]
    """Its pages' C4 entries, one host block per page."""
    pages: torch.Tensor
    """[pages, page elements] host copy of its device pages (indexer keys, HCA entries)."""
    nbytes: int

    @property
    def num_pages(self) -> int:
        return len(self.keys)


class Retention:
    """The kept entries of one store (its allocation lock held by every caller), by the key of their last page."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.kept: OrderedDict[str, Kept] = OrderedDict()
        self.nbytes = 0
        self.count = {"total": 0, "reused": 0, "reused_pages": 0, "evicted": 0, "refused": 0, "copied_pages": 0}
        """Entries kept; reservations that took one over, and the pages they did not need sent; entries dropped for
        the budget or for host blocks; finished requests too large to keep; pages kept by copying the host block of a
        page running requests still share (`cachetier.sharing`)."""

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    @property
    def host_blocks(self) -> int:
        return sum(len(k.host_blocks) for k in self.kept.values())

    def match(self, keys: tuple[str, ...]) -> Kept | None:
        """The kept entry covering the longest prefix of pages named `keys` (a chain key names its whole prefix)."""
        for m in range(len(keys), 0, -1):
            k = self.kept.get(keys[m - 1])
            if k is not None and k.keys == keys[:m]:
                return k
        return None

    def take(self, kept: Kept) -> None:
        """A reservation takes `kept` over (its blocks are the reservation's now)."""
        del self.kept[kept.keys[-1]]
        self.nbytes -= kept.nbytes
        self.count["reused"] += 1
        self.count["reused_pages"] += kept.num_pages

    def fits(self, nbytes: int) -> bool:
        return 0 < nbytes <= self.budget

    def add(self, kept: Kept) -> list[Kept]:
        """Keep `kept` (it must `fit`); returns the entries that go to make room (their blocks are the caller's to
        free): one kept under the same keys, then the least recently kept while over budget."""
        out = []
        old = self.kept.pop(kept.keys[-1], None)
        if old is not None:
            self.nbytes -= old.nbytes
            out.append(old)
        self.kept[kept.keys[-1]] = kept
        self.nbytes += kept.nbytes
        self.count["total"] += 1
        while self.nbytes > self.budget:
            out.append(self.pop_oldest())
        self.count["evicted"] += len(out)
        return out

    def pop_oldest(self, spare: Kept | None = None) -> Kept | None:
        """Drop the least recently kept entry other than `spare` (None: nothing else is kept)."""
        for key, k in self.kept.items():
            if k is not spare:
                del self.kept[key]
                self.nbytes -= k.nbytes
                return k
        return None

    def evicted(self, n: int = 1) -> None:
        self.count["evicted"] += n

    def stats(self) -> dict:
        return {"kept_requests": len(self.kept), "kept_bytes": self.nbytes, "kept_budget_bytes": self.budget,
                **{f"kept_{k}": v for k, v in self.count.items()}}
