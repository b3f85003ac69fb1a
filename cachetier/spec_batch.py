"""A speculative decode step's view of the tiered store: every request verifies `span` positions in one forward.

The view has one row per (request, position): row `r * span + j` is request r at position `b_r + j`, where b_r is
its next position and j = 0 is the token it decodes from, j >= 1 the draft tokens (`decode.speculative`). The
model's decode step runs over these rows unchanged (`model.attention.decode_layer`): each row is a query at its
own position. What makes `span` positions of one request in one forward right is how the view answers for state
that a later position overwrites and that a rejected position must not leave behind:

- **never committed during the forward**: the window ring, the compressor tails and overlaps, and (tier on) the
  C4 appends into the host pool and the hot buffer's ring. Each row reads them as spec-off would at its position:
  the stored values for positions before b_r and this step's values (held here, `_pend`) from b_r on, in the
  same slots in the same order, so the attention sees the same rows. `commit(accepted)` then writes only the
  positions up to b_r + accepted, once the step knows how many it kept.
- **written at once**: HCA entries, indexer keys and (tier off) C4 entries go straight to their page slots. A row
  of a rejected position writes an entry past its request's committed count: no query sees an entry before its
  window completes, and the position that completes it writes it again before anyone reads it.

Rows of positions a request does not verify this step (fewer drafts than `span - 1`: the end of its `max_tokens`,
a fresh request with none yet) and padding rows are padding: position 0, the scratch group, so whatever they
write lands in scratch. Tier on, the C4 selections of a request's rows are resolved together: one resolve row
per request over the union of its positions' ids (`kernels.resolve` takes duplicates), so the hot buffer must
hold that union (`cachetier.geometry.spec_lru_floor`); entries this step emitted come from the step itself.

Fixed shapes, no host sync: the view compiles and captures like `TieredBatch`, one graph per (rows, blocks, span).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from cachetier.batch import Segment, entry_counts
from cachetier.geometry import block_rows
from cachetier.layout import C4
from cachetier.resident import Resident, group_of, num_tokens_of, tables_key
from cachetier.tiered_batch import MIXED, RESIDENT, TIERED, TieredBatch

NOT_VERIFIED = -1
"""The offset of a row whose position is not verified this step (padding)."""


class SpecBatch(TieredBatch):
    """`requests` x `span` rows over the tiered store, for a step that verifies `span` positions per request."""

    META_ROWS = 5
    """positions, state groups, input tokens, each row's offset j (NOT_VERIFIED: padding), its MTP ring's floor."""

    def __init__(self, cfg, geo, arena, hot, device, requests: int, num_blocks: int, span: int,
                 c4_mode: str = TIERED) -> None:
        if span < 2:
            raise ValueError(f"a speculative view verifies at least 2 positions per request, got {span}")
        super().__init__(cfg, geo, arena, hot, device, requests * span, num_blocks, c4_mode)
        self.span = span
        self.spec_bucket = (requests, num_blocks, span)
        self.offsets, self.mtp_floor = self._meta.unbind(0)[3:5]
        self._j = torch.arange(requests * span, device=self._meta.device) % span
        self._r = torch.arange(requests * span, device=self._meta.device) // span
        self._j_np = (np.arange(requests * span) % span).reshape(requests, span)
        self._pend: dict = {}
        self.targets = torch.zeros(requests, span, dtype=torch.long, device=self._meta.device)
        """[requests, span] the tokens the verified positions drew: what the step's second half reads (a buffer, so a
        captured second half replays with each step's draws)."""
        self.loaded: tuple = (None, None)
        """The tokens and drafts `load` was last given (a capture refills the view with padding; the runner reloads)."""

    @property
    def requests(self) -> int:
        """Requests of the view, read from a buffer's size: a compiled step stays symbolic in it (an int attribute
        would be specialised, one graph per batch bucket)."""
        return self.positions.shape[0] // self.span

    def bucket_tensors(self):
        return [*super().bucket_tensors(), (self.offsets, (0,)), (self.mtp_floor, (0,)), (self._j, (0,)), (self._r, (0,)),
                (self.targets, (0,))]

    # host side ------------------------------------------------------------------------------------

    def load(self, residents: list[Resident], tokens: list[list[int]] | None = None,
             drafts: list[int] | None = None) -> None:
        """Fill the buffers for these requests: each row's input tokens (`tokens[r]`: the token it decodes from, then
        its drafts) and how many drafts it verifies (`drafts[r]` < span; the rest of its rows are padding)."""
        R, S = self.requests, self.span
        n = len(residents)
        self.loaded = (tokens, drafts)
        if n > R:
            raise ValueError(f"{n} requests do not fit a speculative view of {R} requests")
        g = self.g
        meta = self._meta_np.reshape(self.META_ROWS, R, S)
        d = [0] * n if drafts is None else list(drafts)
        if any(not 0 <= x < S for x in d):
            raise ValueError(f"drafts per request must be in [0, {S - 1}], got {d}")
        j = self._j_np[:n]
        verified = j <= np.array(d, dtype=np.int64).reshape(-1, 1)
        base = np.array(list(map(num_tokens_of, residents)), dtype=np.int64).reshape(-1, 1)
        meta[0, :n] = (base + j) * verified
        meta[1, :n] = np.array(list(map(group_of, residents)), dtype=np.int64).reshape(-1, 1)
        meta[1, :n][~verified] = g.scratch_group
        if tokens is not None:
            for r, toks in enumerate(tokens):
                meta[2, r, : len(toks)] = toks[:S]
                meta[2, r, len(toks):] = 0
        else:
            meta[2, :n] = 0
        meta[3, :n] = j * verified + NOT_VERIFIED * ~verified
        meta[4, :n] = np.array([r.mtp_floor for r in residents], dtype=np.int64).reshape(-1, 1)
        meta[0, n:], meta[1, n:], meta[2, n:], meta[3, n:], meta[4, n:] = 0, g.scratch_group, 0, NOT_VERIFIED, 0
        key = tables_key(residents)
        self.residents = list(residents)
        if key != self._tables_for:
            self._fill_tables(residents, S)
            self._tables_for = key
        if self._meta is not self._meta_host:
            self._meta.copy_(self._meta_host, non_blocking=True)

    def advance(self, accepted: list[int] | None = None) -> None:
        """On the host, after the step: each request consumed its token and `accepted[r]` drafts."""
        for i, r in enumerate(self.residents):
            r.num_tokens += 1 + (accepted[i] if accepted is not None else 0)

    # per-request views of the rows ----------------------------------------------------------------

    @property
    def verified(self) -> torch.Tensor:
        """[rows] bool: the row's position is verified this step (not padding)."""
        return self.offsets >= 0

    def _first(self, t: torch.Tensor) -> torch.Tensor:
        """Each request's value of a per-row tensor, read at its row j = 0 ([requests, ...])."""
        return t.view(self.requests, self.span, *t.shape[1:])[:, 0]

    def begin_step(self) -> None:
        super().begin_step()
        self.base = self._first(self.positions).repeat_interleave(self.span)  # [rows] b_r of each row's request
        self._pend = {}

    def _from_step(self, pending: torch.Tensor, stored: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """Per row, the values of positions first[row] + i (i < stored.shape[1]): this step's own `pending`
        [rows, width] (one per row of the request) from b_r on, `stored` [rows, n, width] (slot i) before."""
        n = stored.shape[1]
        pos = first[:, None] + torch.arange(n, device=first.device)  # [rows, n]
        idx = pos - self.base[:, None]
        own = pending.view(self.requests, self.span, -1)[self._r[:, None], idx.clamp(0, self.span - 1)]
        return torch.where((idx >= 0)[..., None], own.to(stored.dtype), stored)

    # state: read as spec-off would, committed later -------------------------------------------------

    def write_window(self, layer, key) -> Segment:
        g = self.g
        w = g.window
        f = g.state_fields["swa"]
        ring = f.row(self.gbase, layer * w)[:, None] + torch.arange(w, device=key.device)  # [rows, window]
        stored = self.arena.view(-1, g.md)[ring]  # [rows, window, row]
        p = self.positions[:, None]
        held = p - torch.remainder(p - torch.arange(w, device=key.device), w)  # the position slot s holds at p
        idx = held - self.base[:, None]
        own = key.view(self.requests, self.span, -1)[self._r[:, None], idx.clamp(0, self.span - 1)]
        seen = torch.where((idx >= 0)[..., None], own.to(self.arena.dtype), stored)  # [rows, window, row]
        self._pend[("swa", layer)] = key
        rows = torch.arange(seen.shape[0], device=key.device)[:, None] * w + torch.arange(w, device=key.device)
        return Segment(seen.flatten(0, 1), torch.where(self.live, rows, -1))

    def write_tail(self, layer, name, kv, score) -> None:
        g = self.g
        self._pend[("tail", layer, name)] = (g.state_from_arena(g.state_to_arena(kv)), g.state_from_arena(g.state_to_arena(score)))

    def _window_start(self, rate: int, back: int = 0) -> torch.Tensor:
        p = self.positions
        return p - p % rate - back * rate

    def tail_windows(self, layer, name):
        stored = super().tail_windows(layer, name)  # [rows, rate, width] each: the request's tail before this step
        self._pend[("stored_tail", layer, name)] = stored
        kv, score = self._pend[("tail", layer, name)]
        first = self._window_start(stored[0].shape[1])
        return tuple(self._from_step(p, s, first) for p, s in zip((kv, score), stored))

    def overlap(self, layer, name):
        stored = super().overlap(layer, name)  # [rows, rate, width/2]: the last window complete before this step
        tail_kv, tail_score = self._pend[("stored_tail", layer, name)]
        kv, score = self._pend[("tail", layer, name)]
        rate, d = tail_kv.shape[1], stored[0].shape[-1]
        prev = self._window_start(rate, back=1)
        later = prev >= self.base - self.base % rate  # the previous window is (partly) this step's
        out = []
        for p, s, old in zip((kv, score), (tail_kv, tail_score), stored):
            full = self._from_step(p, s, prev)[..., :d]
            out.append(torch.where(later[:, None, None], full, old))
        return tuple(out)

    def set_overlap(self, layer, name, emit, kv, score) -> None:
        self._pend[("overlap", layer, name)] = (emit, kv, score)

    # entries -----------------------------------------------------------------------------------------

    def append_entries(self, layer, kind, emit, entries) -> None:
        if kind == C4 and self.g.offload:  # the host pool and the hot ring take only committed entries
            self._pend[("c4", layer)] = (emit, entries)
            return
        super().append_entries(layer, kind, emit & self.verified, entries)

    def c4_segment(self, layer, ids) -> Segment:
        g = self.g
        if not g.offload:
            return super().c4_segment(layer, ids)
        R, S, k = self.requests, self.span, ids.shape[1]
        rate = self.cfg.csa_rate
        j = g.csa_index[layer]
        valid = (ids >= 0) & self.verified[:, None]
        old = valid & (ids < (self.base // rate)[:, None])  # complete before this step: stored (host pool, resident pages)
        new = valid & ~old  # emitted by a position of this step
        pool = self.arena.view(-1, g.md)
        if self.c4_mode != TIERED:  # what resident rows read: their C4 pages
            direct = pool[self._resident_rows(j, torch.where(old, ids, 0))]  # [rows, k, row]
        if self.c4_mode == RESIDENT:
            held, found = direct, old
        else:
            res = self.resident_rows[:, None] if self.c4_mode == MIXED else None
            asked = old if res is None else old & ~res  # a resident request's rows resolve nothing
            union = torch.where(asked, ids, -1).view(R, S * k)  # one resolve row per request: its positions' union
            safe = union.clamp(min=0)
            maps, host_blocks, groups = self._first(self.map_blocks), self._first(self.host_blocks), self._first(self.groups)
            hot_rows = g.state_fields["hot"].row(self._first(self.gbase), j * g.hot_slots)  # [requests]
            slots = self._resolve(union, block_rows(maps, safe, g.e4), self.hot.host.rows(host_blocks, safe), groups,
                                  hot_rows, j).view(R * S, k)
            held = pool[(hot_rows.repeat_interleave(S)[:, None] + slots).clamp(min=0)]  # [rows, k, row]
            found = old & (slots >= 0)
            if res is not None:
                held = torch.where(res[..., None], direct, held)
                found = torch.where(res, old, found)
        _, entries = self._pend[("c4", layer)]
        by = ((ids + 1) * rate - 1 - self.base[:, None]).clamp(0, S - 1)  # the row of this step that emitted it
        own = entries.view(R, S, -1)[self._r[:, None], by].to(pool.dtype)
        seen = torch.where(new[..., None], own, held)
        ok = new | found
        rows = torch.arange(R * S, device=ids.device)[:, None] * k + torch.arange(k, device=ids.device)
        return Segment(seen.flatten(0, 1), torch.where(ok, rows, -1))

    def _resolve(self, union, map_rows, host_rows, groups, hot_rows, j):
        from kernels.resolve import resolve

        return resolve(union, map_rows, host_rows, groups, hot_rows, self.arena, self.hot.layer(j))

    # the commit --------------------------------------------------------------------------------------

    def commit(self, accepted: torch.Tensor) -> None:
        """Write the state of every verified position up to b_r + accepted[r] (accepted [requests] on the device);
        nothing of a later position is written. Device work, fixed shapes: part of the step."""
        g = self.g
        a = accepted.repeat_interleave(self.span)  # [rows]
        j = self._j
        keep = self.verified & (j <= a)
        scratch = self._scratch_gbase

        def last(rate: int) -> torch.Tensor:  # kept, and no later kept position of the request has its slot
            return keep & (j + rate > a)

        for key, val in self._pend.items():
            kind = key[0]
            if kind == "swa":
                layer = key[1]
                gb = torch.where(last(g.window), self.gbase, scratch)
                self._put(g.md, g.state_fields["swa"].row(gb, layer * g.window) + self.positions % g.window, val)
            elif kind == "tail":
                _, layer, name = key
                for part, t in zip(("kv", "score"), val):
                    f = g.state_fields[f"{layer}.{name}.{part}"]
                    gb = torch.where(last(f.shape[0]), self.gbase, scratch)
                    self._put_at(f.start(gb, self.positions % f.shape[0]), g.state_to_arena(t))
            elif kind == "overlap":
                _, layer, name = key
                emit, kv, score = val
                rate = kv.shape[1]
                TieredBatch.set_overlap(self, layer, name, emit & last(rate), kv, score)
            elif kind == "c4":
                layer = key[1]
                emit, entries = val
                rate = self.cfg.csa_rate
                mine = emit & keep
                e = (entry_counts(self.positions, rate) - 1).clamp(min=0)
                rank = mine.view(self.requests, self.span).long().cumsum(1).flatten() - 1
                for m in range(math.ceil(self.span / rate)):  # one append per request at a time, in order
                    self._append_c4_tiered(g.csa_index[layer], mine & (rank == m), e, entries)
        self._pend = {}

    # the MTP block's ring --------------------------------------------------------------------------------

    def mtp_rows(self) -> torch.Tensor:
        """[requests, slots] arena rows of each request's MTP ring (`Geometry.mtp_slots`; the scratch group's for
        padding requests)."""
        g = self.g
        if not g.mtp_slots:
            raise ValueError("this store holds no MTP rings: make it with TierConfig.speculative_tokens > 0")
        f = g.state_fields["mtp"]
        return f.row(self._first(self.gbase), 0)[:, None] + torch.arange(g.mtp_slots, device=self.gbase.device)

    def take_mtp(self) -> torch.Tensor:
        """Each request's MTP ring [requests, slots, row] (a copy)."""
        return self.arena.view(-1, self.g.md)[self.mtp_rows()]

    def put_mtp(self, ring: torch.Tensor) -> None:
        self._put(self.g.md, self.mtp_rows(), ring)
