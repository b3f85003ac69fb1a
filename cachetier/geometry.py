"""Sizes and offsets of the device arena: pages, state groups, host blocks, byte budget.

All KV data sits in one flat device tensor. A *page* holds one classical block: for `block_tokens`
tokens the indexer keys of every CSA layer, the HCA entries of every HCA layer and — only with the
tier off — the C4 entries of every CSA layer. A request's fixed-size *state* (window rings of every
layer, compressor tails and overlaps, and with the tier on its hot buffers) fills a group of
consecutive pages.

Rows are stored as the model's KV format stores them (`kernels.kv_format`): with `bf16` the arena is
in the compute dtype and a row is `head_dim` (or `index_head_dim`) elements; with a packed format
(`v4`) the arena is bytes, a main row (SWA key, C4/HCA entry, hot slot) is its packed size and an
indexer key its packed size, and the compressor state (kept in the compute dtype) is stored as its
raw bytes. Fields whose rows attention reads as a pool (`Field.rowed`: SWA, C4, HCA, hot) start at an
offset that is a multiple of their row width, so the arena can be viewed as rows of that width and a
row index is simply (element offset / width); the others are addressed by element offset
(`Field.start`). Without packing every field is aligned that way (the layout of earlier versions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from core.config import ModelConfig
from core.configs import TierConfig, format_bytes
from kernels.kv_format import model_codec


class BudgetTooSmall(ValueError):
    pass


@dataclass(frozen=True)
class Field:
    offset: int
    """Element offset from the start of the page (block fields) or of the group (state fields)."""
    shape: tuple[int, ...]
    width: int
    """Row width in arena elements: the last axis."""
    rowed: bool = True
    """Whether the field starts at a multiple of `width` (so `row` is valid)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def row(self, base_elems, local_row):
        """Row index in the arena viewed as rows of `width` (rowed fields only)."""
        assert self.rowed, "field is not aligned to its row width; address it with start()"
        return (base_elems + self.offset) // self.width + local_row

    def start(self, base_elems, local_row):
        """Element offset of a row in the flat arena."""
        return base_elems + self.offset + local_row * self.width


def block_rows(table: torch.Tensor, entries: torch.Tensor, per_block: int) -> torch.Tensor:
    """The pool row of each entry, for a pool cut into blocks of `per_block` rows and a request's block
    table: table[..., e // per_block] * per_block + e % per_block (table [..., blocks], entries [..., n] >= 0).
    The host pool's rows and the entry map's elements are both laid out this way."""
    return table.gather(-1, entries // per_block) * per_block + entries % per_block


def resident_c4_rows(table: torch.Tensor, j: int, entries: torch.Tensor, geo: Geometry) -> torch.Tensor:
    """Arena rows (of `geo.md` elements) of C4 entries (>= 0, [..., n]) of CSA layer j of requests whose C4 entries are
    resident: `table` [..., blocks x c4_pages_per_block] lists each block's C4 pages. A block's entries lie layer after
    layer (e4 each) across its C4 pages, `c4_rows_per_page` rows a page."""
    rpp, kq, e4 = geo.c4_rows_per_page, geo.c4_pages_per_block, geo.e4
    flat = j * e4 + entries % e4  # the entry's row among its block's C4 rows
    return table.gather(-1, (entries // e4) * kq + flat // rpp) * rpp + flat % rpp


def mtp_ring_slots(cfg: ModelConfig, draft_tokens: int) -> int:
    """Slots of a request's MTP window ring when it drafts up to `draft_tokens` tokens a step: the window plus one
    slot per draft token, so no draft write lands on an entry a query of the next step can see (`model.mtp`)."""
    return cfg.sliding_window + max(0, draft_tokens)


def spec_lru_floor(cfg: ModelConfig, draft_tokens: int) -> int:
    """The fewest LRU hot-buffer slots a request needs per CSA layer when a step verifies `draft_tokens` + 1
    positions: each position selects its own `index_topk` entries and every one of them must be resident in the
    same launch, so the buffer serves their union, which can be (N + 1) x index_topk distinct entries."""
    return (max(0, draft_tokens) + 1) * cfg.index_topk


def default_lru(cfg: ModelConfig, draft_tokens: int) -> int:
    """LRU hot-buffer slots per request and CSA layer when none are given: twice `index_topk`, so consecutive steps
    whose selections overlap mostly hit, and never fewer than a step verifying `draft_tokens` + 1 positions needs."""
    return max(2 * cfg.index_topk, spec_lru_floor(cfg, draft_tokens))


HOST_PAGE_BYTES = 4096
"""A host memory page: the stride between state groups is a whole number of them where that is cheap (`group_pages_for`)."""


def group_pages_for(state_pages: int, page_bytes: int) -> int:
    """Pages of one state group, which needs `state_pages` pages of `page_bytes` arena bytes: rounded up so that
    every group starts at the same offset within a host page, when that adds at most a quarter of the group. On a CPU
    groups that start at two offsets by turns (9 or 11 pages of 10 KiB) made the built-in model's decode step at
    batch 16 about 1% slower than 12 pages did for a store that speculates, and 0.6% slower than a 10-page group
    (its hot buffer enlarged to fill it) for one that does not (two workers stepped by turns). Pages that are already
    whole host pages are never rounded."""
    unit = HOST_PAGE_BYTES // math.gcd(page_bytes, HOST_PAGE_BYTES)  # pages per whole number of host pages
    padded = -(-state_pages // unit) * unit
    return padded if 4 * padded <= 5 * state_pages else state_pages


def pages_for_request(group_pages: int, block_tokens: int, tokens: int) -> int:
    """Pages one request holds at `tokens` tokens: its state group plus one page per started block."""
    return group_pages + max(1, -(-tokens // block_tokens))


def default_block_tokens(cfg: ModelConfig) -> int:
    unit = math.lcm(cfg.csa_rate, cfg.hca_rate)
    return unit * max(1, math.ceil(256 / unit))


def block_tokens_for(cfg: ModelConfig, requested: int | None) -> int:
    """Tokens per classical block (= page): `requested`, or the default; always a multiple of both compress
    rates, so a block boundary is also a boundary of every C4 and HCA window (the prefix cache's pages too)."""
    n = requested or default_block_tokens(cfg)
    if n % cfg.csa_rate or n % cfg.hca_rate:
        raise ValueError(f"block_tokens {n} must be a multiple of {cfg.csa_rate} and {cfg.hca_rate}")
    return n


class Geometry:
    """Everything about the arena's shape, derived from the model config and the tier config."""

    def __init__(self, cfg: ModelConfig, tier: TierConfig, dtype: torch.dtype) -> None:
        self.cfg, self.tier, self.dtype = cfg, tier, dtype
        self.offload = tier.offload
        self.codec = codec = model_codec(cfg, dtype)
        self.packed = codec.packed
        self.arena_dtype = codec.storage_dtype
        self.elem = torch.empty((), dtype=self.arena_dtype).element_size()
        """Bytes per arena element."""
        # arena elements per compressor-state value: the state keeps the compute dtype, as raw bytes when packed
        self.state_elems_per_value = torch.empty((), dtype=dtype).element_size() if self.packed else 1
        d, di, w = cfg.head_dim, cfg.index_head_dim, cfg.sliding_window
        self.d, self.di, self.window = d, di, w
        self.md, self.iw = codec.main_width, codec.index_width
        """Stored row widths in arena elements: main rows (SWA, C4, HCA, hot) and indexer keys."""
        self.main_bytes, self.index_bytes = codec.main_bytes, codec.index_bytes
        self.csa_layers, self.hca_layers = cfg.csa_layers, cfg.hca_layers
        self.csa_index = {layer: j for j, layer in enumerate(self.csa_layers)}
        self.hca_index = {layer: j for j, layer in enumerate(self.hca_layers)}
        n_csa, n_hca = len(self.csa_layers), len(self.hca_layers)
        self.block_tokens = block_tokens_for(cfg, tier.block_tokens)
        self.e4 = self.block_tokens // cfg.csa_rate
        self.eh = self.block_tokens // cfg.hca_rate
        self.spec_tokens = tier.speculative_tokens
        """Draft tokens a step may verify per request (0: none): each verified position selects its own top-k."""
        floor = spec_lru_floor(cfg, self.spec_tokens)
        self.lru = tier.hot_buffer_slots if tier.hot_buffer_slots is not None else default_lru(cfg, self.spec_tokens)
        self.plain_lru = self.lru if tier.hot_buffer_slots is not None else min(self.lru, default_lru(cfg, 0))
        """The LRU slots a plain step's misses may take (`kernels.resolve_ref`'s `victim_slots`): a plain step selects
        `index_topk` entries per request, and a default buffer sized for speculative steps searches only what a store
        without speculation would hold, so its plain step costs what theirs does (hits in the other slots still
        count). A size the user gave is searched whole."""
        if self.offload and n_csa and self.lru < floor:
            if not self.spec_tokens:
                raise ValueError(f"hot_buffer_slots ({self.lru}) must be at least index_topk ({cfg.index_topk}): "
                                 "a step's selection has to fit in the hot buffer")
            raise ValueError(f"hot_buffer_slots ({self.lru}) must be at least {floor}: a step's selection has to fit in "
                             f"the hot buffer, and a step that verifies {self.spec_tokens + 1} positions selects "
                             f"index_topk ({cfg.index_topk}) entries for each of them")
        self.reserved = tier.reserved_slots if self.offload else 0
        if self.reserved < 0:
            raise ValueError("reserved_slots must be >= 0")
        self.hot_slots = self.lru + self.reserved
        # plain: every field aligned to every row width; packed: main-row fields aligned to the main row
        self.align = self.md if self.packed else math.lcm(d, 2 * d, di, 2 * di)
        md, iw, sv = self.md, self.iw, self.state_elems_per_value

        def placer(fields: dict[str, Field]):
            off = 0

            def add(name: str, shape: tuple[int, ...], rowed: bool) -> None:
                nonlocal off
                if rowed or not self.packed:
                    off = self._aligned(off)
                fields[name] = Field(off, shape, shape[-1], rowed or not self.packed)
                off += math.prod(shape)

            def end() -> int:
                return self._aligned(off)

            return add, end

        # page (= one classical block) layout
        self.block_fields: dict[str, Field] = {}
        add, end = placer(self.block_fields)
        for name, shape, rowed in (("index_keys", (n_csa, self.e4, iw), False), ("hca", (n_hca, self.eh, md), True),
                                   ("c4", (n_csa, self.e4, md) if not self.offload else None, True)):
            if shape is None or math.prod(shape) == 0:
                continue
            add(name, shape, rowed)
        self.page_elems = max(end(), self.align)
        self.resident = bool(tier.resident and self.offload and n_csa)
        """Requests may keep their C4 entries on the device in full while there is room (`TierConfig.resident`): in
        pages of their own from the same pool, `c4_pages_per_block` per classical block."""
        self.c4_rows_per_page = self.page_elems // md if self.resident else 0
        self.c4_pages_per_block = math.ceil(n_csa * self.e4 / self.c4_rows_per_page) if self.resident else 0
        if self.resident and (self.page_elems % md or not self.c4_rows_per_page):
            raise ValueError(f"a page of {self.page_elems} elements does not hold whole C4 rows of {md}")

        # state group layout
        self.state_fields: dict[str, Field] = {}
        add, end = placer(self.state_fields)
        add("swa", (cfg.num_layers, w, md), True)
        m = cfg.csa_rate
        for layer in self.csa_layers:
            for comp, width in (("main", d), ("index", di)):
                add(f"{layer}.{comp}.kv", (m, 2 * width * sv), False)
                add(f"{layer}.{comp}.score", (m, 2 * width * sv), False)
                add(f"{layer}.{comp}.prev_kv", (m, width * sv), False)
                add(f"{layer}.{comp}.prev_score", (m, width * sv), False)
        for layer in self.hca_layers:
            add(f"{layer}.main.kv", (cfg.hca_rate, d * sv), False)
            add(f"{layer}.main.score", (cfg.hca_rate, d * sv), False)
        if self.offload and n_csa:
            add("hot", (n_csa, self.hot_slots, md), True)
        self.mtp_slots = mtp_ring_slots(cfg, self.spec_tokens) if self.spec_tokens else 0
        """Rows of the MTP block's window ring in each state group (`model.mtp.ring_slots`; 0 without speculation)."""
        if self.mtp_slots:
            add("mtp", (self.mtp_slots, md), True)
        self.state_elems = end()
        self.group_pages = group_pages_for(max(1, math.ceil(self.state_elems / self.page_elems)), self.page_elems * self.elem)

        # bytes: pages carry the entry->slot map with the tier; groups carry hot-buffer bookkeeping
        self.map_bytes_per_page = n_csa * self.e4 * 4 if self.offload else 0
        self.meta_bytes_per_group = n_csa * (self.hot_slots * 8 + self.lru * 8) if self.offload else 0
        self.share_refs = tier.share_prefixes
        """Map blocks set aside per device page for the holders of shared pages after the first (`cachetier.sharing`);
        a page carries their bytes in the budget."""
        self.page_bytes = self.page_elems * self.elem + self.map_bytes_per_page * (1 + self.share_refs)
        self.host_block_bytes = n_csa * self.e4 * self.main_bytes if self.offload else 0

        budget = tier.device_budget_bytes
        per_page = self.page_bytes + self.meta_bytes_per_group / self.group_pages
        n = int(budget // per_page)
        n -= n % self.group_pages
        while n > 0 and self.device_bytes(n) > budget:
            n -= self.group_pages
        if n < 2 * self.group_pages:
            raise BudgetTooSmall(
                f"a device budget of {format_bytes(budget)} holds {n} pages; one request needs at least "
                f"{self.group_pages + 1} ({format_bytes(self.request_device_bytes(1))}); raise --device-budget"
            )
        self.num_pages = n
        self.num_groups = n // self.group_pages
        # Scratch, outside the budget: one state group and one page after the last real page, where the
        # padded rows of a fixed-shape decode step (and its masked-off writes) land. Nobody owns them.
        self.scratch_group = self.num_groups
        self.scratch_page = n + self.group_pages
        self.arena_pages = n + self.group_pages + 1
        # The entry map's blocks (tier on): one per arena page (a page's own holder addresses its entries by the page),
        # then the shared pages' later holders' map blocks, then a scratch block whose last element is the dump.
        self.share_maps = self.share_refs * n if self.map_bytes_per_page else 0
        self.map_blocks = self.arena_pages + self.share_maps + 1
        self.scratch_map = self.map_blocks - 1
        host_bytes = tier.host_pool_bytes if tier.host_pool_bytes is not None else 8 * budget
        self.num_host_blocks = int(host_bytes // self.host_block_bytes) if self.offload and self.host_block_bytes else 0

    def _aligned(self, n: int) -> int:
        return -(-n // self.align) * self.align

    def state_to_arena(self, t: torch.Tensor) -> torch.Tensor:
        """Compressor-state values [..., width] as arena elements [..., field width]."""
        if self.packed:
            return t.to(self.dtype).contiguous().view(torch.uint8)
        return t.to(self.arena_dtype)

    def state_from_arena(self, t: torch.Tensor) -> torch.Tensor:
        """Arena elements [..., field width] (a gathered, contiguous copy) back as state values."""
        return t.view(self.dtype) if self.packed else t

    def device_bytes(self, num_pages: int) -> int:
        return num_pages * self.page_bytes + (num_pages // self.group_pages) * self.meta_bytes_per_group

    def blocks_for(self, tokens: int) -> int:
        return pages_for_request(self.group_pages, self.block_tokens, tokens) - self.group_pages

    def request_device_bytes(self, num_blocks: int) -> int:
        """Device bytes one request holds: its state group and its blocks (with their bookkeeping)."""
        return (self.group_pages + num_blocks) * self.page_bytes + self.meta_bytes_per_group

    def request_host_bytes(self, num_blocks: int) -> int:
        return num_blocks * self.host_block_bytes

    def describe(self) -> dict:
        return {
            "offload": self.offload, "kv_format": self.codec.format, "main_row_bytes": self.main_bytes,
            "index_key_bytes": self.index_bytes, "block_tokens": self.block_tokens, "page_bytes": self.page_bytes,
            "group_pages": self.group_pages, "num_pages": self.num_pages, "num_groups": self.num_groups,
            "hot_buffer_slots": self.lru if self.offload else 0, "reserved_slots": self.reserved,
            "host_blocks": self.num_host_blocks, "host_block_bytes": self.host_block_bytes,
            "device_bytes": self.device_bytes(self.num_pages), "host_bytes": self.num_host_blocks * self.host_block_bytes,
            "scratch_bytes": (self.arena_pages - self.num_pages) * self.page_bytes, "share_map_blocks": self.share_maps,
        }
