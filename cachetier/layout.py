"""A request's KV as the model produces and consumes it: the value prefill hands to decode.

Two parts, split the way the tier needs them:
- *classical* (grows with length): C4 entries and indexer keys of CSA layers, HCA entries;
- *state* (fixed size): the sliding-window ring of every layer and the compressor tails.

A layout is plain tensors plus small metadata, so it pickles and moves between processes as is.
Row `p % window` of a ring holds the key of position `p`; row `p % rate` of a compressor tail holds
the projections of position `p` while its window is incomplete.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from core.config import CSA, HCA, SLIDING, ModelConfig

# Kinds reported by `KVLayout.nbytes()`.
C4 = "c4"
HCA_ENTRIES = "hca"
INDEX_KEYS = "index_keys"
SWA = "swa"
COMPRESSOR_STATE = "compressor_state"
CLASSICAL_KINDS = (C4, HCA_ENTRIES, INDEX_KEYS)
STATE_KINDS = (SWA, COMPRESSOR_STATE)


@dataclass
class CompressorState:
    """The pending part of one compressor: rows of the incomplete window and, for CSA, the overlap.

    `kv`/`score` [rate, width]: projections and gate scores (position bias already added) of the
    tokens of the current incomplete window, row `p % rate`; the first `num_tokens % rate` rows are live.
    `prev_kv`/`prev_score` [rate, width/2] (CSA only): the first halves of the last complete window,
    which the next entry pools over; score -inf while no window is complete.
    """

    kv: torch.Tensor
    score: torch.Tensor
    prev_kv: torch.Tensor | None = None
    prev_score: torch.Tensor | None = None

    @staticmethod
    def empty(rate: int, width: int, overlapped: bool, dtype: torch.dtype, device=None) -> CompressorState:
        z = torch.zeros(rate, width, dtype=dtype, device=device)
        if not overlapped:
            return CompressorState(z, z.clone())
        half = width // 2
        return CompressorState(
            z, z.clone(),
            torch.zeros(rate, half, dtype=dtype, device=device),
            torch.full((rate, half), float("-inf"), dtype=dtype, device=device),
        )

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.kv, self.score, self.prev_kv, self.prev_score) if t is not None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def clone(self) -> CompressorState:
        c = [t.clone() if t is not None else None for t in (self.kv, self.score, self.prev_kv, self.prev_score)]
        return CompressorState(*c)


@dataclass
class LayerKV:
    """One layer's part of a layout."""

    kind: str
    window: torch.Tensor
    """[sliding_window, head_dim] ring of raw keys (= values)."""
    entries: torch.Tensor | None = None
    """[num_entries, head_dim]: C4 entries (CSA) or HCA entries (HCA); stored normed and rotated. May be a
    prefix view of a larger buffer that this layer alone owns (room to append, see `append_rows`)."""
    index_keys: torch.Tensor | None = None
    """[num_entries, index_head_dim]: the indexer's keys (CSA only), entry s describes the same tokens as C4 entry s.
    Grows like `entries`."""
    compressor: CompressorState | None = None
    index_compressor: CompressorState | None = None

    @property
    def num_entries(self) -> int:
        return 0 if self.entries is None else self.entries.shape[0]


@dataclass
class KVLayout:
    """Everything one request's KV is made of, after `num_tokens` tokens."""

    num_tokens: int
    layers: list[LayerKV]
    meta: dict = field(default_factory=dict)
    """Small metadata travelling with the layout (request id, handoff bookkeeping)."""

    @staticmethod
    def empty(cfg: ModelConfig, dtype: torch.dtype = torch.float32, device=None) -> KVLayout:
        layers = []
        for kind in cfg.layer_types:
            window = torch.zeros(cfg.sliding_window, cfg.head_dim, dtype=dtype, device=device)
            if kind == SLIDING:
                layers.append(LayerKV(kind, window))
                continue
            d = cfg.head_dim
            if kind == HCA:
                layers.append(LayerKV(
                    kind, window,
                    entries=torch.zeros(0, d, dtype=dtype, device=device),
                    compressor=CompressorState.empty(cfg.hca_rate, d, False, dtype, device),
                ))
            else:
                di = cfg.index_head_dim
                layers.append(LayerKV(
                    kind, window,
                    entries=torch.zeros(0, d, dtype=dtype, device=device),
                    index_keys=torch.zeros(0, di, dtype=dtype, device=device),
                    compressor=CompressorState.empty(cfg.csa_rate, 2 * d, True, dtype, device),
                    index_compressor=CompressorState.empty(cfg.csa_rate, 2 * di, True, dtype, device),
                ))
        return KVLayout(0, layers)

    def nbytes(self) -> dict[str, int]:
        """Bytes held, per kind (`c4`, `hca`, `index_keys`, `swa`, `compressor_state`)."""
        out = dict.fromkeys(CLASSICAL_KINDS + STATE_KINDS, 0)
        for layer in self.layers:
            out[SWA] += _nbytes(layer.window)
            if layer.kind == CSA:
                out[C4] += _nbytes(layer.entries)
                out[INDEX_KEYS] += _nbytes(layer.index_keys)
            elif layer.kind == HCA:
                out[HCA_ENTRIES] += _nbytes(layer.entries)
            for comp in (layer.compressor, layer.index_compressor):
                if comp is not None:
                    out[COMPRESSOR_STATE] += comp.nbytes()
        return out

    def total_bytes(self) -> int:
        return sum(self.nbytes().values())

    def num_entries(self, kind: str) -> int:
        """Entries per layer of `kind` (`csa` or `hca`); the same in every layer of that kind."""
        for layer in self.layers:
            if layer.kind == kind:
                return layer.num_entries
        return 0

    def reserve(self, cfg: ModelConfig, num_tokens: int) -> None:
        """Make room for the entries of `num_tokens` tokens in every growing tensor (C4, HCA, indexer keys),
        so that appending them (`append_rows`) never copies what is already there."""
        for i, lk in enumerate(self.layers):
            if lk.entries is not None:
                lk.entries = reserve_rows(lk.entries, num_tokens // cfg.compress_rate(i))
            if lk.index_keys is not None:
                lk.index_keys = reserve_rows(lk.index_keys, num_tokens // cfg.csa_rate)

    def clone(self) -> KVLayout:
        layers = [
            LayerKV(
                lk.kind, lk.window.clone(),
                None if lk.entries is None else lk.entries.clone(),
                None if lk.index_keys is None else lk.index_keys.clone(),
                None if lk.compressor is None else lk.compressor.clone(),
                None if lk.index_compressor is None else lk.index_compressor.clone(),
            )
            for lk in self.layers
        ]
        return KVLayout(self.num_tokens, layers, dict(self.meta))


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


# --- growing tensors with amortised appends ---------------------------------------------------------
# A growing tensor ([rows, width], C4/HCA entries or indexer keys) may be a prefix view of a larger
# buffer: rows beyond its end are spare room. Appending writes into the room when there is enough and
# returns a longer view of the same buffer, so a long prefill copies each entry once instead of
# copying the whole tensor every chunk (torch.cat). Views never overlap what another view shows;
# `clone()` and pickling a layout whose buffers were reserved exactly carry no spare room.
# The rows past the end are taken as free room, so a growing tensor must own its buffer: never
# append to a view that starts a buffer shared with other tensors (slice a copy instead).

GROWTH = 2
"""Capacity multiplier when an append finds no room (used only when no `reserve` sized the buffer)."""


def row_capacity(t: torch.Tensor) -> int:
    """Rows `t` can grow to in place: its buffer's size when it is a contiguous prefix view, else its length."""
    if t.dim() != 2 or t.storage_offset() != 0 or not t.is_contiguous() or t.shape[1] == 0:
        return t.shape[0]
    return t.untyped_storage().nbytes() // (t.shape[1] * t.element_size())


def reserve_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """`t` backed by a buffer of at least `rows` rows (a view of the same values)."""
    if row_capacity(t) >= rows:
        return t
    buf = t.new_empty(rows, t.shape[1])
    buf[: t.shape[0]] = t
    return buf[: t.shape[0]]


def append_rows(t: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """`t` [n, width] followed by `new` [m, width]: in place when the buffer has room (amortised O(m))."""
    n, m = t.shape[0], new.shape[0]
    if m == 0:
        return t
    if row_capacity(t) < n + m:
        t = reserve_rows(t, max(n + m, GROWTH * n))
    full = t.as_strided((n + m, t.shape[1]), (t.shape[1], 1))
    full[n:] = new
    return full
