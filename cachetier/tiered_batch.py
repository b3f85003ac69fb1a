"""One decode step's view of the tiered store: per-step metadata in persistent buffers, static-shape storage ops.

A view is made for a bucket (`num_rows` rows, a block table `num_blocks` wide; `cachetier.buckets`)
and keeps its buffers for good, so a step compiled or captured on it replays with whatever the
host loaded this time. Before each step `load` writes, on the host:
- per step, one small buffer: every row's position, state group and input token (one transfer);
- per batch composition, the block tables: device pages and host blocks (one transfer when the
  set of requests or the bucket changes).
Rows past the real requests are padding: position 0, the scratch state group, scratch pages, so
everything they (and masked-off lanes of real rows) write lands in scratch that nobody reads.

Everything the step itself does is device work with fixed shapes: no host sync, no branch on data.
Writes into the arena and the bookkeeping tensors go through one `index_put_` on the tensor itself,
so a compiled step updates them in place. The view reads the store through what it exposes (arena,
geometry, host pool and its row function, hot-buffer bookkeeping, device counters).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cachetier.batch import DecodeKV, Segment, entry_counts
from cachetier.buckets import gather_len
from cachetier.geometry import Geometry, block_rows, resident_c4_rows
from cachetier.layout import HCA_ENTRIES, INDEX_KEYS
from cachetier.resident import Resident, group_of, num_tokens_of, tables_key
from core.config import ModelConfig
from kernels.index_topk_ref import PagedKeys
from kernels.resolve import resolve

if TYPE_CHECKING:
    from cachetier.hot_tier import HotTier


TIERED, RESIDENT, MIXED = "tiered", "resident", "mixed"
C4_MODES = (TIERED, RESIDENT, MIXED)


class TieredBatch(DecodeKV):
    """A bucket-shaped view of the tiered store for one decode step."""

    META_ROWS = 3
    """Rows of the per-step buffer: positions, state groups, input tokens (a speculative view adds its own)."""

    def __init__(self, cfg: ModelConfig, geo: Geometry, arena: torch.Tensor, hot: HotTier | None, device: torch.device,
                 num_rows: int, num_blocks: int, c4_mode: str = TIERED) -> None:
        self.cfg, self.arena, self.hot = cfg, arena, hot
        if c4_mode not in C4_MODES or (c4_mode != TIERED and not geo.resident):
            raise ValueError(f"c4_mode {c4_mode!r}: one of {C4_MODES}, and only {TIERED!r} without resident C4 entries")
        self.c4_mode = c4_mode
        """How the step reads C4 entries (tier on): `tiered` through hot buffers only; `resident` straight from every
        row's resident C4 pages; `mixed` either, per row (`cachetier.residency`). Fixed per view: a compiled or
        captured step holds only the reads of its mode."""
        self.g = g = geo
        self.window = g.window
        self.bucket = (num_rows, num_blocks)
        dev = device
        staged = dev.type == "cuda"  # a separate pinned host copy only where host and device differ
        m = self.META_ROWS
        self._meta_host = torch.zeros(m, num_rows, dtype=torch.long, pin_memory=staged)  # positions, groups, tokens[, ...]
        # device pages, host blocks, entry-map blocks (`cachetier.sharing`: a shared page's holders map it apart)
        self._tables_host = torch.zeros(3, num_rows, num_blocks, dtype=torch.long, pin_memory=staged)
        self._meta = torch.zeros(m, num_rows, dtype=torch.long, device=dev) if staged else self._meta_host
        self._meta_np = self._meta_host.numpy()
        self._tables = torch.zeros(3, num_rows, num_blocks, dtype=torch.long, device=dev) if staged else self._tables_host
        self.positions, self.groups, self.token_ids = self._meta.unbind(0)[:3]  # [rows] each
        self.blocks, self.host_blocks, self.map_blocks = self._tables.unbind(0)  # [rows, num_blocks] each
        self._c4_host = self.c4_blocks = None
        if c4_mode != TIERED:  # each block's resident C4 pages, scratch for rows that are not resident
            self._c4_host = torch.zeros(num_rows, num_blocks * g.c4_pages_per_block, dtype=torch.long, pin_memory=staged)
            self.c4_blocks = torch.zeros_like(self._c4_host, device=dev) if staged else self._c4_host
        self.residents: list[Resident] = []
        self._tables_for: tuple | None = None
        self._group_elems = g.group_pages * g.page_elems
        self._scratch_gbase = g.scratch_group * self._group_elems

    def bucket_tensors(self) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
        """The buffers whose sizes are the bucket, with those dims: every other tensor of a step is sized from them."""
        out = [(self._meta, (1,)), (self._tables, (1, 2)), (self.positions, (0,)), (self.groups, (0,)),
               (self.token_ids, (0,)), (self.blocks, (0, 1)), (self.host_blocks, (0, 1)),
               (self.map_blocks, (0, 1))]  # views are inputs too
        return out if self.c4_blocks is None else [*out, (self.c4_blocks, (0, 1))]

    # host side ------------------------------------------------------------------------------------

    def load(self, residents: list[Resident], tokens: list[int] | None = None) -> None:
        """Fill the buffers for these requests (and their input tokens); the rest of the rows are padding."""
        rows = self.bucket[0]
        n = len(residents)
        if n > rows:
            raise ValueError(f"{n} requests do not fit a view of {rows} rows")
        g = self.g
        meta = self._meta_np  # written through NumPy: no tensor built from Python lists every step
        meta[0, :n] = list(map(num_tokens_of, residents))
        meta[1, :n] = list(map(group_of, residents))
        meta[2, :n] = list(tokens) if tokens is not None else 0
        meta[0, n:], meta[1, n:], meta[2, n:] = 0, g.scratch_group, 0
        # The same resident objects (the previous ones are still referenced here, so no id is reused)
        key = tables_key(residents)
        self.residents = list(residents)
        if key != self._tables_for:
            self._fill_tables(residents, 1)
            self._tables_for = key
        if self._meta is not self._meta_host:
            self._meta.copy_(self._meta_host, non_blocking=True)

    def _fill_tables(self, residents: list[Resident], span: int) -> None:
        """Each row's tables from its resident's int64 arrays (`span` consecutive rows a request), scratch past them
        and on the padding rows: a slice copy per request (64 rows x 4,096 blocks in well under a millisecond), no
        Python lists."""
        g = self.g
        tables = self._tables_host.numpy()  # [3, rows, width]: device pages, host blocks, map blocks
        width = tables.shape[-1]
        tables = tables.reshape(3, -1, span, width)
        tables[0], tables[1], tables[2] = g.scratch_page, g.num_host_blocks, g.scratch_map  # the host pool's last block is scratch
        for i, r in enumerate(residents):
            nb = min(len(r.blocks_np), width)
            tables[0, i, :, :nb] = r.blocks_np[:nb]
            tables[2, i, :, :nb] = r.map_np[:nb]
            nh = min(len(r.host_blocks_np), width)
            tables[1, i, :, :nh] = r.host_blocks_np[:nh]
        if self._tables is not self._tables_host:
            self._tables.copy_(self._tables_host, non_blocking=True)
        if self._c4_host is not None:
            c4 = self._c4_host.numpy()
            c4 = c4.reshape(-1, span, c4.shape[-1])
            c4[:] = g.scratch_page
            for i, r in enumerate(residents):
                if r.c4_pages:
                    n = min(len(r.c4_np), c4.shape[-1])
                    c4[i, :, :n] = r.c4_np[:n]
            if self.c4_blocks is not self._c4_host:
                self.c4_blocks.copy_(self._c4_host, non_blocking=True)

    def advance(self) -> None:
        for r in self.residents:
            r.num_tokens += 1

    # arena access ----------------------------------------------------------------------------------

    def _put(self, width: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Arena rows of `width` elements <- values [..., width]; one scatter into the arena itself."""
        arena = self.arena
        idx = rows[..., None] * width + torch.arange(width, device=rows.device)
        arena.index_put_((idx,), values.to(arena.dtype))

    def _take(self, width: int, rows: torch.Tensor) -> torch.Tensor:
        return self.arena.view(-1, width)[rows]

    def _put_at(self, starts: torch.Tensor, values: torch.Tensor) -> None:
        """Arena elements starts[...] .. + width <- values [..., width] (arena-typed); one scatter."""
        arena = self.arena
        idx = starts[..., None] + torch.arange(values.shape[-1], device=starts.device)
        arena.index_put_((idx,), values.to(arena.dtype))

    def _take_at(self, width: int, starts: torch.Tensor) -> torch.Tensor:
        return self.arena[starts[..., None] + torch.arange(width, device=starts.device)]

    def begin_step(self) -> None:
        super().begin_step()
        self.gbase = self.groups * self._group_elems  # [rows] element offset of each row's state group
        if self.c4_mode == MIXED:  # [rows] bool: the row's request keeps its C4 entries resident
            self.resident_rows = self.c4_blocks[:, 0] != self.g.scratch_page

    def gather_len(self, rate: int) -> int:
        return gather_len(self.blocks.shape[1], self.g.block_tokens, rate)

    # state ---------------------------------------------------------------------------------------

    def write_window(self, layer, key) -> Segment:
        g = self.g
        f = g.state_fields["swa"]
        base = f.row(self.gbase, layer * g.window)  # [rows]
        self._put(g.md, base + self.positions % g.window, key)
        ring = base[:, None] + torch.arange(g.window, device=key.device)  # [rows, window]
        return Segment(self.arena.view(-1, g.md), torch.where(self.live, ring, -1))

    def _state_starts(self, layer, name, part, gbase) -> torch.Tensor:
        f = self.g.state_fields[f"{layer}.{name}.{part}"]
        return f.start(gbase[:, None], torch.arange(f.shape[0], device=gbase.device))  # [rows, field rows]

    def _take_state(self, layer, name, part) -> torch.Tensor:
        f = self.g.state_fields[f"{layer}.{name}.{part}"]
        return self.g.state_from_arena(self._take_at(f.width, self._state_starts(layer, name, part, self.gbase)))

    def write_tail(self, layer, name, kv, score) -> None:
        for part, t in (("kv", kv), ("score", score)):
            f = self.g.state_fields[f"{layer}.{name}.{part}"]
            self._put_at(f.start(self.gbase, self.positions % f.shape[0]), self.g.state_to_arena(t))

    def tail_windows(self, layer, name):
        return tuple(self._take_state(layer, name, p) for p in ("kv", "score"))

    def overlap(self, layer, name):
        return tuple(self._take_state(layer, name, p) for p in ("prev_kv", "prev_score"))

    def set_overlap(self, layer, name, emit, kv, score) -> None:
        gbase = torch.where(emit, self.gbase, self._scratch_gbase)
        for part, t in (("prev_kv", kv), ("prev_score", score)):
            self._put_at(self._state_starts(layer, name, part, gbase), self.g.state_to_arena(t))

    # classical entries ---------------------------------------------------------------------------

    def _pages(self, e: torch.Tensor, per: int) -> torch.Tensor:
        """Device page of entries e ([rows] or [rows, n]) with `per` entries of their kind per block."""
        idx = e // per
        return self.blocks.gather(1, idx[:, None]).squeeze(1) if e.dim() == 1 else self.blocks.gather(1, idx)

    def _entry_rows(self, kind: str, j: int, e: torch.Tensor, emit: torch.Tensor | None = None) -> torch.Tensor:
        """Arena rows of entries e (>= 0) of each batch row, for a block field; rows not in `emit` go to scratch.
        Indexer keys are addressed by element offset instead (their field need not be row-aligned)."""
        g = self.g
        f = g.block_fields[kind]
        per = g.eh if kind == "hca" else g.e4
        page = self._pages(e, per)
        if emit is not None:
            page = torch.where(emit, page, g.scratch_page)
        if kind == "index_keys":
            return f.start(page * g.page_elems, j * per + e % per)
        return f.row(page * g.page_elems, j * per + e % per)

    def _map_rows(self, e: torch.Tensor) -> torch.Tensor:
        """Elements of a CSA layer's entry map for C4 entries e ([rows] or [rows, n], >= 0) of each batch row."""
        if e.dim() == 1:
            return block_rows(self.map_blocks, e[:, None], self.g.e4).squeeze(1)
        return block_rows(self.map_blocks, e, self.g.e4)

    def append_entries(self, layer, kind, emit, entries) -> None:
        g, cfg = self.g, self.cfg
        rate = cfg.hca_rate if kind == HCA_ENTRIES else cfg.csa_rate
        e = (entry_counts(self.positions, rate) - 1).clamp(min=0)  # [rows]
        if kind == INDEX_KEYS:
            self._put_at(self._entry_rows("index_keys", g.csa_index[layer], e, emit), entries)
        elif kind == HCA_ENTRIES:
            self._put(g.md, self._entry_rows("hca", g.hca_index[layer], e, emit), entries)
        elif not g.offload:
            self._put(g.md, self._entry_rows("c4", g.csa_index[layer], e, emit), entries)
        else:
            self._append_c4_tiered(g.csa_index[layer], emit, e, entries)

    def _append_c4_tiered(self, j: int, emit: torch.Tensor, e: torch.Tensor, entries: torch.Tensor) -> None:
        """New C4 entry: authoritative copy to the host pool, and into the ring of the hot buffer (`HotTier.append`);
        a row whose entries are resident writes it into its C4 pages only (written back to the host pool when the
        request shrinks: `TieredStore.drop_resident`)."""
        g = self.g
        if self.c4_mode != TIERED:
            res = emit if self.c4_mode == RESIDENT else emit & self.resident_rows
            rows = self._resident_rows(j, e[:, None]).squeeze(1)
            self._put(g.md, torch.where(res, rows, g.scratch_page * g.c4_rows_per_page), entries)
            if self.c4_mode == RESIDENT:
                return  # no host write: a resident request's new entries reach the host pool when it shrinks
            emit = emit & ~self.resident_rows
        host_rows = self.hot.host.rows(self.host_blocks, e[:, None]).squeeze(1)
        self.hot.append(j, emit, e, host_rows, self.groups, self.gbase, entries, self._map_rows,
                        lambda rows, values: self._put(self.g.md, rows, values))

    def _resident_rows(self, j: int, e: torch.Tensor) -> torch.Tensor:
        """Arena rows of C4 entries e ([rows, n], >= 0) of CSA layer j in each row's resident C4 pages (scratch rows
        for a row that is not resident)."""
        return resident_c4_rows(self.c4_blocks, j, e, self.g)

    def _all_rows(self, kind: str, j: int, rate: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Arena rows of every entry slot up to the gather length [rows, len], -1 past each row's count; the counts."""
        counts = entry_counts(self.positions, rate)  # [rows]
        e = torch.arange(self.gather_len(rate), device=counts.device).expand(counts.shape[0], -1)  # [rows, len]
        rows = self._entry_rows(kind, j, e)
        return torch.where(e < counts[:, None], rows, -1), counts

    def hca_segment(self, layer) -> Segment:
        rows, _ = self._all_rows("hca", self.g.hca_index[layer], self.cfg.hca_rate)
        return Segment(self.arena.view(-1, self.g.md), rows)

    def index_source(self, layer) -> PagedKeys:
        """The layer's keys in the arena: a page holds each CSA layer's keys of its block consecutively, so a row's
        block table gives every block's first key (blocks past the row's end are scratch pages, never chosen)."""
        g = self.g
        f = g.block_fields["index_keys"]
        starts = f.start(self.blocks * g.page_elems, g.csa_index[layer] * g.e4)  # [rows, blocks] element offsets
        return PagedKeys(self.arena, starts, entry_counts(self.positions, self.cfg.csa_rate), g.e4, g.codec)

    def c4_segment(self, layer, ids) -> Segment:
        g = self.g
        j = g.csa_index[layer]
        valid = ids >= 0
        safe = torch.where(valid, ids, 0)  # [rows, k]
        pool = self.arena.view(-1, g.md)
        if not g.offload:
            return Segment(pool, torch.where(valid, self._entry_rows("c4", j, safe), -1))
        if self.c4_mode == RESIDENT:
            return Segment(pool, torch.where(valid, self._resident_rows(j, safe), -1))
        hot_rows = g.state_fields["hot"].row(self.gbase, j * g.hot_slots)  # [rows], slot 0 of each hot buffer
        mixed = self.c4_mode == MIXED
        asked = torch.where(self.resident_rows[:, None], -1, ids) if mixed else ids  # resident rows resolve nothing
        slots = resolve(asked, self._map_rows(safe), self.hot.host.rows(self.host_blocks, safe), self.groups, hot_rows,
                        self.arena, self.hot.layer(j), g.plain_lru)
        rows = torch.where(slots >= 0, hot_rows[:, None] + slots, -1)
        if mixed:
            rows = torch.where(self.resident_rows[:, None] & valid, self._resident_rows(j, safe), rows)
        return Segment(pool, rows)

    def end_step(self) -> None:
        if self.hot is not None:
            self.hot.tick()
