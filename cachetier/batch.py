"""The storage interface the model's batched decode step works through, and its plain implementation.

The decode step of the model never touches storage directly: it asks a `DecodeKV` for the window
ring, the compressor tails and the entries of each layer, for the indexer's selection (`index_topk`:
one operation over the stored keys, where the store keeps them) and for the C4 entries selected.
`LayoutBatch` answers from plain `KVLayout`s (everything resident); the decode worker's tiered store
answers from its device arena, host pool and hot buffers (`cachetier.tiered_batch`). Both select over
the same keys with the same operation and hand the attention the same `Segment`s — the same rows in
the same order, padded to the same lengths — so the two give bit-identical results.

Every operation has static shapes: the whole batch does the same work each step and masks say
which rows it counts for (which rows complete a compressor window, which entries exist). That is
what lets the tiered store's step run compiled or captured in a CUDA graph. Gather lengths come
from the step's context bucket (`cachetier.buckets`).

A step is `begin_step()`, the layers, `end_step()` (all on the device, nothing read back), then
`advance()` on the host once the step has run.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from cachetier.buckets import context_blocks, gather_len
from cachetier.geometry import default_block_tokens
from cachetier.layout import C4, HCA_ENTRIES, INDEX_KEYS, KVLayout
from core.config import ModelConfig
from kernels.index_topk import index_topk
from kernels.index_topk_ref import PagedKeys
from kernels.kv_format import model_codec

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


def emitting(positions: torch.Tensor, rate: int) -> torch.Tensor:
    """[batch] bool: the token at `positions` completes a compressor window of `rate` tokens."""
    return (positions + 1) % rate == 0


def entry_counts(positions: torch.Tensor, rate: int) -> torch.Tensor:
    """[batch] complete entries of `rate` once the token at `positions` is in (this step's emission included)."""
    return (positions + 1) // rate


class DecodeKV(ABC):
    """Per-layer storage operations of one batched decode step (one new token per request)."""

    positions: torch.Tensor
    """[batch] absolute position of the token decoded this step."""
    window: int
    """The model's sliding window."""
    live: torch.Tensor
    """[batch, window] bool: `window_rows` of this step, set by `begin_step`."""

    def begin_step(self) -> None:
        """Derive this step's masks once; every layer reads them."""
        self.live = window_rows(self.positions, self.window)

    @abstractmethod
    def gather_len(self, rate: int) -> int:
        """Entries of compression `rate` each batch row gathers this step (its context bucket)."""

    @abstractmethod
    def write_window(self, layer: int, key: torch.Tensor) -> Segment:
        """Store `key` [batch, dim] at ring slot `p % window`; return the ring as a segment."""

    @abstractmethod
    def write_tail(self, layer: int, name: str, kv: torch.Tensor, score: torch.Tensor) -> None:
        """Store this token's compressor projections at tail row `p % rate`."""

    @abstractmethod
    def tail_windows(self, layer: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Every batch row's tail (kv, score) [batch, rate, width]; complete where `emitting`."""

    @abstractmethod
    def overlap(self, layer: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """CSA: first halves [batch, rate, width/2] of each row's previous complete window (score -inf if none)."""

    @abstractmethod
    def set_overlap(self, layer: int, name: str, emit: torch.Tensor, kv: torch.Tensor, score: torch.Tensor) -> None:
        """CSA: the rows where `emit` [batch] replace their overlap with kv/score [batch, rate, width/2]."""

    @abstractmethod
    def append_entries(self, layer: int, kind: str, emit: torch.Tensor, entries: torch.Tensor) -> None:
        """The rows where `emit` [batch] append their row of `entries` [batch, dim]; `kind` is `c4`, `hca`
        or `index_keys`. The entry's index is `entry_counts(p, rate) - 1`."""

    @abstractmethod
    def hca_segment(self, layer: int) -> Segment:
        """All HCA entries of each request (every complete one is visible at decode), [batch, gather_len]."""

    @abstractmethod
    def index_source(self, layer: int) -> PagedKeys:
        """Where this step finds the layer's indexer keys: each row's blocks of stored keys (gather length
        `gather_len(csa_rate)`) and its count of complete entries."""

    def index_topk(self, layer: int, q: torch.Tensor, w: torch.Tensor, topk: int) -> torch.Tensor:
        """The entries the indexer selects this step: q [batch, heads, index_dim] in the keys' space, w [batch, heads]
        -> ids [batch, min(topk, gather_len)] (-1 = none), by one operation over the stored keys
        (`kernels.index_topk`); every store runs the same one over the same keys, so they select alike."""
        return index_topk(q, w, self.index_source(layer), topk)

    @abstractmethod
    def c4_segment(self, layer: int, ids: torch.Tensor) -> Segment:
        """The C4 entries `ids` [batch, k] (-1 = none) selected by the indexer, as a segment."""

    def end_step(self) -> None:  # noqa: B027 - plain layouts keep no device-side step state
        """The device-side end of the step (e.g. the hot buffers' LRU clock); part of a captured step."""

    @abstractmethod
    def advance(self) -> None:
        """On the host, after the step: every request has consumed its token, lengths move on."""


class LayoutBatch(DecodeKV):
    """`DecodeKV` over plain layouts, everything resident; advances the layouts in place.

    The model's own decode path and the reference the tiered store is compared with: it works row
    by row in Python (and reads masks back), so it runs eagerly only. Its gather lengths follow
    the context bucket of the default block size, so it pads exactly as a tiered store with default
    blocks does.
    """

    def __init__(self, cfg: ModelConfig, layouts: list[KVLayout]) -> None:
        self.cfg = cfg
        self.layouts = layouts
        self.window = cfg.sliding_window
        device = layouts[0].layers[0].window.device
        self._pos = [lay.num_tokens for lay in layouts]
        self.positions = torch.tensor(self._pos, dtype=torch.long, device=device)
        self.block_tokens = default_block_tokens(cfg)
        self.num_blocks = context_blocks(max(self._pos) + 1, self.block_tokens)

    def gather_len(self, rate: int) -> int:
        return gather_len(self.num_blocks, self.block_tokens, rate)

    def _comp(self, layer: int, b: int, name: str):
        lk = self.layouts[b].layers[layer]
        return lk.compressor if name == MAIN else lk.index_compressor

    def write_window(self, layer: int, key: torch.Tensor) -> Segment:
        w = self.window
        rings = []
        for b, lay in enumerate(self.layouts):
            ring = lay.layers[layer].window
            ring[self._pos[b] % w] = key[b]
            rings.append(ring)
        pool = torch.stack(rings).flatten(0, 1)
        base = torch.arange(len(rings), device=key.device)[:, None] * w
        rows = torch.where(self.live, base + torch.arange(w, device=key.device), -1)
        return Segment(pool, rows)

    def write_tail(self, layer, name, kv, score) -> None:
        for b in range(len(self.layouts)):
            comp = self._comp(layer, b, name)
            r = self._pos[b] % comp.kv.shape[0]
            comp.kv[r] = kv[b]
            comp.score[r] = score[b]

    def tail_windows(self, layer, name):
        comps = [self._comp(layer, b, name) for b in range(len(self.layouts))]
        return torch.stack([c.kv for c in comps]), torch.stack([c.score for c in comps])

    def overlap(self, layer, name):
        comps = [self._comp(layer, b, name) for b in range(len(self.layouts))]
        return torch.stack([c.prev_kv for c in comps]), torch.stack([c.prev_score for c in comps])

    def set_overlap(self, layer, name, emit, kv, score) -> None:
        for b in torch.nonzero(emit).flatten().tolist():
            comp = self._comp(layer, b, name)
            comp.prev_kv.copy_(kv[b])
            comp.prev_score.copy_(score[b])

    def append_entries(self, layer, kind, emit, entries) -> None:
        assert kind in (C4, HCA_ENTRIES, INDEX_KEYS)
        for b in torch.nonzero(emit).flatten().tolist():
            lk = self.layouts[b].layers[layer]
            if kind == INDEX_KEYS:
                lk.index_keys = torch.cat((lk.index_keys, entries[b : b + 1]))
            else:
                lk.entries = torch.cat((lk.entries, entries[b : b + 1]))

    def _entry_segment(self, layer: int, ids: torch.Tensor | None) -> Segment:
        tensors = [lay.layers[layer].entries for lay in self.layouts]
        counts = torch.tensor([t.shape[0] for t in tensors], device=self.positions.device)
        offsets = torch.cumsum(counts, 0) - counts
        pool = torch.cat(tensors + [tensors[0].new_zeros(1, tensors[0].shape[1])])  # never empty: masked rows gather row 0
        if ids is None:  # every entry, in order, padded to the gather length
            width = self.gather_len(self.cfg.hca_rate)
            ids = torch.arange(width, device=pool.device).expand(len(tensors), width)
            ids = torch.where(ids < counts[:, None], ids, -1)
        rows = torch.where(ids >= 0, ids + offsets[:, None], -1)
        return Segment(pool, rows)

    def hca_segment(self, layer):
        return self._entry_segment(layer, None)

    def index_source(self, layer):
        lks = [lay.layers[layer] for lay in self.layouts]
        keys = [lk.index_keys for lk in lks]
        n, width = self.gather_len(self.cfg.csa_rate), keys[0].shape[-1]
        pool = keys[0].new_zeros(len(keys), n, width)  # every row's keys padded to the gather length, one block table
        for b, k in enumerate(keys):
            pool[b, : k.shape[0]] = k
        counts = torch.tensor([k.shape[0] for k in keys], device=self.positions.device)
        per = self.block_tokens // self.cfg.csa_rate
        dev = pool.device
        starts = (torch.arange(len(keys), device=dev)[:, None] * n + torch.arange(0, n, per, device=dev)) * width
        codec = model_codec(self.cfg, lks[0].index_compressor.kv.dtype)  # the compute dtype the layouts were made in
        return PagedKeys(pool.view(-1), starts, counts, per, codec)

    def c4_segment(self, layer, ids):
        return self._entry_segment(layer, ids)

    def advance(self) -> None:
        for lay in self.layouts:
            lay.num_tokens += 1
        self._pos = [p + 1 for p in self._pos]
        self.positions = self.positions + 1
