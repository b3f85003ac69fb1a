"""How tokens see each other in one attention layer: batched decode over a `DecodeKV` (prefill: `model.prefill`).

For query t the visible set is the window (raw keys of positions t-W < j <= t), plus for HCA every
complete entry (w < (t+1)//rate) and for CSA the top-k complete entries the indexer picks; one softmax
with the per-head sink covers all of it. Entries appear as soon as their window completes, so the
completing token already sees them.
"""

from __future__ import annotations

import torch

from cachetier.batch import INDEX, MAIN, DecodeKV, emitting
from cachetier.layout import C4, HCA_ENTRIES, INDEX_KEYS, CompressorState
from core.config import CSA, HCA
from kernels.attention import sparse_attention
from model.layers import Attention, Compressor
from model.rope import Rotary


def compress_segment(
    comp: Compressor, state: CompressorState, kv: torch.Tensor, score: torch.Tensor, start: int, rot: Rotary
) -> tuple[torch.Tensor, CompressorState]:
    """Feed tokens at positions start.. into a compressor: (new entries [n, dim], rotated; the new state).

    Windows are aligned to absolute positions (multiples of the rate), never to chunk boundaries.
    """
    m = comp.rate
    pending = start % m
    all_kv = torch.cat((state.kv[:pending], kv))
    all_score = torch.cat((state.score[:pending], score))
    n_new = all_kv.shape[0] // m
    used = n_new * m
    new_state = CompressorState(torch.zeros_like(state.kv), torch.zeros_like(state.score), state.prev_kv, state.prev_score)
    rest = all_kv.shape[0] - used
    new_state.kv[:rest] = all_kv[used:]
    new_state.score[:rest] = all_score[used:]
    if n_new == 0:
        return kv.new_zeros(0, comp.dim), new_state
    win_kv, win_score = all_kv[:used].unflatten(0, (n_new, m)), all_score[:used].unflatten(0, (n_new, m))
    prev_kv = prev_score = None
    if comp.overlapped:
        d = comp.dim
        prev_kv = torch.cat((state.prev_kv[None], win_kv[:-1, :, :d]))
        prev_score = torch.cat((state.prev_score[None], win_score[:-1, :, :d]))
        # kept in the state's own dtype: a score computed in fp32 must not turn a bf16 layout's state fp32 (the
        # arena stores state in the model dtype, so a plain layout keeping fp32 would decode differently)
        new_state.prev_kv = win_kv[-1, :, :d].to(state.prev_kv.dtype, copy=True)
        new_state.prev_score = win_score[-1, :, :d].to(state.prev_score.dtype, copy=True)
    entries = comp.pool(win_kv, win_score, prev_kv, prev_score)
    first = start - pending
    positions = first + torch.arange(n_new, device=kv.device) * m
    return rot.apply(entries, positions), new_state


def _compress_step(
    comp: Compressor, store: DecodeKV, layer: int, name: str, kind: str, x: torch.Tensor, rot: Rotary, pack
) -> None:
    """Append this step's token to a compressor's tail; every request whose window completed emits an entry,
    stored as `pack` makes it (quantized once, here, for packed KV formats).

    Static shapes: every row pools its tail and the `emit` mask says whose entry counts (the others
    land in scratch), so the step never asks the host which rows emit.
    """
    pos = store.positions
    kv, score = comp.project(x, pos)
    store.write_tail(layer, name, kv, score)
    emit = emitting(pos, comp.rate)  # [batch]
    win_kv, win_score = store.tail_windows(layer, name)  # [batch, rate, width]
    prev_kv = prev_score = None
    if comp.overlapped:
        prev_kv, prev_score = store.overlap(layer, name)
    entries = rot.apply(comp.pool(win_kv, win_score, prev_kv, prev_score), pos + 1 - comp.rate)  # [batch, dim]
    store.append_entries(layer, kind, emit, pack(entries))
    if comp.overlapped:
        d = comp.dim
        store.set_overlap(layer, name, emit, win_kv[..., :d], win_score[..., :d])


def decode_layer(attn: Attention, store: DecodeKV, layer: int, x: torch.Tensor, rot: Rotary) -> torch.Tensor:
    """One layer for one new token per request (x [batch, hidden]), through the store; static shapes."""
    pos = store.positions

    def rotate(t):
        return rot.apply(t, pos)

    codec = attn.codec(x.dtype)
    q, key, latent = attn.project(x, rotate)
    segments = [store.write_window(layer, codec.pack_main(key))]
    if attn.kind == HCA:
        _compress_step(attn.compressor, store, layer, MAIN, HCA_ENTRIES, x, rot, codec.pack_main)
        segments.append(store.hca_segment(layer))
    elif attn.kind == CSA:
        idx = attn.indexer
        _compress_step(attn.compressor, store, layer, MAIN, C4, x, rot, codec.pack_main)
        _compress_step(idx.compressor, store, layer, INDEX, INDEX_KEYS, x, rot, codec.pack_index)
        qi, w = idx.queries(latent, x, rotate)
        ids = store.index_topk(layer, codec.index_query(qi), w, idx.topk)  # [batch, k], from the stored keys
        segments.append(store.c4_segment(layer, ids))
    o = sparse_attention(q, [(s.pool, s.rows) for s in segments], attn.attn_sink, attn.scale, codec.main_reader)
    return attn.output(o, lambda t: rot.apply(t, pos, inverse=True))
