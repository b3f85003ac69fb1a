"""Where a decode worker keeps its requests' KV, and the `DecodeKV` its batches decode through.

`TieredStore` is the real one: a device arena (see `geometry`) plus, with the tier on, the host pool
for C4 entries and per-request hot buffers resolved by LRU. With the tier off the same arena also
holds the C4 entries. Both hand the attention identical rows, so the tokens are identical.
`LayoutStore` keeps plain layouts (everything resident, no budget): the model's own decode path.
A decode step's view of the tiered store lives in `cachetier.tiered_batch`.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from cachetier.admission import ReservePolicy
from cachetier.batch import INDEX, MAIN, DecodeKV, LayoutBatch
from cachetier.buckets import context_blocks
from cachetier.geometry import Field, Geometry, block_rows, resident_c4_rows
from cachetier.hot_tier import HotTier
from cachetier.layout import KVLayout, skipped_tokens, with_prefix
from cachetier.pages import BlockAllocator, OutOfPages, PageAllocator
from cachetier.prefix import page_keys
from cachetier.residency import ResidencyPolicy
from cachetier.resident import Resident, is_resident, num_tokens_of
from cachetier.retention import Kept, Retention
from cachetier.sharing import OWNER, Sharing
from cachetier.spec_batch import SpecBatch
from cachetier.tiered_batch import MIXED, RESIDENT, TIERED, TieredBatch
from core import device as devices
from core.config import ModelConfig
from core.configs import TierConfig
from core.types import NeverFitsError
from kernels.host_write import write_rows

log = logging.getLogger(__name__)


class IntegrityError(AssertionError):
    pass


@dataclass
class Swapped:
    """A request paused by `TieredStore.swap_out`: where it sat (its host blocks still its own) and its device pages'
    contents, [group pages + blocks, page elements] in host memory."""

    resident: Resident
    pages: torch.Tensor


class KVStore(ABC):
    """What the decode worker needs from a store.

    Admission comes in two halves so that decode capacity can be held before prefill starts:
    `reserve` takes a request's pages (at its final length, prompt + max_tokens, or less under the
    `estimate` policy: `cachetier.admission`) and `fill` later writes the prefilled layout into them;
    `admit` does both at once. `free` returns whatever the request holds (reserved, filled or swapped
    out). Allocation is thread-safe: an actor may reserve from its event loop while the step thread
    decodes. A store whose requests `grow` also moves a request's device state out (`swap_out`) and
    back (`swap_in`).
    """

    grows = False
    """Whether admission may hold less than the final length: the decode worker then makes room before each step
    (`grow`, pausing requests with `swap_out` when the device is full)."""

    @abstractmethod
    def check_fits_ever(self, request_id: str, reserve_tokens: int) -> None:
        """Raise `NeverFitsError` if a request of this final length could never be admitted."""

    @abstractmethod
    def fits(self, reserve_tokens: int, context_tokens: int | None = None) -> bool:
        """Whether `reserve` of a request of this final length, whose layout holds `context_tokens`, would succeed now."""

    @abstractmethod
    def reserve(self, request_id: str, reserve_tokens: int, context_tokens: int | None = None,
                prefix_keys: tuple[str, ...] = ()) -> bool:
        """Take the pages a request of final length `reserve_tokens` needs now (its layout holds `context_tokens`,
        None when it is not prefilled yet); False if they are not free. `prefix_keys`: its context's page keys, which
        a store that keeps finished requests' pages matches (`held_tokens`)."""

    @abstractmethod
    def fill(self, request_id: str, layout: KVLayout) -> None:
        """Write a prefilled layout into the pages reserved for it."""

    def admit(self, request_id: str, layout: KVLayout, reserve_tokens: int, prefix_keys: tuple[str, ...] = ()) -> None:
        """`reserve` + `fill`; raises `OutOfPages` when the pages are not free now."""
        if not self.reserve(request_id, max(reserve_tokens, layout.num_tokens + 1), layout.num_tokens, prefix_keys):
            raise OutOfPages(f"no room for {request_id} ({reserve_tokens} tokens) right now")
        try:
            self.fill(request_id, layout)
        except BaseException:
            self.free(request_id)
            raise

    @abstractmethod
    def free(self, request_id: str, keep: bool = False) -> None:
        """Return what a request holds; `keep`: it finished, and a store that keeps prompt pages for follow-up turns
        may keep its (`cachetier.retention`)."""

    def held_tokens(self, request_id: str) -> int:
        """Tokens at the start of a reserved request's context whose classical entries this store already holds (its
        handoff leaves them out); 0 for a store that keeps nothing."""
        return 0

    def page_keys(self, context: tuple[int, ...]) -> tuple[str, ...]:
        """The page keys `reserve` takes for a context (its full pages' chain keys), when this store matches them
        against pages it holds; () for a store that does not."""
        return ()

    @abstractmethod
    def holds(self, request_id: str) -> bool:
        """Whether the request has pages here (reserved, filled or swapped out)."""

    def grow(self, request_id: str, ahead: int) -> bool:
        """Make a running request's blocks cover `ahead` more tokens (never past its final length); False when the
        pages are not free now."""
        return True

    def swap_out(self, request_id: str) -> None:
        """Move a running request's device state to host memory and return its device pages (it pauses)."""
        raise NotImplementedError(f"{type(self).__name__} does not swap requests out")

    def swap_in(self, request_id: str, spare_blocks: int = 0) -> bool:
        """Bring a swapped-out request back onto the device (False: its pages, plus `spare_blocks`, are not free)."""
        raise NotImplementedError(f"{type(self).__name__} does not swap requests out")

    def rebalance(self, new_step: bool = True) -> bool:
        """Step thread, before a step: let a store that keeps some requests' entries on the device while it has room
        adjust to the room now (`cachetier.residency`); True when it freed pages for an admission. `new_step`: once
        per step (what the residency rule counts its steps by); False for a second call before the same step."""
        return False

    def finished(self, request_id: str, generated: int) -> None:  # noqa: B027 - only an estimating store listens
        """A request is about to leave after generating `generated` tokens (the admission estimate learns from it)."""

    @abstractmethod
    def batch(self, request_ids: list[str]) -> DecodeKV:
        """A view of exactly these requests (one row each) for one eagerly run step."""

    def step_view(
        self, request_ids: list[str], num_rows: int, num_blocks: int | None = None, tokens: list[int] | None = None,
        min_blocks: int = 1, private: bool = False, c4_mode: str | None = None,
    ) -> DecodeKV | None:
        """The persistent view of a fixed-shape step (`num_rows` rows, `num_blocks` context blocks, or the
        bucket these requests need but at least `min_blocks`), loaded with these requests and their input
        tokens; None if this store cannot run one. `private`: a new view nobody else holds (a background
        compiler runs scratch steps on it while the step thread uses the persistent ones). `c4_mode`: one of
        `view_modes()` (None: the one these requests need)."""
        return None

    def view_modes(self) -> list[str | None]:
        """The kinds of view this store's fixed-shape steps use: a compiled step warms one graph up for each."""
        return [None]

    def bucket_blocks(self, request_ids: list[str], span: int = 1) -> int:
        """The block-table width (context bucket) a fixed-shape step over these requests needs, each verifying `span`
        positions (speculation; 1: one new token)."""
        raise NotImplementedError(f"{type(self).__name__} runs no fixed-shape steps")

    @abstractmethod
    def check_integrity(self) -> None:
        ...

    @abstractmethod
    def stats(self) -> dict:
        ...

    def close(self) -> None:  # noqa: B027 - most stores hold nothing that needs releasing
        """Release resources held outside Python's reach (pinned host memory)."""


# --- the plain reference store --------------------------------------------------------------------


class LayoutStore(KVStore):
    """Plain layouts, all resident, unbounded: decoding through it is the model's own decode path."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.layouts: dict[str, KVLayout | None] = {}

    def check_fits_ever(self, request_id, reserve_tokens) -> None:
        pass

    def fits(self, reserve_tokens, context_tokens=None) -> bool:
        return True

    def reserve(self, request_id, reserve_tokens, context_tokens=None, prefix_keys=()) -> bool:
        if request_id in self.layouts:
            raise ValueError(f"request {request_id} already holds pages")
        self.layouts[request_id] = None
        return True

    def fill(self, request_id, layout) -> None:
        self.layouts[request_id] = layout.clone()

    def free(self, request_id, keep=False) -> None:
        del self.layouts[request_id]

    def holds(self, request_id) -> bool:
        return request_id in self.layouts

    def batch(self, request_ids) -> DecodeKV:
        return LayoutBatch(self.cfg, [self.layouts[r] for r in request_ids])

    def check_integrity(self) -> None:
        pass

    def stats(self) -> dict:
        return {"kind": "layouts", "running": len(self.layouts),
                "device_bytes_used": sum(lay.total_bytes() for lay in self.layouts.values() if lay is not None)}


# --- the tiered store -----------------------------------------------------------------------------


class TieredStore(KVStore):
    def __init__(self, cfg: ModelConfig, tier: TierConfig, dtype: torch.dtype = torch.float32, device=None) -> None:
        self.cfg, self.tier = cfg, tier
        self.geo = g = Geometry(cfg, tier, dtype)
        dev = devices.current()
        self.device = torch.device(device) if device is not None else dev.torch_device
        # real pages first, then the scratch group and page (see `Geometry`)
        self.arena = torch.zeros(g.arena_pages * g.page_elems, dtype=g.arena_dtype, device=self.device)
        self.pages = PageAllocator(g.num_pages, g.group_pages)
        self.host_alloc: BlockAllocator | None = None
        self.hot: HotTier | None = None
        """The tier's hot-buffer state (tier on, with CSA layers): the host pool, entry maps, slot owners, stamps,
        the LRU clock and the counters — one owner, `cachetier.hot_tier`."""
        if g.offload and g.csa_layers:
            self.hot = HotTier(g, self.arena, self.device, pin=dev.pin_host_memory and self.device.type == "cuda")
            self.host_alloc = BlockAllocator(g.num_host_blocks)
        self.residents: dict[str, Resident] = {}
        self.retention = Retention(tier.retain_bytes if self.hot is not None else 0)
        """Finished requests' prompt pages kept for a follow-up turn (`cachetier.retention`; budget 0: none)."""
        self.sharing = Sharing(g.arena_pages, g.share_maps) if tier.share_prefixes else None
        """Full context pages running requests hold once (`cachetier.sharing`; None: each holds its own)."""
        self.policy = ReservePolicy(tier)
        self.grows = self.policy.elastic
        self.swapped: dict[str, Swapped] = {}
        """Requests paused with their device state in host memory (`swap_out`): they hold host blocks, no pages."""
        self.swaps = self.resumes = 0
        self.residency = ResidencyPolicy(g.group_pages, self.grows) if g.resident else None
        """Who keeps C4 entries resident on the device (`TierConfig.resident`; None: nobody)."""
        self.split_views = True
        """With residency: whether a step whose every request is resident gets a view of its own (no resolve at all).
        A runner that replays CUDA graphs per bucket turns it off: one mixed view per bucket serves every state."""
        self.promotions = self.demotions = 0
        self._changes = 0
        """Counts what can change residency's decision besides free pages and headroom: a request filled, or its
        blocks or C4 pages changed (`_changed`)."""
        self._settled: tuple[int, int, int] | None = None
        """(changes, free pages, headroom) when `rebalance` last found nothing to do: until one of them moves, it has
        nothing to do again, and a step at low load pays a comparison, not a scan."""
        self.mode_steps: dict[str, int] = {}
        """Views loaded for a step, per kind (`c4_mode`): how often a step read C4 entries which way."""
        self._alloc_lock = threading.Lock()  # reservations come from the actor's loop, frees from its step thread
        self._views: dict[tuple[int, int], TieredBatch] = {}
        self._staging: torch.Tensor | None = None  # pinned (CUDA): layouts cross to the device through it
        self._staged = None  # the CUDA event of the last copy out of it
        log.info("tier store: %s", g.describe())

    # arena views ---------------------------------------------------------------------------------

    def rows(self, width: int) -> torch.Tensor:
        """The arena as rows of `width` elements."""
        return self.arena.view(-1, width)

    def put_field(self, base: int, f: Field, values: torch.Tensor) -> None:
        """A whole field of a state group or page (its rows lie back to back from `base + f.offset`) <- values
        (already arena-typed, f's shape): one contiguous copy, no index tensor."""
        if values.numel() != f.numel:
            raise ValueError(f"{values.numel()} values for a field of {f.numel} elements {f.shape}")
        start = base + f.offset
        self.arena[start : start + f.numel] = values.reshape(-1).to(self.device)

    def group_base(self, group):
        return group * self.geo.group_pages * self.geo.page_elems

    def page_base(self, page):
        return page * self.geo.page_elems

    # admission -----------------------------------------------------------------------------------

    def check_fits_ever(self, request_id: str, reserve_tokens: int) -> None:
        g = self.geo
        nb = g.blocks_for(reserve_tokens)
        if g.group_pages + nb > g.num_pages:
            raise NeverFitsError(
                f"request {request_id} needs {g.request_device_bytes(nb)} device bytes for {reserve_tokens} tokens, more than "
                f"this decode worker's whole budget ({g.device_bytes(g.num_pages)}); lower max_tokens or the prompt, "
                "or raise --device-budget"
            )
        if self.host_alloc is not None and nb > self.host_alloc.num_blocks:
            raise NeverFitsError(
                f"request {request_id} needs {g.request_host_bytes(nb)} host-pool bytes, more than the whole host pool "
                f"({self.host_alloc.num_blocks * g.host_block_bytes}); raise --host-pool-bytes"
            )

    def _blocks_to_take(self, reserve_tokens: int, context_tokens: int | None) -> tuple[int, int]:
        """(device blocks, host blocks) admission takes for a request (the reserve policy decides the first)."""
        g = self.geo
        return g.blocks_for(self.policy.device_tokens(reserve_tokens, context_tokens)), g.blocks_for(reserve_tokens)

    def fits(self, reserve_tokens: int, context_tokens: int | None = None) -> bool:
        nb, nh = self._blocks_to_take(reserve_tokens, context_tokens)
        with self._alloc_lock:
            if self.host_alloc is not None and self.host_alloc.num_free + self.retention.host_blocks < nh:
                return False
            return self._pages_free_for(nb)

    def _host_room(self, n: int, spare: Kept | None) -> bool:
        """Whether `n` host blocks are free now, dropping kept entries (least recently kept first, never `spare`)
        until they are (lock held)."""
        while self.host_alloc.num_free < n:
            k = self.retention.pop_oldest(spare)
            if k is None:
                return False
            self.retention.evicted()
            self.host_alloc.free(k.owner, k.host_blocks)
        return True

    def _pages_free_for(self, nb: int) -> bool:
        """Whether a state group and `nb` blocks are free now (lock held); if not, residency learns the demand."""
        if self.pages.can_allocate(nb):
            return True
        if self.residency is not None:
            self.residency.refused(self.geo.group_pages + nb)
        return False

    def reserve(self, request_id: str, reserve_tokens: int, context_tokens: int | None = None,
                prefix_keys: tuple[str, ...] = ()) -> bool:
        """Take a state group and the blocks the reserve policy gives a request of `reserve_tokens` tokens now, and its
        host blocks at that final length. `prefix_keys`: the chain keys of its context's full pages
        (`cachetier.prefix.page_keys`); a kept entry they extend is taken over (`held_tokens`: what its handoff may
        leave out), and the request is kept under them when it finishes (`free(keep=True)`)."""
        nb, nh = self._blocks_to_take(reserve_tokens, context_tokens)
        keys = tuple(prefix_keys)
        with self._alloc_lock:
            if request_id in self.residents or request_id in self.swapped:
                raise ValueError(f"request {request_id} already holds pages")
            s = self._shareable(keys, 0, nb - 1)  # its first pages held by others already: references, not pages
            kept = self.retention.match(keys) if self.retention.enabled and keys else None
            if kept is not None and (kept.num_pages > nh or kept.num_pages <= s):
                kept = None  # sharing covers as much, with no copy
            if kept is not None:
                s = 0
            if not self._pages_free_for(nb - s):
                return False
            if self.host_alloc is not None and not self._host_room(nh - s - (kept.num_pages if kept else 0), kept):
                return False
            if self.residency is not None:
                self.residency.admitted()
            group, blocks = self.pages.allocate(request_id, nb - s)
            host_blocks, maps = [], []
            if s:
                shared, maps = self.sharing.take(request_id, keys[:s], mapped=self.hot is not None)
                blocks = [p.page for p in shared] + blocks
                host_blocks = [p.host_block for p in shared] if self.host_alloc is not None else []
            if kept is not None:
                self.retention.take(kept)
                self.host_alloc.transfer(kept.owner, request_id, kept.host_blocks)
                host_blocks = list(kept.host_blocks)
            if self.host_alloc is not None:
                host_blocks += self.host_alloc.allocate(request_id, nh - len(host_blocks))
            # host bookkeeping only: a reservation comes from the actor's event loop, and every device
            # operation of an actor runs on its step thread (`fill` makes the device tables)
            held = s or (kept.num_pages if kept else 0)
            r = Resident(request_id, group, blocks, host_blocks, 0, reserve_tokens,
                         np.array(blocks, dtype=np.int64), np.array(host_blocks, dtype=np.int64), prefix_keys=keys,
                         held=kept, held_tokens=held * self.geo.block_tokens, shared=s, maps=maps)
            self._set_map(r)
            self.residents[request_id] = r
        return True

    def _shareable(self, keys: tuple[str, ...], start: int, limit: int) -> int:
        """How many pages, from page `start` of a request whose context's full pages are named `keys`, it can hold
        by reference (at most up to page `limit`): registered ones, as many as map blocks are free for (lock held)."""
        if self.sharing is None or not keys:
            return 0
        m = self.sharing.match(keys, start, limit)
        if self.hot is not None and m > self.sharing.maps_free:
            self.sharing.count["no_map_block"] += m - self.sharing.maps_free
            m = self.sharing.maps_free
        return m

    def _set_map(self, r: Resident) -> None:
        """A request's entry-map block table from its shared pages' map blocks and its own blocks."""
        r.map_np = np.concatenate((np.array(r.maps, dtype=np.int64), r.blocks_np[r.shared :])) if r.shared else r.blocks_np
        if r.blocks_t is not None:
            r.map_t = r.blocks_t if not r.shared else torch.from_numpy(r.map_np).to(self.device, non_blocking=True)

    def page_keys(self, context: tuple[int, ...]) -> tuple[str, ...]:
        return page_keys(context, self.geo.block_tokens) if self.sharing is not None or self.retention.enabled else ()

    def held_tokens(self, request_id: str) -> int:
        """Tokens at the start of a reserved request's context whose classical entries are kept or shared here: its
        handoff leaves them out (`cachetier.layout.without_prefix`)."""
        r = self.residents.get(request_id)  # read from the actor's loop: it may have lapsed already
        return r.held_tokens if r is not None else 0

    def fill(self, request_id: str, layout: KVLayout) -> None:
        """Write a prefilled layout into its reserved pages: C4 entries straight into the host pool
        (tier on), the rest into the arena."""
        r = self.residents.get(request_id)
        if r is None:
            raise ValueError(f"request {request_id} holds no reserved pages")
        if r.filled:
            raise ValueError(f"request {request_id} is already filled")
        room = min(r.reserve_tokens, len(r.blocks) * self.geo.block_tokens)
        if layout.num_tokens + 1 > room:
            raise ValueError(f"the layout of {request_id} has {layout.num_tokens} tokens but only {room} were reserved")
        skipped = skipped_tokens(layout)
        if skipped != r.held_tokens and (r.held is not None or skipped > r.held_tokens):  # shared pages: may be sent
            raise ValueError(f"the layout of {request_id} leaves out the entries of its first {skipped_tokens(layout)} "
                             f"tokens, but this worker keeps {r.held_tokens} for it")
        if r.shared * self.geo.block_tokens > layout.num_tokens:
            raise ValueError(f"the layout of {request_id} has {layout.num_tokens} tokens, fewer than the "
                             f"{r.shared * self.geo.block_tokens} of the shared pages its reservation took")
        if self.sharing is not None:
            self._share_at_fill(r, layout.num_tokens)
        r.blocks_t = torch.from_numpy(r.blocks_np).to(self.device, non_blocking=True)
        self._set_map(r)
        r.host_blocks_t = torch.from_numpy(r.host_blocks_np if len(r.host_blocks_np) else np.zeros(1, np.int64))
        if r.held is not None:
            layout = self._with_kept(r, layout)
            r.held = None
        self._write_layout(r, layout)
        r.num_tokens = layout.num_tokens
        r.mtp_floor = r.mtp_start = layout.num_tokens  # its MTP ring starts empty: the first decode position is its first entry
        r.filled = True
        self._changes += 1
        if self.sharing is not None:
            self._register(r)

    def _share_at_fill(self, r: Resident, num_tokens: int) -> None:
        """Step thread, before a request's layout is written: pages registered since it reserved (a sibling reserved
        beside it was filled first) are held by reference from now on, and its own copies of them go back."""
        full = min(len(r.prefix_keys), num_tokens // self.geo.block_tokens)
        with self._alloc_lock:
            more = self._shareable(r.prefix_keys, r.shared, full)
            if not more:
                return
            s = r.shared
            own = r.blocks[s : s + more]
            shared, maps = self.sharing.take(r.request_id, r.prefix_keys[s : s + more], at_fill=True,
                                             mapped=self.hot is not None)
            self.pages.free_blocks(r.request_id, own)
            blocks = [*r.blocks[:s], *(p.page for p in shared), *r.blocks[s + more :]]
            if self.host_alloc is not None:
                self.host_alloc.free(r.request_id, r.host_blocks[s : s + more])
                r.host_blocks = [*r.host_blocks[:s], *(p.host_block for p in shared), *r.host_blocks[s + more :]]
                r.host_blocks_np = np.array(r.host_blocks, dtype=np.int64)
            r.shared, r.maps = s + more, [*r.maps, *maps]
            r.blocks, r.blocks_np = blocks, np.array(blocks, dtype=np.int64)
            self._changed(r)

    def _register(self, r: Resident) -> None:
        """A filled request's own full context pages become shared pages (it is their first holder; they map as
        themselves), unless pages of theirs are registered already (map blocks ran out for it)."""
        full = min(len(r.prefix_keys), r.num_tokens // self.geo.block_tokens)
        s = r.shared
        if full <= s or r.prefix_keys[s] in self.sharing.pages:
            return
        with self._alloc_lock:
            pages = r.blocks[s:full]
            self.pages.transfer(r.request_id, OWNER, pages)
            hosts = r.host_blocks[s:full] if self.host_alloc is not None else [-1] * len(pages)
            if self.host_alloc is not None:
                self.host_alloc.transfer(r.request_id, OWNER, hosts)
            self.sharing.register(r.request_id, r.prefix_keys[s:full], pages, hosts)
            r.maps = [*r.maps, *pages]
            r.shared = full
        self._set_map(r)

    def _with_kept(self, r: Resident, layout: KVLayout) -> KVLayout:
        """The whole layout of a request whose handoff left out the pages kept for it: their C4 entries from its
        first host blocks, their indexer keys and HCA entries from the kept copy of their device pages."""
        g, kept = self.geo, r.held
        m = kept.num_pages
        fields = g.block_fields
        keys = hca = None
        if "index_keys" in fields:
            f = fields["index_keys"]
            keys = kept.pages[:, f.offset : f.offset + f.numel].reshape(m, *f.shape)  # [pages, csa layers, e4, row]
        if "hca" in fields:
            f = fields["hca"]
            hca = kept.pages[:, f.offset : f.offset + f.numel].reshape(m, *f.shape)
        host_rows = self.hot.host.rows(r.host_blocks_t, torch.arange(m * g.e4, device=r.host_blocks_t.device))
        prefix = []
        for layer, lk in enumerate(layout.layers):
            if lk.kind == "csa":
                j = g.csa_index[layer]
                prefix.append((self.hot.host.kv[j, host_rows].to(lk.entries.dtype),
                               keys[:, j].reshape(m * g.e4, -1).to(lk.index_keys.dtype)))
            elif lk.kind == "hca":
                prefix.append((hca[:, g.hca_index[layer]].reshape(m * g.eh, -1).to(lk.entries.dtype), None))
            else:
                prefix.append((None, None))
        return with_prefix(layout, prefix)

    def holds(self, request_id: str) -> bool:
        return request_id in self.residents or request_id in self.swapped

    def capacity(self) -> dict:
        """Free and total pages and host blocks (what routing decisions read). Resident C4 pages count as free: the
        next step gives them back to an admission that needs them (`cachetier.residency`)."""
        with self._alloc_lock:
            reclaimable = sum(len(r.c4_pages) for r in self.residents.values())
            return {"pages_free": self.pages.num_free + reclaimable, "pages_total": self.geo.num_pages,
                    "host_blocks_free": self.host_alloc.num_free + self.retention.host_blocks if self.host_alloc else 0,
                    "host_blocks_total": self.host_alloc.num_blocks if self.host_alloc else 0}

    def _check_rows(self, layout: KVLayout) -> None:
        """A layout's KV rows must be stored as this store stores them (same KV format and dtype)."""
        g = self.geo
        w = layout.layers[0].window
        if w.shape[-1] != g.md or w.dtype != g.arena_dtype:
            raise ValueError(f"the layout's KV rows are [{w.shape[-1]}] {w.dtype}, this store keeps "
                             f"[{g.md}] {g.arena_dtype} rows (kv format {g.codec.format}): the formats differ")

    def _write_layout(self, r: Resident, layout: KVLayout) -> None:
        """A layout's state, indexer keys and device-resident entries into the arena, its C4 entries into the host
        pool (tier on). Everything bound for the device crosses in one copy through pinned memory (`_stage`);
        C4 entries go to the host pool by whole host blocks. The request's shared pages (its first `r.shared` blocks:
        `cachetier.sharing`) are not written: their holders wrote the same entries. A layout whose first tokens'
        entries were left out (`skipped_tokens`, no more than those pages) supplies the rest; the ring's newest
        entries that it left out come from the host pool."""
        g = self.geo
        self._check_rows(layout)
        gb = self.group_base(r.group)
        sf = g.state_fields
        dt = self.arena.dtype
        cut, own = skipped_tokens(layout), r.shared * g.block_tokens  # layout rows start at `cut`; write from `own`
        if cut > own:
            raise ValueError(f"the layout of {r.request_id} leaves out {cut} tokens' entries, more than the {own} it "
                             "shares")

        def tail(t: torch.Tensor, rate: int) -> torch.Tensor:  # the layout rows of the entries from `own` on
            return t[(own - cut) // rate :]
        # what goes to the device, in order: the window rings, then per layer its compressor parts, its
        # indexer keys and its device entries (HCA; C4 with the tier off, the newest C4 entries with it on)
        moves: list[torch.Tensor] = [torch.stack([lk.window for lk in layout.layers]).to(dt)]  # [layers, window, row]
        writes: list[tuple[str, object]] = []
        n4 = layout.num_tokens // g.cfg.csa_rate  # C4 entries of the whole context
        for layer, lk in enumerate(layout.layers):
            for name, st in ((MAIN, lk.compressor), (INDEX, lk.index_compressor)):
                if st is None:
                    continue
                for part in ("kv", "score", "prev_kv", "prev_score"):
                    t = getattr(st, part)
                    if t is not None:
                        writes.append(("state", f"{layer}.{name}.{part}"))
                        moves.append(g.state_to_arena(t))
            if lk.kind == "csa":
                writes.append(("keys", layer))
                moves.append(tail(lk.index_keys, g.cfg.csa_rate).to(dt))
                if not g.offload:
                    writes.append(("c4", layer))
                    moves.append(tail(lk.entries, g.cfg.csa_rate).to(dt))
                elif g.reserved and n4:
                    writes.append(("ring", layer))
                    moves.append(lk.entries[max(0, n4 - g.reserved - cut // g.cfg.csa_rate):].to(dt))
            elif lk.kind == "hca":
                writes.append(("hca", layer))
                moves.append(tail(lk.entries, g.cfg.hca_rate).to(dt))
        on_device = self._stage(moves)
        self.put_field(gb, sf["swa"], on_device[0])
        rows = None
        for (what, key), t in zip(writes, on_device[1:]):
            if what == "state":
                self.put_field(gb, sf[key], t)
                continue
            lk = layout.layers[key]
            if what == "hca":
                j = g.hca_index[key]
                e = torch.arange(r.shared * g.eh, layout.num_tokens // g.cfg.hca_rate, device=self.device)
                f = g.block_fields["hca"]
                page = r.blocks_t[e // g.eh]
                self.rows(g.md)[f.row(self.page_base(page), j * g.eh + e % g.eh)] = t
                continue
            if rows is None:  # the index tensors every CSA layer of this request shares: made once
                rows = self._c4_rows(r, n4, r.shared * g.e4)
            j = g.csa_index[key]
            if what == "keys":
                self.arena[rows["keys"] + j * g.e4 * g.block_fields["index_keys"].width] = t
                if g.offload:
                    self._write_c4_host(r, j, tail(lk.entries, g.cfg.csa_rate), r.shared * g.e4, rows)
            elif what == "c4":
                self.rows(g.md)[rows["c4"] + j * g.e4] = t
            else:  # "ring": the newest entries also go into the ring of the hot buffer
                lo = max(0, n4 - g.reserved)
                left_out = max(0, cut // g.cfg.csa_rate - lo)  # ring entries the layout left out
                if left_out:
                    e = torch.arange(lo, lo + left_out, device=self.device)
                    t = torch.cat((self.hot.host_view[j][self.hot.host.rows(r.host_blocks_t.to(self.device), e)].to(dt), t))
                self.hot.place_newest(j, r.group, rows["slots"], rows["hot_rows"], t)

    def _stage(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """These tensors on the store's device. On CUDA the host ones are packed into one pinned staging buffer
        and cross in one non-blocking copy (a pageable copy is synchronous and slow); the arena writes that
        follow are device-to-device. On the CPU they already are where they go."""
        if self.device.type != "cuda":
            return tensors
        host = [i for i, t in enumerate(tensors) if t.device.type == "cpu"]
        if not host:
            return tensors
        spans, total = [], 0
        for i in host:
            n = tensors[i].numel() * tensors[i].element_size()
            spans.append((i, total, n))
            total += -(-n // 256) * 256
        if self._staged is not None:
            self._staged.synchronize()  # the previous layout's copy has left the staging buffer
        if self._staging is None or self._staging.numel() < total:
            grown = max(total, 2 * self._staging.numel()) if self._staging is not None else total
            self._staging = torch.empty(grown, dtype=torch.uint8, pin_memory=True)
        for i, off, n in spans:
            if n:
                self._staging[off : off + n].copy_(tensors[i].contiguous().view(-1).view(torch.uint8))
        dev = torch.empty(total, dtype=torch.uint8, device=self.device)
        dev.copy_(self._staging[:total], non_blocking=True)
        self._staged = torch.cuda.Event()
        self._staged.record()
        out = list(tensors)
        for i, off, n in spans:
            t = tensors[i]
            out[i] = dev[off : off + n].view(t.dtype).view(t.shape)
        return out

    def _c4_rows(self, r: Resident, n: int, start: int = 0) -> dict[str, torch.Tensor]:
        """Where a request's C4 entries start..n (and their indexer keys) go, for CSA layer 0 (layer j is offset); its
        entry-map rows; the ring slots and map rows of its newest entries."""
        g, dev = self.geo, self.device
        e = torch.arange(start, n, device=dev)
        pb = self.page_base(r.blocks_t[e // g.e4])
        f = g.block_fields["index_keys"]
        out = {"keys": f.start(pb, e % g.e4)[:, None] + torch.arange(f.width, device=dev)}
        if not g.offload:
            out["c4"] = g.block_fields["c4"].row(pb, e % g.e4)
            return out
        out["map"] = self._map_rows(r.map_t)
        if g.reserved and n:
            newest = torch.arange(max(0, n - g.reserved), n, device=dev)
            out["slots"] = g.lru + newest % g.reserved
            out["hot_rows"] = block_rows(r.map_t, newest, g.e4)
        return out

    def _map_rows(self, blocks_t: torch.Tensor) -> torch.Tensor:
        """The hot tier's entry-map rows of every C4 entry of these pages."""
        e4 = self.geo.e4
        return (blocks_t[:, None] * e4 + torch.arange(e4, device=self.device)).flatten()

    def _write_c4_host(self, r: Resident, j: int, entries: torch.Tensor, first: int, rows: dict[str, torch.Tensor]) -> None:
        """CSA layer j's C4 entries `first`.. (a multiple of a block's) into the request's host blocks, whole blocks
        at a time, and fresh bookkeeping: none of its entries is resident yet. The blocks go through NumPy's indexed
        assignment of byte rows: for 32K entries of 584 B, 1.5 ms against 11 ms for torch's indexed row copy and
        13 ms for `index_copy_` here (`python -m bench.admission`)."""
        g, host = self.geo, self.hot.host
        n, e4, b0 = entries.shape[0], g.e4, first // g.e4
        kv = host.kv[j]  # [host rows, row]
        if entries.device != kv.device:  # written from the device (a prefill in this process, on its GPU)
            e = torch.arange(first, first + n, device=entries.device)
            write_rows(self.hot.host_view, j, host.rows(r.host_blocks_t.to(entries.device), e), entries)
        else:
            full = n // e4
            src = entries.to(kv.dtype).contiguous()
            if full:
                dst = kv.view(-1, e4 * kv.shape[-1]).view(torch.uint8).numpy()  # [host blocks, block bytes]
                dst[r.host_blocks_np[b0 : b0 + full]] = src[: full * e4].reshape(full, -1).view(torch.uint8).numpy()
            if n > full * e4:
                start = r.host_blocks[b0 + full] * e4
                kv[start : start + n - full * e4] = src[full * e4 :]
        self.hot.forget(j, r.group, rows["map"])

    def free(self, request_id: str, keep: bool = False) -> None:
        """Return what a request holds. `keep` (it finished): its prompt pages stay for a follow-up turn, within the
        retention budget (`cachetier.retention`)."""
        kept = self._to_keep(self.residents.get(request_id)) if keep else None
        copies: list[tuple[int, int]] = []
        with self._alloc_lock:
            if request_id in self.swapped:
                r = self.swapped.pop(request_id).resident
            else:
                r = self.residents.pop(request_id)
                self.pages.free(request_id, r.group, r.blocks[r.shared :] + r.c4_pages)
            if kept is not None and r.shared:
                kept, copies = self._keep_shared(r, kept)
            if r.shared:  # its references go; the pages nobody holds now are freed (or their C4 entries kept)
                gone = self.sharing.release(request_id, r.shared_keys, r.maps)
                self.pages.free_blocks(OWNER, [p.page for p in gone])
                if self.host_alloc is not None:
                    taken = set(kept.host_blocks) if kept is not None else set()
                    if taken:
                        self.host_alloc.transfer(OWNER, kept.owner, [p.host_block for p in gone if p.host_block in taken])
                    self.host_alloc.free(OWNER, [p.host_block for p in gone if p.host_block not in taken])
            if self.host_alloc is None:
                return
            rest = r.host_blocks[r.shared :]
            if kept is not None:
                self.host_alloc.transfer(request_id, kept.owner, r.host_blocks[r.shared : kept.num_pages])
                rest = r.host_blocks[max(r.shared, kept.num_pages) :]
                for old in self.retention.add(kept):
                    self.host_alloc.free(old.owner, old.host_blocks)
            self.host_alloc.free(request_id, rest)
        if copies:  # step thread: nothing frees the shared blocks these read until it returns
            e4, kv = self.geo.e4, self.hot.host.kv
            src, dst = (torch.tensor([c[i] for c in copies], dtype=torch.long, device=kv.device) for i in (0, 1))
            ar = torch.arange(e4, device=kv.device)
            kv[:, (dst[:, None] * e4 + ar).flatten()] = kv[:, (src[:, None] * e4 + ar).flatten()]

    def _keep_shared(self, r: Resident, kept: Kept) -> tuple[Kept | None, list[tuple[int, int]]]:
        """A finishing request's kept entry whose first pages are shared (lock held): a page it was the last to hold
        gives its host block to the entry; one others still hold is copied into a free host block (the copy is made
        once the lock is released: (from, to) blocks). As many pages are kept as there are blocks for."""
        hosts: list[int | None] = []  # None: a copy into a new block
        copies, free = 0, self.host_alloc.num_free
        for i in range(kept.num_pages):
            if i >= r.shared:
                hosts.append(r.host_blocks[i])
            elif self.sharing.pages[r.prefix_keys[i]].holders == {r.request_id}:
                hosts.append(self.sharing.pages[r.prefix_keys[i]].host_block)
            elif copies < free:
                hosts.append(None)
                copies += 1
            else:
                break
        m = len(hosts)
        if not m:
            return None, []
        new = iter(self.host_alloc.allocate(kept.owner, copies))
        pairs = []
        for i, h in enumerate(hosts):
            if h is None:
                hosts[i] = next(new)
                pairs.append((self.sharing.pages[r.prefix_keys[i]].host_block, hosts[i]))
        self.retention.count["copied_pages"] += len(pairs)
        return Kept(kept.owner, kept.keys[:m], hosts, kept.pages[:m], kept.nbytes * m // kept.num_pages), pairs

    def _to_keep(self, r: Resident | None) -> Kept | None:
        """What of a finishing request is kept (step thread: copies its prompt pages' device contents to the host);
        None when retention is off or it does not fit the budget."""
        g = self.geo
        if r is None or not self.retention.enabled or not r.filled or not r.prefix_keys:
            return None
        m = min(len(r.prefix_keys), r.num_tokens // g.block_tokens, len(r.blocks), len(r.host_blocks))
        nbytes = m * (g.host_block_bytes + g.page_elems * g.elem)
        if not m or not self.retention.fits(nbytes):
            if m:
                self.retention.count["refused"] += 1
            return None
        if r.c4_pages:
            self._write_back(r)  # the host pool must hold every entry of the kept pages
        pages = self.arena.view(-1, g.page_elems)[r.blocks_t[:m]].to("cpu")
        return Kept(f"kept:{r.request_id}", r.prefix_keys[:m], r.host_blocks[:m], pages, nbytes)

    def finished(self, request_id: str, generated: int) -> None:
        self.policy.finished(generated)

    # growth and swapping (reserve=estimate) -------------------------------------------------------

    def grow(self, request_id: str, ahead: int) -> bool:
        """Blocks for `ahead` more tokens than the request holds (capped at its final length): the new pages' C4
        entries start unmapped in the hot tier, as a fresh request's do."""
        r = self.residents[request_id]
        need = self.geo.blocks_for(min(r.num_tokens + ahead, r.reserve_tokens)) - len(r.blocks)
        if need <= 0:
            return True
        total = self._growth_pages(r, need)
        if self.pages.num_free < total and self._reclaim(total):  # resident C4 pages go first
            total = self._growth_pages(r, need)  # this request's own may have gone
        with self._alloc_lock:
            if self.pages.num_free < total:
                return False
            new = self.pages.allocate_blocks(request_id, need)
            c4 = self.pages.allocate_blocks(request_id, total - need)
        self._set_blocks(r, r.blocks + new)
        if c4:
            self._set_c4(r, r.c4_pages + c4)
        if self.hot is not None:
            rows = self._map_rows(r.map_t[-need:])
            for j in range(len(self.geo.csa_layers)):
                self.hot.unmap(j, rows)
        return True

    def _growth_pages(self, r: Resident, need: int) -> int:
        """Pages `need` more blocks of a request take: theirs, and their C4 pages while it is resident."""
        return need * (1 + (self.geo.c4_pages_per_block if r.c4_pages else 0))

    def _changed(self, r: Resident) -> None:
        """A request's tables (blocks, C4 pages) or state changed: views reload its tables, and residency looks again."""
        r.tables_version += 1
        self._changes += 1

    def _set_blocks(self, r: Resident, blocks: list[int]) -> None:
        self._changed(r)
        r.blocks = blocks
        r.blocks_np = np.array(blocks, dtype=np.int64)
        r.blocks_t = torch.from_numpy(r.blocks_np).to(self.device, non_blocking=True)
        self._set_map(r)

    def _page_index(self, r: Resident) -> torch.Tensor:
        """The arena pages a request holds on the device as its own, in order: its state group's, then its blocks
        after the shared ones (those stay where they are while it is paused: `cachetier.sharing`)."""
        gp = self.geo.group_pages
        pages = np.concatenate((np.arange(r.group * gp, (r.group + 1) * gp, dtype=np.int64), r.blocks_np[r.shared :]))
        return torch.from_numpy(pages).to(self.device)

    def swap_out(self, request_id: str) -> None:
        """The request's device pages (state group and blocks) to host memory in one gather and one copy, then back to
        the allocator; its host blocks (the authoritative C4 entries) stay where they are."""
        r = self.residents[request_id]
        if not r.filled:
            raise ValueError(f"request {request_id} is only reserved: nothing of it runs yet")
        if r.c4_pages:
            self._write_back(r)  # its C4 pages are given up below: the host pool must hold every entry
        saved = self.arena.view(-1, self.geo.page_elems)[self._page_index(r)].to("cpu")
        with self._alloc_lock:
            del self.residents[request_id]
            self.pages.free(request_id, r.group, r.blocks[r.shared :] + r.c4_pages)  # resident C4 entries: the host has them
            self.swapped[request_id] = Swapped(r, saved)
        if r.c4_pages:
            self._set_c4(r, [])
        self.swaps += 1

    def swap_in(self, request_id: str, spare_blocks: int = 0) -> bool:
        """A swapped-out request back into fresh pages (when they and `spare_blocks` more are free): its pages'
        contents copied back, then its hot buffers rebuilt as at admission: nothing mapped but the ring, which gets
        the newest C4 entries from the host pool. (LRU contents are not restored: a miss refills them, and the rows
        attention reads are the same either way.)"""
        sw = self.swapped[request_id]
        r = sw.resident
        own = len(r.blocks) - r.shared  # its shared pages stayed
        if not self.pages.can_allocate(own + spare_blocks):
            self._reclaim(self.geo.group_pages + own + spare_blocks)
        with self._alloc_lock:
            if not self.pages.can_allocate(own + spare_blocks):
                return False
            group, blocks = self.pages.allocate(request_id, own)
            del self.swapped[request_id]
            r.group = group
            self._set_blocks(r, r.blocks[: r.shared] + blocks)
            self.residents[request_id] = r
        self.arena.view(-1, self.geo.page_elems)[self._page_index(r)] = sw.pages.to(self.device)
        if self.hot is not None:
            self._rebuild_hot(r)
        self.resumes += 1
        return True

    def _rebuild_hot(self, r: Resident) -> None:
        """A request's hot buffers as at admission: nothing mapped but the ring, which gets the newest C4 entries from
        the host pool. (LRU contents are not restored: a miss refills them, and the rows attention reads are the same
        either way.)"""
        n = r.num_tokens // self.cfg.csa_rate
        rows = self._c4_rows(r, n)
        for j in range(len(self.geo.csa_layers)):
            self.hot.forget(j, r.group, rows["map"])
            if "slots" in rows:
                newest = torch.arange(max(0, n - self.geo.reserved), n, device="cpu")  # the host pool's rows
                vectors = self.hot.host.kv[j, self.hot.host.rows(r.host_blocks_t, newest)].to(self.device)
                self.hot.place_newest(j, r.group, rows["slots"], rows["hot_rows"], vectors)

    # residency (TierConfig.resident; `cachetier.residency`) ------------------------------------------

    def _set_c4(self, r: Resident, pages: list[int]) -> None:
        self._changed(r)
        r.c4_pages = pages
        r.c4_np = np.array(pages, dtype=np.int64)
        r.c4_t = torch.from_numpy(r.c4_np).to(self.device) if pages else None

    def _resident_c4(self, r: Resident, start: int = 0, end: int | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A resident request's C4 entries start..end (default: all so far): their host-pool rows and, per CSA layer,
        their arena rows."""
        n = r.num_tokens // self.cfg.csa_rate
        e = torch.arange(start, n if end is None else end, device="cpu")  # the host pool's rows
        dev_e = e.to(self.device)
        return (self.hot.host.rows(r.host_blocks_t, e),
                [resident_c4_rows(r.c4_t, j, dev_e, self.geo) for j in range(len(self.geo.csa_layers))])

    def make_resident(self, request_id: str) -> bool:
        """Step thread. A running request's C4 entries from the host pool into device pages of its own, its hot
        buffers emptied (its steps read those pages instead); False when the pages are not free now."""
        r = self.residents[request_id]
        if r.c4_pages or not r.filled or self.residency is None:
            return bool(r.c4_pages)
        need = len(r.blocks) * self.geo.c4_pages_per_block
        with self._alloc_lock:
            if self.pages.num_free < need:
                return False
            pages = self.pages.allocate_blocks(request_id, need)
        self._set_c4(r, pages)
        host_rows, dev_rows = self._resident_c4(r)
        r.c4_host_upto = len(host_rows)
        map_rows = self._map_rows(r.map_t)
        for j, rows in enumerate(dev_rows):
            if len(host_rows):
                self.rows(self.geo.md)[rows] = self.hot.host.kv[j, host_rows].to(self.device)
            self.hot.forget(j, r.group, map_rows)
        self.promotions += 1
        return True

    def drop_resident(self, request_id: str) -> None:
        """Step thread. A resident request back to its hot buffer: its C4 pages return to the pool (the host pool has
        every entry), its hot buffers rebuilt as after a resume."""
        r = self.residents[request_id]
        if not r.c4_pages:
            return
        self._write_back(r)
        with self._alloc_lock:
            self.pages.free_blocks(request_id, r.c4_pages)
        self._set_c4(r, [])
        self._rebuild_hot(r)
        self.demotions += 1

    def _write_back(self, r: Resident) -> None:
        """The C4 entries a resident request appended since it became resident, from its device pages to its host
        blocks (resident steps write the device only): one gather and one copy per CSA layer."""
        host_rows, dev_rows = self._resident_c4(r, r.c4_host_upto)
        if len(host_rows):
            for j, rows in enumerate(dev_rows):
                self.hot.host.kv[j, host_rows] = self.rows(self.geo.md)[rows].to("cpu", self.hot.host.kv.dtype)
                self.hot.host_writes[j] += len(host_rows)
        r.c4_host_upto += len(host_rows)

    def _reclaim(self, pages: int) -> bool:
        """Step thread. Resident requests drop their C4 pages, the largest first, until `pages` pages are free or
        nobody is resident; whether any did."""
        if self.residency is None:
            return False
        dropped = False
        while self.pages.num_free < pages:
            holders = [r for r in self.residents.values() if r.c4_pages]
            if not holders:
                break
            self.drop_resident(max(holders, key=lambda r: len(r.c4_pages)).request_id)
            dropped = True
        return dropped

    def rebalance(self, new_step: bool = True) -> bool:
        """Step thread, before a step: residency follows the room (`cachetier.residency`): below the headroom the
        largest resident requests shrink; above it plus a request's C4 pages, the smallest filled ones grow. True when
        a request shrank (pages were freed for an admission)."""
        if self.residency is None:
            return False
        if new_step:
            self.residency.tick()
        room = self.residency.headroom(len(self.residents))
        if (self._changes, self.pages.num_free, room) == self._settled:
            return False  # nothing that decides moved since the last look found nothing to do: the common case
        if self._reclaim(room):
            return True
        kq = self.geo.c4_pages_per_block
        if self.pages.num_free - room >= kq:  # else not even a one-block request could grow: no scan
            for r in sorted((r for r in self.residents.values() if r.filled and not r.c4_pages), key=lambda r: len(r.blocks)):
                if self.pages.num_free - len(r.blocks) * kq < room or not self.make_resident(r.request_id):
                    break
        self._settled = (self._changes, self.pages.num_free, room)
        return False

    def _c4_mode(self, residents: list[Resident], forced: str | None) -> str:
        """The view kind a step over these residents reads C4 entries with (`cachetier.tiered_batch`)."""
        if self.residency is None:
            return TIERED
        if forced is not None:
            return forced
        if self.split_views and residents and all(map(is_resident, residents)):
            return RESIDENT
        return MIXED

    def context_blocks(self, residents: list[Resident]) -> int:
        """The context bucket of a step over these residents (`cachetier.buckets`)."""
        return context_blocks(max(map(num_tokens_of, residents), default=0) + 1, self.geo.block_tokens)

    def batch(self, request_ids: list[str]) -> TieredBatch:
        return self.step_view(request_ids, len(request_ids))

    def bucket_blocks(self, request_ids: list[str], span: int = 1) -> int:
        res = list(map(self.residents.__getitem__, request_ids))
        return context_blocks(max(map(num_tokens_of, res), default=0) + span, self.geo.block_tokens)

    def new_view(self, num_rows: int, num_blocks: int, c4_mode: str = TIERED) -> TieredBatch:
        """A fresh step view of `num_rows` x `num_blocks` over this store (`step_view` keeps one per bucket)."""
        return TieredBatch(self.cfg, self.geo, self.arena, self.hot, self.device, num_rows, num_blocks, c4_mode)

    def view_modes(self) -> list[str]:
        """The view kinds this store's steps may use (what a compiled step warms up: one graph each)."""
        if self.residency is None:
            return [TIERED]
        return [MIXED, RESIDENT] if self.split_views else [MIXED]

    def step_view(
        self, request_ids: list[str], num_rows: int, num_blocks: int | None = None, tokens: list[int] | None = None,
        min_blocks: int = 1, private: bool = False, c4_mode: str | None = None,
    ) -> TieredBatch:
        """`c4_mode`: the view kind to use (a warm-up over padding picks each in turn); None: what these requests need."""
        res = list(map(self.residents.__getitem__, request_ids))
        key = (num_rows, num_blocks or max(min_blocks, self.context_blocks(res)))
        mode = self._c4_mode(res, c4_mode)
        self.mode_steps[mode] = self.mode_steps.get(mode, 0) + 1
        if private:
            view = self.new_view(*key, mode)
        else:
            if (*key, mode) not in self._views:  # its buffers stay, so a graph captured on them replays with each step's contents
                self._views[(*key, mode)] = self.new_view(*key, mode)
            view = self._views[(*key, mode)]
        view.load(res, tokens)
        return view

    def mtp_history(self, request_ids: list[str]) -> list[int]:
        """Positions each request's MTP ring holds entries for (since its floor, `restart_mtp`)."""
        return [self.residents[rid].num_tokens - self.residents[rid].mtp_floor for rid in request_ids]

    def mtp_restarted(self, request_ids: list[str]) -> list[bool]:
        """Whether each request's MTP ring restarted after its admission (plain steps ran in between)."""
        return [self.residents[rid].mtp_floor != self.residents[rid].mtp_start for rid in request_ids]

    def restart_mtp(self, request_ids: list[str]) -> None:
        """These requests' MTP rings hold nothing before their next position (steps ran without speculation, so
        the entries of those positions were never written): drafting reads only what speculative steps write."""
        for rid in request_ids:
            r = self.residents[rid]
            r.mtp_floor = r.num_tokens

    def spec_view(self, request_ids: list[str], requests: int, span: int, num_blocks: int | None = None,
                  tokens: list[list[int]] | None = None, drafts: list[int] | None = None, min_blocks: int = 1,
                  private: bool = False, c4_mode: str | None = None) -> SpecBatch:
        """The speculative step's view (`cachetier.spec_batch`): `requests` x `span` rows, the block table wide
        enough for every verified position, kept per (requests, blocks, span) like `step_view`'s."""
        if self.geo.spec_tokens < span - 1:
            raise ValueError(f"this store was made for {self.geo.spec_tokens} draft tokens a step "
                             f"(TierConfig.speculative_tokens), not {span - 1}")
        res = list(map(self.residents.__getitem__, request_ids))
        blocks = num_blocks or max(min_blocks, self.bucket_blocks(request_ids, span))
        mode = self._c4_mode(res, c4_mode)
        self.mode_steps[mode] = self.mode_steps.get(mode, 0) + 1
        key = ("spec", requests, blocks, span, mode)
        view = None if private else self._views.get(key)
        if view is None:
            view = SpecBatch(self.cfg, self.geo, self.arena, self.hot, self.device, requests, blocks, span, mode)
            if not private:
                self._views[key] = view
        view.load(res, tokens, drafts)
        return view

    # accounting ----------------------------------------------------------------------------------

    def device_bytes_used(self) -> int:
        g = self.geo
        used_pages = g.num_pages - self.pages.num_free
        return used_pages * g.page_bytes + len(self.residents) * g.meta_bytes_per_group

    def host_bytes_used(self) -> int:
        if self.host_alloc is None:
            return 0
        return (self.host_alloc.num_blocks - self.host_alloc.num_free) * self.geo.host_block_bytes

    def counter_totals(self) -> dict:
        if self.hot is not None:
            return self.hot.totals()
        return {"hits": 0, "misses": 0, "evictions": 0, "bytes_h2d": 0, "bytes_d2h": 0}

    def stats(self) -> dict:
        g = self.geo
        out = {
            "kind": "tiered", "offload": g.offload, "running": len(self.residents),
            "device_bytes_used": self.device_bytes_used(), "device_bytes_total": g.device_bytes(g.num_pages),
            "host_bytes_used": self.host_bytes_used(),
            "host_bytes_total": (self.host_alloc.num_blocks * g.host_block_bytes) if self.host_alloc else 0,
            "pages_free": self.pages.num_free, "pages_total": g.num_pages,
        }
        if self.grows:
            out.update(reserve="estimate", output_estimate_tokens=self.policy.estimate(), swapped=len(self.swapped),
                       swapped_bytes=sum(sw.pages.numel() * sw.pages.element_size() for sw in self.swapped.values()),
                       swaps=self.swaps, resumes=self.resumes)
        if self.retention.enabled:
            out.update(self.retention.stats())
        if self.sharing is not None:
            out.update(self.sharing.stats())
        if self.residency is not None:
            out.update(resident_requests=sum(1 for r in self.residents.values() if r.c4_pages),
                       resident_c4_pages=sum(len(r.c4_pages) for r in self.residents.values()),
                       promotions=self.promotions, demotions=self.demotions, c4_mode_steps=dict(self.mode_steps))
        out.update(self.counter_totals())
        return out

    # integrity -----------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """free + used == total on both tiers, ownership matches, every hot slot holds a live entry. Holds the
        allocation lock throughout: a reservation from the actor's event loop is never seen half made."""
        with self._alloc_lock:
            self._check_integrity()

    def _check_integrity(self) -> None:
        g = self.geo

        def fail(msg: str) -> None:
            raise IntegrityError(msg)

        owned = sum(1 for o in self.pages.owner if o is not None)
        if owned + self.pages.num_free != g.num_pages:
            fail(f"device pages: {owned} used + {self.pages.num_free} free != {g.num_pages}")
        shared = self.sharing.pages if self.sharing is not None else {}
        expect = sum(g.group_pages + len(r.blocks) - r.shared + len(r.c4_pages) for r in self.residents.values())
        if owned != expect + len(shared):
            fail(f"device pages: {owned} owned but residents hold {expect} of their own and {len(shared)} are shared")
        if not self.pages.group_counts_hold():
            fail("device pages: the per-group counts the allocator keeps differ from the pages' owners")
        for r in self.residents.values():
            gp = range(r.group * g.group_pages, (r.group + 1) * g.group_pages)
            if any(self.pages.owner[p] != r.request_id for p in [*gp, *r.blocks[r.shared :], *r.c4_pages]):
                fail(f"{r.request_id}: a page it holds is owned by someone else")
            if r.c4_pages and len(r.c4_pages) != len(r.blocks) * g.c4_pages_per_block:
                fail(f"{r.request_id}: {len(r.c4_pages)} resident C4 pages for {len(r.blocks)} blocks")
            if len(r.blocks) * g.block_tokens < r.num_tokens:
                fail(f"{r.request_id}: {r.num_tokens} tokens in {len(r.blocks)} blocks")
        self._check_sharing(fail)
        if self.hot is None:
            return
        h_owned = sum(1 for o in self.host_alloc.owner if o is not None)
        if h_owned + self.host_alloc.num_free != self.host_alloc.num_blocks:
            fail(f"host blocks: {h_owned} used + {self.host_alloc.num_free} free != {self.host_alloc.num_blocks}")
        holders = [*self.residents.values(), *(sw.resident for sw in self.swapped.values())]
        kept = list(self.retention.kept.values())
        if h_owned != (sum(len(r.host_blocks) - r.shared for r in holders) + sum(len(k.host_blocks) for k in kept)
                       + len(shared)):
            fail("host blocks owned do not match the residents', swapped requests', kept entries' and shared pages' tables")
        for r in holders:
            if any(self.host_alloc.owner[b] != r.request_id for b in r.host_blocks[r.shared :]):
                fail(f"{r.request_id}: a host block it holds is owned by someone else")
        for k in kept:
            if any(self.host_alloc.owner[b] != k.owner for b in k.host_blocks):
                fail(f"{k.owner}: a host block it keeps is owned by someone else")
            if len(k.host_blocks) != k.num_pages or tuple(k.pages.shape) != (k.num_pages, g.page_elems):
                fail(f"{k.owner}: {len(k.host_blocks)} host blocks and {tuple(k.pages.shape)} page rows for "
                     f"{k.num_pages} pages")
        if sum(k.nbytes for k in kept) != self.retention.nbytes or self.retention.nbytes > self.retention.budget:
            fail(f"kept entries: {self.retention.nbytes} bytes counted, budget {self.retention.budget}")
        for r in self.residents.values():
            if not r.filled:
                continue  # reserved only: nothing of it is written yet
            problems = self.hot.check(r.request_id, r.group, r.map_t, r.host_blocks_t, r.num_tokens // self.cfg.csa_rate,
                                      resident=bool(r.c4_pages))
            if r.c4_pages:  # its device copy of every C4 entry the host holds equals the host's
                host_rows, dev_rows = self._resident_c4(r, 0, r.c4_host_upto)
                for j, rows in enumerate(dev_rows):
                    if not torch.equal(self.rows(g.md)[rows].cpu(), self.hot.host.kv[j, host_rows]):
                        problems.append(f"{r.request_id} layer {j}: a resident C4 row differs from its host copy")
            if problems:
                fail(problems[0])

    def _check_sharing(self, fail) -> None:
        """Shared pages: each owned by the registry (device page and host block), held by exactly the requests whose
        first blocks it is, at the place its key gives; every holder's map blocks its own and none mapped twice."""
        if self.sharing is None:
            return
        holders = [*self.residents.values(), *(sw.resident for sw in self.swapped.values())]
        held: dict[str, set[str]] = {}
        maps_seen: dict[int, str] = {}
        for r in holders:
            if len(r.maps) != r.shared or r.shared > len(r.prefix_keys) or len(r.map_np) != len(r.blocks):
                fail(f"{r.request_id}: {r.shared} shared pages, {len(r.maps)} map blocks, {len(r.prefix_keys)} page keys")
            for i, key in enumerate(r.shared_keys):
                p = self.sharing.pages.get(key)
                if p is None or p.page != r.blocks[i] or (self.host_alloc is not None and p.host_block != r.host_blocks[i]):
                    fail(f"{r.request_id}: its shared block {i} is not the page registered under its key")
                held.setdefault(key, set()).add(r.request_id)
            own = r.map_np[r.shared :].tolist() != r.blocks_np[r.shared :].tolist()
            if own or r.map_np[: r.shared].tolist() != list(r.maps):
                fail(f"{r.request_id}: its entry-map table is not its map blocks and its own blocks")
            for i, m in enumerate(r.maps):
                if m == r.blocks[i]:
                    continue  # the page's first holder: it maps as itself
                if self.sharing.map_owner.get(m) != r.request_id or m in maps_seen:
                    fail(f"{r.request_id}: map block {m} is not its own (held by {self.sharing.map_owner.get(m)!r})")
                maps_seen[m] = r.request_id
        if len(maps_seen) != len(self.sharing.map_owner):
            fail(f"map blocks: {len(self.sharing.map_owner)} taken, {len(maps_seen)} in holders' tables")
        for key, p in self.sharing.pages.items():
            if p.holders != held.get(key, set()):
                fail(f"shared page {p.page}: held by {sorted(p.holders)}, yet in the tables of {sorted(held.get(key, ()))}")
            if self.pages.owner[p.page] != OWNER or (self.host_alloc is not None and self.host_alloc.owner[p.host_block] != OWNER):
                fail(f"shared page {p.page}: not owned by the shared pages in the allocators")
        if set(held) - set(self.sharing.pages):
            fail("a request holds a shared page that is not registered")

    def close(self) -> None:
        if self.hot is not None:
            self.hot.close()
