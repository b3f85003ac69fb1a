"""Which requests keep their C4 entries resident on the device (`TierConfig.resident`): the rule, in one place.

With the tier on, every C4 entry has its authoritative copy in the host pool, so keeping it on the device too
is a choice the store can make per request and undo at any time without losing anything. A resident request
holds `Geometry.c4_pages_per_block` extra pages per classical block, taken from the same page pool as
everyone's blocks and state groups; its steps read C4 rows straight from them (no hot-buffer lookup, no miss,
no resolve) and write new entries there only: they reach the host pool when the request shrinks or pauses
(`TieredStore._write_back`). A request that is not resident reads through its hot buffer as without this option.

The store applies the rule on the step thread only (`TieredStore.rebalance`, before every step, and
`TieredStore._reclaim` whenever growth or a resume needs pages):
- **room kept free**: `headroom` pages stay free beyond any residency: one state group and a block (a small
  request admits at once, without waiting a step), a page per running request when requests grow as they
  decode (`reserve=estimate`), and the pages the last refused admission asked for, for `hold_steps` steps
  after it (the refused caller retries; the room must still be there when it does);
- **shrink**: while fewer pages than that are free, the resident request holding the most C4 pages drops
  them (its hot buffer is rebuilt from the host pool, as after a resume): the fewest transitions per page won;
- **grow**: while more are free than that plus a request's C4 pages, the filled, non-resident request needing
  the fewest pages becomes resident (its entries copied from the host pool): the most requests served per page.
Admission never waits for residency: a refused reservation only records its demand (the actor's event loop
does no device work), and the next step's rebalance frees the room.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ResidencyPolicy:
    group_pages: int
    grows: bool
    """Whether running requests take blocks as they decode (`reserve=estimate`): a page of headroom each."""
    hold_steps: int = 64
    """Steps a refused admission's demand is kept free for after it was refused."""
    demand: int = 0
    since: int = 0

    def refused(self, pages: int) -> None:
        """An admission needing `pages` pages found too few free (any thread: plain integers)."""
        self.demand, self.since = max(self.demand if self.since < self.hold_steps else 0, pages), 0

    def admitted(self) -> None:
        """An admission went through: what was asked for has been served."""
        self.demand = 0

    def tick(self) -> None:
        self.since += 1

    def headroom(self, running: int) -> int:
        """Pages to keep free beyond residency."""
        live = self.demand if self.since < self.hold_steps else 0
        return self.group_pages + 1 + (running if self.grows else 0) + live
