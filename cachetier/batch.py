"""The storage interface the model's batched decode step works through, and its plain implementation.

The decode step of the model never touches storage directly: it asks a `DecodeKV` for the window
ring, the compressor tails and the entries of each layer, and for the C4 entries its indexer
selected. `LayoutBatch` answers from plain `KVLayout`s (everything resident); the decode worker's
tiered store answers from its device pools, host pool and hot buffers. Both hand the attention the
same `Segment`s — the same rows in the same order — so the two give bit-identical results.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from cachetier.layout import C4, HCA_ENTRIES, INDEX_KEYS, KVLayout
from core.config import ModelConfig

MAIN = "main"
INDEX = "index"


@dataclass
class Segment:
    """Rows of a flat pool that a batch of queries attends to: `pool[rows[b, j]]`, -1 = no row."""

    pool: torch.Tensor  # [num_rows, dim]
    rows: torch.Tensor  # [batch, len] int64


def window_rows(positions: torch.Tensor, window: int) -> torch.Tensor:
    """Ring slots holding a real token after position `p` was written: [batch, window] bool.

    Slot j holds position p - ((p - j) mod window); it is live once that position is >= 0.
    """
    j = torch.arange(window, device=positions.device)
    held = positions[:, None] - torch.remainder(positions[:, None] - j, window)
    return held >= 0


class DecodeKV(ABC):
    """Per-layer storage operations of one batched decode step (one new token per request)."""

    positions: torch.Tensor
    """[batch] absolute position of the token decoded this step."""

    def live_window(self, window: int) -> torch.Tensor:
        """`window_rows` of this step's positions; every layer asks, so it is computed once per step
        (the cache is keyed on the positions tensor, which `finish_step` replaces)."""
        cached = getattr(self, "_live_window", None)
        if cached is None or cached[0] is not self.positions:
            self._live_window = (self.positions, window_rows(self.positions, window))
        return self._live_window[1]

    @abstractmethod
    def write_window(self, layer: int, key: torch.Tensor) -> Segment:
        """Store `key` [batch, dim] at ring slot `p % window`; return the ring as a segment."""

    @abstractmethod
    def write_tail(self, layer: int, name: str, kv: torch.Tensor, score: torch.Tensor) -> None:
        """Store this token's compressor projections at tail row `p % rate`."""

    @abstractmethod
    def tail_windows(self, layer: int, name: str, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The full tail [len(rows), rate, width] (kv, score) of the batch rows whose window just completed."""

    @abstractmethod
    def overlap(self, layer: int, name: str, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """CSA: first halves of the previous complete window of these rows (score -inf if none)."""

    @abstractmethod
    def set_overlap(self, layer: int, name: str, rows: torch.Tensor, kv: torch.Tensor, score: torch.Tensor) -> None:
        ...

    @abstractmethod
    def append_entries(self, layer: int, kind: str, rows: torch.Tensor, entries: torch.Tensor) -> None:
        """Append one new entry per listed batch row; `kind` is `c4`, `hca` or `index_keys`."""

    @abstractmethod
    def hca_segment(self, layer: int) -> Segment:
        """All HCA entries of each request (every complete one is visible at decode)."""

    @abstractmethod
    def index_keys(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Indexer keys padded to [batch, max_entries, index_dim], and the count per request."""

    @abstractmethod
    def c4_segment(self, layer: int, ids: torch.Tensor) -> Segment:
        """The C4 entries `ids` [batch, k] (-1 = none) selected by the indexer, as a segment."""

    @abstractmethod
    def finish_step(self) -> None:
        """Every request has consumed its token: advance the lengths."""


class LayoutBatch(DecodeKV):
    """`DecodeKV` over plain layouts, everything resident; advances the layouts in place."""

    def __init__(self, cfg: ModelConfig, layouts: list[KVLayout]) -> None:
        self.cfg = cfg
        self.layouts = layouts
        device = layouts[0].layers[0].window.device
        self.positions = torch.tensor([lay.num_tokens for lay in layouts], dtype=torch.long, device=device)
        self._pos = [lay.num_tokens for lay in layouts]

    def _comp(self, layer: int, b: int, name: str):
        lk = self.layouts[b].layers[layer]
        return lk.compressor if name == MAIN else lk.index_compressor

    def write_window(self, layer: int, key: torch.Tensor) -> Segment:
        w = self.cfg.sliding_window
        rings = []
        for b, lay in enumerate(self.layouts):
            ring = lay.layers[layer].window
            ring[self._pos[b] % w] = key[b]
            rings.append(ring)
        pool = torch.stack(rings).flatten(0, 1)
        live = self.live_window(w)
        base = torch.arange(len(rings), device=key.device)[:, None] * w
        rows = torch.where(live, base + torch.arange(w, device=key.device), -1)
        return Segment(pool, rows)

    def write_tail(self, layer, name, kv, score) -> None:
        for b in range(len(self.layouts)):
            comp = self._comp(layer, b, name)
            r = self._pos[b] % comp.kv.shape[0]
            comp.kv[r] = kv[b]
            comp.score[r] = score[b]

    def tail_windows(self, layer, name, rows):
        comps = [self._comp(layer, int(b), name) for b in rows]
        return torch.stack([c.kv for c in comps]), torch.stack([c.score for c in comps])

    def overlap(self, layer, name, rows):
        comps = [self._comp(layer, int(b), name) for b in rows]
        return torch.stack([c.prev_kv for c in comps]), torch.stack([c.prev_score for c in comps])

    def set_overlap(self, layer, name, rows, kv, score) -> None:
        for i, b in enumerate(rows.tolist()):
            comp = self._comp(layer, b, name)
            comp.prev_kv.copy_(kv[i])
            comp.prev_score.copy_(score[i])

    def append_entries(self, layer, kind, rows, entries) -> None:
        for i, b in enumerate(rows.tolist()):
            lk = self.layouts[b].layers[layer]
            if kind == INDEX_KEYS:
                lk.index_keys = torch.cat((lk.index_keys, entries[i : i + 1]))
            else:
                assert kind in (C4, HCA_ENTRIES)
                lk.entries = torch.cat((lk.entries, entries[i : i + 1]))

    def _entry_segment(self, layer: int, ids: torch.Tensor | None) -> Segment:
        tensors = [lay.layers[layer].entries for lay in self.layouts]
        counts = torch.tensor([t.shape[0] for t in tensors], device=self.positions.device)
        offsets = torch.cumsum(counts, 0) - counts
        pool = torch.cat(tensors)
        if ids is None:  # every entry, in order
            width = int(counts.max()) if len(tensors) else 0
            ids = torch.arange(width, device=pool.device).expand(len(tensors), width)
            ids = torch.where(ids < counts[:, None], ids, -1)
        rows = torch.where(ids >= 0, ids + offsets[:, None], -1)
        return Segment(pool, rows)

    def hca_segment(self, layer):
        return self._entry_segment(layer, None)

    def index_keys(self, layer):
        keys = [lay.layers[layer].index_keys for lay in self.layouts]
        counts = torch.tensor([k.shape[0] for k in keys], device=self.positions.device)
        return pad_sequence(keys, batch_first=True), counts

    def c4_segment(self, layer, ids):
        return self._entry_segment(layer, ids)

    def finish_step(self) -> None:
        for lay in self.layouts:
            lay.num_tokens += 1
        self._pos = [p + 1 for p in self._pos]
        self.positions = self.positions + 1
