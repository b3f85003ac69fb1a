"""Page bookkeeping for the device arena, in plain Python (no torch), testable anywhere.

The device KV of all running requests lives in one arena cut into equal pages. A classical block
(the C4/indexer/HCA entries of `block_tokens` tokens) takes one page; a request's fixed-size state
(window ring, compressor tails, hot buffer) takes a *group* of `group_pages` consecutive pages
aligned to a multiple of `group_pages`. Blocks are taken from the bottom of the arena and state
groups from the top, so blocks rarely land inside a group a state will want later.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


class OutOfPages(Exception):
    """Not enough free pages right now (the caller queues the request)."""


@dataclass
class PageAllocator:
    num_pages: int
    group_pages: int

    def __post_init__(self) -> None:
        if self.group_pages < 1 or self.num_pages < self.group_pages:
            raise ValueError(f"an arena of {self.num_pages} pages cannot hold a state group of {self.group_pages} pages")
        self.owner: list[str | None] = [None] * self.num_pages
        self._free_heap = list(range(self.num_pages))  # lowest free page first (lazy deletion)
        self.num_free = self.num_pages
        self._used = [0] * self.num_groups
        """Owned pages inside each group's range: a group is free to take when it holds none. A list of ints,
        so finding a free group is one scan in C, not a Python loop over the arena."""

    @property
    def num_groups(self) -> int:
        return self.num_pages // self.group_pages

    def _top_free_group(self) -> int | None:
        """The highest group without an owned page (groups are taken from the top), or None."""
        used = self._used
        if 0 not in used:
            return None
        return len(used) - 1 - used[::-1].index(0)

    def _count(self, page: int, delta: int) -> None:
        g = page // self.group_pages
        if g < len(self._used):  # pages past the last whole group belong to none
            self._used[g] += delta

    def group_counts_hold(self) -> bool:
        """Whether the per-group counts kept as pages come and go equal a fresh count from the owners."""
        gp = self.group_pages
        return self._used == [sum(o is not None for o in self.owner[g * gp : (g + 1) * gp]) for g in range(self.num_groups)]

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether one state group plus `num_blocks` blocks fit now."""
        if self.num_free < self.group_pages + num_blocks:
            return False
        return 0 in self._used

    def allocate(self, owner: str, num_blocks: int) -> tuple[int, list[int]]:
        """Take a state group (returns its index) and `num_blocks` single pages for `owner`."""
        if self.num_free < self.group_pages + num_blocks:
            raise OutOfPages(f"need {self.group_pages + num_blocks} pages, {self.num_free} free")
        group = self._top_free_group()
        if group is None:
            raise OutOfPages("no free state group (the free pages are fragmented by blocks)")
        start = group * self.group_pages
        for p in range(start, start + self.group_pages):
            self.owner[p] = owner
        self._used[group] = self.group_pages
        self.num_free -= self.group_pages
        return group, self.allocate_blocks(owner, num_blocks)

    def allocate_blocks(self, owner: str, num_blocks: int) -> list[int]:
        """Take `num_blocks` single pages for `owner`, lowest first (a new request's, or a running one's growth)."""
        if self.num_free < num_blocks:
            raise OutOfPages(f"need {num_blocks} pages, {self.num_free} free")
        blocks = []
        while len(blocks) < num_blocks:
            p = heapq.heappop(self._free_heap)
            if self.owner[p] is None:
                self.owner[p] = owner
                self._count(p, 1)
                blocks.append(p)
        self.num_free -= num_blocks
        return blocks

    def free(self, owner: str, group: int, blocks: list[int]) -> None:
        start = group * self.group_pages
        self.free_blocks(owner, [*range(start, start + self.group_pages), *blocks])

    def transfer(self, owner: str, new_owner: str, pages: list[int]) -> None:
        """Single pages `owner` holds change hands (none is freed)."""
        for p in pages:
            if self.owner[p] != owner:
                raise RuntimeError(f"page {p} is owned by {self.owner[p]!r}, not {owner!r}")
            self.owner[p] = new_owner

    def free_blocks(self, owner: str, pages: list[int]) -> None:
        """Return single pages of `owner` (a request that keeps running: its resident C4 pages)."""
        for p in pages:
            if self.owner[p] != owner:
                raise RuntimeError(f"page {p} is owned by {self.owner[p]!r}, not {owner!r}")
            self.owner[p] = None
            self._count(p, -1)
            heapq.heappush(self._free_heap, p)
        self.num_free += len(pages)


@dataclass
class BlockAllocator:
    """Single-size blocks (the host pool's C4 blocks), lowest first."""

    num_blocks: int

    def __post_init__(self) -> None:
        self.owner: list[str | None] = [None] * self.num_blocks
        self._free = list(range(self.num_blocks))
        heapq.heapify(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, owner: str, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"need {n} host blocks, {len(self._free)} free")
        out = [heapq.heappop(self._free) for _ in range(n)]
        for b in out:
            self.owner[b] = owner
        return out

    def transfer(self, owner: str, new_owner: str, blocks: list[int]) -> None:
        """Blocks `owner` holds change hands (none is freed)."""
        for b in blocks:
            if self.owner[b] != owner:
                raise RuntimeError(f"host block {b} is owned by {self.owner[b]!r}, not {owner!r}")
            self.owner[b] = new_owner

    def free(self, owner: str, blocks: list[int]) -> None:
        for b in blocks:
            if self.owner[b] != owner:
                raise RuntimeError(f"host block {b} is owned by {self.owner[b]!r}, not {owner!r}")
            self.owner[b] = None
            heapq.heappush(self._free, b)
