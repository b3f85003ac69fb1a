"""One attention layer over a chunk of a request's prompt, advancing its layout in place.

The sparse path (the default) reads, for each query, exactly what V4's attention sees: its window of
raw keys, and for CSA its top-k C4 entries (gathered by id) or for HCA every complete entry (a
prefix, streamed). The indexer is the one part that looks at every visible entry; it scores them a
tile at a time with a running top-k (`model.index_topk`). So the transient memory of a chunk is
bounded by chunk x (window + top-k + tile), whatever the context (docs/long-context.md).

The dense path is the reference the sparse one is tested against: every query of the chunk scores
the window and *all* entries in one [chunk, keys] matrix, with a visibility mask built from the
untiled indexer selection. Both produce the same entries, tails and ring, and logits within fp32
rounding.
"""

from __future__ import annotations

import torch

from cachetier.layout import LayerKV, append_rows
from core.config import CSA, HCA, ModelConfig
from core.configs import PrefillConfig
from kernels.attention_ref import masked_attention_ref
from kernels.prefill_attention import prefill_attention
from kernels.prefill_attention_ref import QUERY_BLOCK
from model.attention import compress_segment
from model.index_topk import tiled_topk
from model.layers import Attention, complete_entries, select_topk, selection_mask, window_visible
from model.rope import Rotary

DEFAULT_TILE = PrefillConfig.entry_tile

TRUNK_ACTIVATIONS = 10
"""Token-wise activations a chunk holds at once, in units of one token's widest vector
(max(hc_mult * hidden, heads * head_dim) elements). Measured: about 7.5 on the built-in model."""
INDEX_BYTES_PER_PAIR = 32
"""Indexer bytes per (query, entry) of a tile, worst case: its fp32 scores and visibility mask, and
when many scores can enter the top-k, their int64 keys with their temporaries (typically ~6)."""


def prefill_layer(
    attn: Attention,
    lk: LayerKV,
    x: torch.Tensor,
    start: int,
    rot: Rotary,
    window: int,
    dense: bool = False,
    tile: int = DEFAULT_TILE,
) -> torch.Tensor:
    """One layer over tokens x [L, hidden] at positions start..start+L-1 of one request -> [L, hidden]."""
    L = x.shape[0]
    pos = torch.arange(start, start + L, device=x.device)

    def rotate(t):
        return rot.apply(t, pos)

    codec = attn.codec(x.dtype)
    q, key, latent = attn.project(x, rotate)
    key = codec.pack_main(key)  # stored form (quantized once, here)
    # Window keys: the ring's earlier keys (chronological) followed by this chunk's keys.
    old_pos = torch.arange(max(0, start - window + 1), start, device=x.device)
    keys = torch.cat((lk.window[old_pos % window], key))  # [old + L, stored row]
    tail = pos[-window:]
    lk.window[tail % window] = key[-window:]

    qi = w = None
    if attn.compressor is not None:
        comp = attn.compressor
        kv, score = comp.project(x, pos)
        new, lk.compressor = compress_segment(comp, lk.compressor, kv, score, start, rot)
        lk.entries = append_rows(lk.entries, codec.pack_main(new))
        if attn.kind == CSA:
            idx = attn.indexer
            ikv, iscore = idx.compressor.project(x, pos)
            new_keys, lk.index_compressor = compress_segment(idx.compressor, lk.index_compressor, ikv, iscore, start, rot)
            lk.index_keys = append_rows(lk.index_keys, codec.pack_index(new_keys))
            qi, w = idx.queries(latent, x, rotate)
            qi = codec.index_query(qi)

    if dense:
        o = _dense(attn, lk, q, codec.unpack_main(keys), torch.cat((old_pos, pos)), pos, window, qi, w, codec)
    else:
        o = _sparse(attn, lk, q, keys, old_pos.numel(), start, window, qi, w, tile, codec)
    return attn.output(o, lambda t: rot.apply(t, pos, inverse=True))


def window_rows(num_queries: int, num_old: int, window: int, device=None) -> torch.Tensor:
    """Rows of each query's window in [old keys | chunk keys]: [queries, window], -1 before the first key.

    Query i sits at row num_old + i and sees the `window` rows ending there."""
    rows = torch.arange(num_queries, device=device)[:, None] + (num_old - window + 1) + torch.arange(window, device=device)
    return rows.masked_fill(rows < 0, -1)


def _sparse(attn, lk, q, keys, num_old, start, window, qi, w, tile, codec) -> torch.Tensor:
    L = q.shape[0]
    segments = [(keys, window_rows(L, num_old, window, q.device))]
    prefix = None
    if attn.compressor is not None:
        rate = attn.compressor.rate
        # Entries complete for each query: the windows that ended at or before it.
        counts = (torch.arange(start, start + L) + 1) // rate  # [L] on the CPU: bounds without a device sync
        if attn.kind == HCA:
            prefix = (lk.entries, counts.to(q.device))
        else:
            idx, index_keys = attn.indexer, lk.index_keys

            def score(rows: slice, t0: int, t1: int) -> torch.Tensor:
                return idx.scores(qi[rows], w[rows], codec.unpack_index(index_keys[t0:t1]))  # dequantized per tile

            block = score_block(tile) if q.device.type == "cpu" else None  # a GPU scores a whole tile at once
            ids = tiled_topk(score, counts, idx.topk, tile, q.device, block)  # [L, k]
            if ids.shape[1]:
                segments.append((lk.entries, ids))
    # stored rows are dequantized as they are read
    return prefill_attention(q, segments, prefix, attn.attn_sink, attn.scale, tile, codec.main_reader)


def score_block(tile: int) -> int:
    """Queries scored per indexer call: about 32K (query, entry) pairs, so that the call's
    [queries, index heads, tile] intermediate stays in a CPU core's cache (measured 3-5x faster
    than scoring a whole chunk at once)."""
    return max(16, (1 << 15) // tile)


def chunk_transient_bytes(cfg: ModelConfig, chunk: int, tile: int, element_bytes: int = 4, cuda: bool = False) -> int:
    """Upper bound on the memory one sparse prefill chunk allocates besides the layout (bytes).

    chunk x (trunk + tile x indexer) + the attention's per-query-block work + one indexer scoring
    call; nothing grows with the context (docs/long-context.md states the terms;
    tests/unit/test_long_prefill.py measures them on the CPU). On CUDA the Triton kernel gathers
    nothing, and the indexer scores the whole chunk per tile.
    """
    widest = max(cfg.hc_mult * cfg.hidden_size, cfg.num_heads * cfg.head_dim)
    trunk = TRUNK_ACTIVATIONS * widest * element_bytes  # per token
    index = tile * INDEX_BYTES_PER_PAIR  # per token
    # per query block: gathered rows (window + top-k) and their weights, six [heads, tile] prefix temporaries
    rows = (cfg.sliding_window + cfg.index_topk) * (cfg.head_dim * element_bytes * 2 + cfg.num_heads * 4 * 3)
    attend = 0 if cuda else QUERY_BLOCK * (rows + cfg.num_heads * tile * 4 * 6)
    queries = chunk if cuda else score_block(tile)
    scoring = queries * cfg.index_n_heads * (tile + 64) * 4 * 2  # one scoring call's [queries, heads, tile] products
    return chunk * (trunk + index) + attend + scoring


def _dense(attn, lk, q, keys, key_pos, pos, window, qi, w, codec) -> torch.Tensor:
    """The reference: one masked softmax over [window keys | all entries] for every query."""
    visible = window_visible(pos, key_pos, window)  # [L, window keys]
    if attn.compressor is not None:
        n = lk.num_entries
        complete = complete_entries(pos, n, attn.compressor.rate)  # [L, n]
        if attn.kind == HCA:
            chosen = complete
        else:
            idx = attn.indexer
            chosen = selection_mask(select_topk(idx.scores(qi, w, codec.unpack_index(lk.index_keys)), complete, idx.topk), n)
        keys = torch.cat((keys, codec.unpack_main(lk.entries)))
        visible = torch.cat((visible, chosen), dim=1)
    return masked_attention_ref(q, keys, visible, attn.attn_sink, attn.scale)
