"""A request's KV as the model produces and consumes it: the value prefill hands to decode.

Two parts, split the way the tier needs them:
- *classical* (grows with length): C4 entries and indexer keys of CSA layers, HCA entries;
- *state* (fixed size): the sliding-window ring of every layer and the compressor tails.

A layout is plain tensors plus small metadata, so it pickles and moves between processes as is.
Row `p % window` of a ring holds the key of position `p`; row `p % rate` of a compressor tail holds
the projections of position `p` while its window is incomplete.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from core.config import CSA, HCA, SLIDING, ModelConfig
from kernels.kv_format import model_codec

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
    """[sliding_window, row] ring of raw keys (= values). A row is `head_dim` values in the compute dtype, or
    for a packed KV format (`kernels.kv_format`) the stored bytes of one key; the same for entries and keys."""
    entries: torch.Tensor | None = None
    """[num_entries, row]: C4 entries (CSA) or HCA entries (HCA); stored normed and rotated. May be a
    prefix view of a larger buffer that this layer alone owns (room to append, see `append_rows`)."""
    index_keys: torch.Tensor | None = None
    """[num_entries, index row]: the indexer's keys (CSA only), entry s describes the same tokens as C4 entry s.
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
        """An empty layout for a model computing in `dtype`: compressor state in `dtype`, KV rows as
        `cfg.kv_format` stores them (`kernels.kv_format`: uint8 byte rows when packed)."""
        codec = model_codec(cfg, dtype)
        rows, mw, iw = codec.storage_dtype, codec.main_width, codec.index_width
        layers = []
        for kind in cfg.layer_types:
            window = torch.zeros(cfg.sliding_window, mw, dtype=rows, device=device)
            if kind == SLIDING:
                layers.append(LayerKV(kind, window))
                continue
            d = cfg.head_dim
            if kind == HCA:
                layers.append(LayerKV(
                    kind, window,
                    entries=torch.zeros(0, mw, dtype=rows, device=device),
                    compressor=CompressorState.empty(cfg.hca_rate, d, False, dtype, device),
                ))
            else:
                di = cfg.index_head_dim
                layers.append(LayerKV(
                    kind, window,
                    entries=torch.zeros(0, mw, dtype=rows, device=device),
                    index_keys=torch.zeros(0, iw, dtype=rows, device=device),
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


# --- moving a layout between processes ------------------------------------------------------------

LAYOUT_VERSION = 1
_ALIGN = 64  # byte alignment of every tensor in a packed buffer (any dtype can be viewed in place)
_PARTS = ("kv", "score", "prev_kv", "prev_score")


SKIPPED_TOKENS = "skipped_tokens"
"""`KVLayout.meta` key of a layout that leaves out the classical entries of its first `meta[SKIPPED_TOKENS]` tokens
(`without_prefix`): a follow-up turn's handoff to the decode actor that kept them (`cachetier.retention`)."""


def skipped_tokens(layout: KVLayout) -> int:
    return int(layout.meta.get(SKIPPED_TOKENS, 0))


def without_prefix(layout: KVLayout, cfg: ModelConfig, tokens: int) -> KVLayout:
    """The layout less the classical entries (C4 and HCA entries, indexer keys) of its first `tokens` tokens, a
    multiple of both compress rates: views, no copy; the state travels whole. `with_prefix` puts them back."""
    if not tokens:
        return layout
    if tokens > layout.num_tokens or tokens % cfg.csa_rate or tokens % cfg.hca_rate:
        raise ValueError(f"a layout of {layout.num_tokens} tokens cannot leave out its first {tokens}: at most all of "
                         f"them, a multiple of both compress rates ({cfg.csa_rate}, {cfg.hca_rate})")
    layers = []
    for i, lk in enumerate(layout.layers):
        rate = cfg.compress_rate(i)
        cut = tokens // rate if rate else 0
        layers.append(LayerKV(lk.kind, lk.window, None if lk.entries is None else lk.entries[cut:],
                              None if lk.index_keys is None else lk.index_keys[cut:], lk.compressor, lk.index_compressor))
    return KVLayout(layout.num_tokens, layers, {**layout.meta, SKIPPED_TOKENS: tokens})


def with_prefix(layout: KVLayout, prefix: list[tuple[torch.Tensor | None, torch.Tensor | None]]) -> KVLayout:
    """A layout made by `without_prefix` with its left-out entries given back: `prefix[i]` is layer i's (entries,
    indexer keys) of the skipped tokens, in the layout's row types. Returns a whole layout (new tensors)."""
    layers = []
    for lk, (ents, keys) in zip(layout.layers, prefix, strict=True):
        def joined(head, tail):
            if tail is None:
                return None
            if head is None or head.shape[1:] != tail.shape[1:] or head.dtype != tail.dtype:
                raise ValueError("the kept prefix's rows do not match the layout's")
            return torch.cat((head.to(tail.device), tail))
        layers.append(LayerKV(lk.kind, lk.window, joined(ents, lk.entries), joined(keys, lk.index_keys), lk.compressor,
                              lk.index_compressor))
    meta = {k: v for k, v in layout.meta.items() if k != SKIPPED_TOKENS}
    return KVLayout(layout.num_tokens, layers, meta)


def layout_format(cfg: ModelConfig, dtype: torch.dtype) -> str:
    """What a layout's bytes mean: version, dtype and the geometry that shapes them. A decode side
    accepts a layout only when its own format is the same string (a mismatch is refused, not guessed)."""
    kinds = "".join(k[0] for k in cfg.layer_types)
    return (f"v{LAYOUT_VERSION}:{str(dtype).removeprefix('torch.')}:d{cfg.head_dim}:i{cfg.index_head_dim}"
            f":w{cfg.sliding_window}:c{cfg.csa_rate}:h{cfg.hca_rate}:{kinds}:kv-{cfg.kv_format}")


@dataclass
class PackedLayout:
    """A layout as one contiguous byte buffer plus the table to read it back.

    A numpy buffer crosses Ray's object store without a copy on one node (the receiver maps it), and one
    buffer costs one serialisation instead of one per tensor. `tensor_bytes` is what the layout's tensors
    hold (the buffer adds alignment padding).
    """

    num_tokens: int
    format: str
    table: tuple[tuple[int, str, str, tuple[int, ...], int], ...]
    """(layer, part, dtype, shape, byte offset) per tensor; parts are `window`, `entries`, `index_keys`,
    `compressor.<kv|score|prev_kv|prev_score>`, `index_compressor.<...>`."""
    kinds: tuple[str, ...]
    buffer: np.ndarray | torch.Tensor
    """uint8; numpy for the object store (mapped without a copy), a tensor for direct tensor transports."""
    tensor_bytes: int
    meta: dict = field(default_factory=dict)


def _named_tensors(layout: KVLayout):
    for i, lk in enumerate(layout.layers):
        yield i, "window", lk.window
        if lk.entries is not None:
            yield i, "entries", lk.entries
        if lk.index_keys is not None:
            yield i, "index_keys", lk.index_keys
        for comp_name, comp in (("compressor", lk.compressor), ("index_compressor", lk.index_compressor)):
            if comp is None:
                continue
            for part in _PARTS:
                t = getattr(comp, part)
                if t is not None:
                    yield i, f"{comp_name}.{part}", t


def pack_layout(layout: KVLayout, fmt: str) -> PackedLayout:
    """Copy a layout's tensors into one aligned byte buffer (on the host)."""
    table, offset, total = [], 0, 0
    items = list(_named_tensors(layout))
    for i, part, t in items:
        n = t.numel() * t.element_size()
        table.append((i, part, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset))
        offset += -(-n // _ALIGN) * _ALIGN
        total += n
    buf = torch.empty(offset, dtype=torch.uint8)
    for (_, _, _, _, off), (_, _, t) in zip(table, items):
        n = t.numel() * t.element_size()
        if n:
            buf[off : off + n].copy_(t.detach().contiguous().cpu().view(-1).view(torch.uint8))
    return PackedLayout(layout.num_tokens, fmt, tuple(table), tuple(lk.kind for lk in layout.layers), buf.numpy(),
                        total, dict(layout.meta))


def unpack_layout(packed: PackedLayout) -> KVLayout:
    """The layout whose tensors are views into `packed.buffer` (read them, copy what must outlive it)."""
    if isinstance(packed.buffer, torch.Tensor):  # moved by a tensor transport
        raw = packed.buffer.view(torch.uint8).cpu()
    elif packed.buffer.size == 0:
        raw = torch.empty(0, dtype=torch.uint8)
    else:
        with warnings.catch_warnings():  # the buffer may be a read-only mapping of the object store
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(packed.buffer, dtype=torch.uint8)
    layers = [LayerKV(kind, torch.empty(0)) for kind in packed.kinds]
    comps: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for i, part, dtype_name, shape, off in packed.table:
        dtype = getattr(torch, dtype_name)
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        t = raw[off : off + n].view(dtype).view(shape)
        if "." in part:
            comp_name, sub = part.split(".")
            comps.setdefault((i, comp_name), {})[sub] = t
        else:
            setattr(layers[i], part, t)
    for (i, comp_name), parts in comps.items():
        setattr(layers[i], comp_name, CompressorState(**parts))
    return KVLayout(packed.num_tokens, layers, dict(packed.meta))
