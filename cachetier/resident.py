"""Where one admitted request sits in the tiered store: what the store allocates and the step view reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np
import torch


@dataclass
class Resident:
    """One admitted request's place in the store."""

    request_id: str
    group: int
    blocks: list[int]
    host_blocks: list[int]
    num_tokens: int
    reserve_tokens: int
    blocks_np: np.ndarray = field(repr=False, default=None)
    """`blocks` as int64 (host): block tables are written from these, never from Python lists."""
    host_blocks_np: np.ndarray = field(repr=False, default=None)
    blocks_t: torch.Tensor = field(repr=False, default=None)
    """`blocks` on the store's device; made by `fill` (the step thread), never by `reserve`."""
    host_blocks_t: torch.Tensor = field(repr=False, default=None)
    """`host_blocks` on the host, made by `fill`."""
    mtp_floor: int = 0
    """The first position whose MTP entry this request's ring holds (speculation; set when it is filled)."""
    mtp_start: int = 0
    """Its first decode position (where its ring started at admission): a floor above it means plain steps ran
    since and the ring restarted (`TieredStore.restart_mtp`)."""
    filled: bool = False
    """False while the pages are only reserved (the layout has not arrived yet)."""
    c4_pages: list[int] = field(default_factory=list)
    """Tier on, `TierConfig.resident`: the device pages holding all its C4 entries (`Geometry.c4_pages_per_block` per
    block, in block order) while it is resident; empty while it reads them through its hot buffer."""
    c4_np: np.ndarray = field(repr=False, default=None)
    c4_t: torch.Tensor = field(repr=False, default=None)
    c4_host_upto: int = 0
    """While resident: its C4 entries below this one have their host-pool copy; those appended since are on the device
    only and are written back when it shrinks (`TieredStore.drop_resident`)."""
    prefix_keys: tuple[str, ...] = ()
    """Chain keys of its handed-off context's full pages (`cachetier.prefix.page_keys`), given with the reservation:
    the name its prompt pages are kept under when it finishes (`cachetier.retention`)."""
    held: object = None
    """The kept entry (`cachetier.retention.Kept`) whose pages its layout leaves out, from reservation until `fill`."""
    held_tokens: int = 0
    """Tokens of those pages: the handoff leaves out their classical entries (0: a whole layout)."""
    shared: int = 0
    """Its first blocks that are shared pages (`cachetier.sharing`): held by reference, never written."""
    maps: list[int] = field(default_factory=list)
    """The entry-map blocks of those shared pages: the page itself for the page's first holder, else a map block of
    its own (`Geometry.share_maps`)."""
    map_np: np.ndarray = field(repr=False, default=None)
    """Its entry-map block table (int64, host): `maps`, then its own blocks (which map as themselves)."""
    map_t: torch.Tensor = field(repr=False, default=None)
    """`map_np` on the store's device; made with `blocks_t`."""
    tables_version: int = 0
    """Bumped whenever its pages change while it runs (it grew, or came back from host memory in other pages), so a
    step view rebuilds the block tables it keeps."""


    def __post_init__(self) -> None:
        if self.map_np is None and self.blocks_np is not None and not self.shared:
            self.map_np = self.blocks_np

    @property
    def shared_keys(self) -> tuple[str, ...]:
        """Chain keys of its shared pages."""
        return self.prefix_keys[: self.shared]


def is_resident(r: Resident) -> bool:
    """Whether a request's C4 entries are all on the device (its steps read them there, not through its hot buffer)."""
    return bool(r.c4_pages)


def tables_key(residents: list[Resident]) -> tuple:
    """What a step view's block tables depend on: which resident objects, in which order, at which version (the
    objects stay referenced by the view, so no id is reused while it compares)."""
    return tuple((id(r), r.tables_version) for r in residents)


num_tokens_of, group_of = attrgetter("num_tokens"), attrgetter("group")
"""A resident's token count and state group, for `map` over a step's residents."""
