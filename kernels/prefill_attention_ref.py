"""Torch reference of prefill sparse attention: many queries, each over its own rows, with a sink.

The decode contract (`sparse_attention_ref`: one query per batch row, each over `pool[rows]` of
a few segments) read with one row per *query*, plus one more kind of segment that prefill needs:
a *prefix* `pool[:counts[i]]` (HCA: every complete entry). A prefix can be thousands of entries per
query, so it is never gathered per query: it is read `tile` entries at a time, shared by a block
of queries, and folded in with an online softmax. Transient memory is therefore
QUERY_BLOCK x (gathered rows x dim + tile x heads), whatever the chunk and the prefix.
"""

from __future__ import annotations

import torch

from kernels.attention_ref import Unpack

Prefix = tuple[torch.Tensor, torch.Tensor]
"""(pool [n, dim], counts [queries]): query i sees pool rows 0..counts[i]-1."""


QUERY_BLOCK = 256
"""Queries attended at once: bounds the gathered rows ([block, len, dim]) and the prefix logits
([block, heads, tile]) independently of the chunk size."""


def prefill_attention_ref(
    q: torch.Tensor,
    segments: list[tuple[torch.Tensor, torch.Tensor]],
    prefix: Prefix | None,
    sinks: torch.Tensor,
    scale: float,
    tile: int = 512,
    unpack: Unpack = None,
) -> torch.Tensor:
    """q [queries, heads, dim] over its rows of each (pool, rows [queries, len]) segment (-1 = none)
    and its prefix of `prefix`, in one softmax with the per-head sink -> [queries, heads, dim]."""
    out = torch.empty_like(q)
    for a in range(0, q.shape[0], QUERY_BLOCK):
        b = min(a + QUERY_BLOCK, q.shape[0])
        block_prefix = None if prefix is None else (prefix[0], prefix[1][a:b])
        out[a:b] = _attend(q[a:b], [(pool, rows[a:b]) for pool, rows in segments], block_prefix, sinks, scale, tile,
                             unpack)
    return out


def _attend(q, segments, prefix, sinks, scale, tile, unpack=None) -> torch.Tensor:
    read = (lambda t: t) if unpack is None else unpack
    n_q, heads, dim = q.shape
    qf = q.float()
    # The running softmax state starts at the sink: max = sink, denominator = exp(sink - max) = 1.
    m = sinks.float()[None, :].expand(n_q, heads).contiguous()  # [queries, heads]
    denom = torch.ones(n_q, heads, device=q.device)
    acc = torch.zeros(n_q, heads, dim, device=q.device)
    for pool, rows in segments:
        if rows.shape[1] == 0:
            continue
        kv = read(pool.index_select(0, rows.clamp(min=0).flatten())).view(n_q, rows.shape[1], dim).float()  # [queries, len, dim]
        logits = torch.bmm(qf, kv.transpose(1, 2)) * scale  # [queries, heads, len]
        logits = logits.masked_fill((rows < 0)[:, None, :], float("-inf"))
        m, denom, acc = _fold(m, denom, acc, logits, lambda p, kv=kv: torch.bmm(p, kv))
    if prefix is not None:
        pool, counts = prefix
        lo, hi = int(counts.min()), int(counts.max())
        flat = qf.reshape(n_q * heads, dim)
        for t0 in range(0, hi, tile):
            t1 = min(t0 + tile, hi)
            block = read(pool[t0:t1]).float()  # [t, dim], dequantized per tile
            logits = (flat @ block.T).view(n_q, heads, t1 - t0) * scale  # [queries, heads, t]
            if t1 > lo:  # some queries see only part of this tile
                ids = torch.arange(t0, t1, device=q.device)
                logits = logits.masked_fill((ids[None, :] >= counts[:, None])[:, None, :], float("-inf"))
            m, denom, acc = _fold(m, denom, acc, logits, lambda p, b=block: (p.reshape(n_q * heads, -1) @ b).view(n_q, heads, dim))
    return (acc / denom[..., None]).to(q.dtype)


def _fold(m, denom, acc, logits, weigh):
    """Fold logits [queries, heads, keys] into the running (max, denominator, numerator);
    `weigh(p)` maps probabilities [queries, heads, keys] to their weighted values [queries, heads, dim]."""
    m_new = torch.maximum(m, logits.amax(dim=-1))  # finite: it never drops below the sink
    alpha = torch.exp(m - m_new)
    p = torch.exp(logits - m_new[..., None])
    denom = denom * alpha + p.sum(dim=-1)
    acc = acc * alpha[..., None] + weigh(p)
    return m_new, denom, acc
