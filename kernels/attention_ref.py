"""Torch reference of attention with a per-head sink, over gathered rows or a dense mask.

Softmax with sink: p_j = exp(s_j) / (sum_i exp(s_i) + exp(z_h)); the sink only absorbs mass.
Keys and values are the same vectors (V4 shares one KV head).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def softmax_with_sink(logits: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """`logits` [..., heads, keys] (masked with -inf) -> probabilities over keys, sink dropped."""
    sink = sinks.to(logits.dtype).view(-1, 1).expand(*logits.shape[:-1], 1)
    combined = torch.cat((logits, sink), dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)
    return torch.softmax(combined, dim=-1)[..., :-1]


Unpack = Callable[[torch.Tensor], torch.Tensor] | None
"""Reads stored rows [..., row width] back as vectors [..., dim] (packed KV formats); None: rows are vectors."""


def gather_rows(segments: list[tuple[torch.Tensor, torch.Tensor]], unpack: Unpack = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate `pool[rows]` of every segment, read through `unpack`: ([batch, len, dim] values, [batch, len] validity).
    A missing row (-1) reads as zeros, as the kernels' masked loads do: its clamped index lands on whatever pool row 0
    holds, and in a packed arena those bytes need not decode to finite values (e4m3 0x7f is NaN), while a zero
    probability times NaN is NaN."""
    values, valid = [], []
    for pool, rows in segments:
        ok = rows >= 0
        got = pool[rows.clamp(min=0)]
        got = got if unpack is None else unpack(got)
        values.append(got.masked_fill(~ok[..., None], 0))
        valid.append(ok)
    return torch.cat(values, dim=1), torch.cat(valid, dim=1)


def sparse_attention_ref(
    q: torch.Tensor, segments: list[tuple[torch.Tensor, torch.Tensor]], sinks: torch.Tensor, scale: float,
    unpack: Unpack = None,
) -> torch.Tensor:
    """One query per batch row: q [batch, heads, dim] over the rows named by `segments` -> [batch, heads, dim].
    Packed rows are dequantized as they are gathered (`unpack`)."""
    kv, valid = gather_rows(segments, unpack)  # [batch, len, dim], [batch, len]
    logits = torch.einsum("bhd,bld->bhl", q, kv.to(q.dtype)) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    probs = softmax_with_sink(logits, sinks)
    return torch.einsum("bhl,bld->bhd", probs, kv.to(q.dtype))


def masked_attention_probs(
    q: torch.Tensor, kv: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """Many queries over one key set: q [tokens, heads, dim], kv [keys, dim], visible [tokens, keys] ->
    probabilities [tokens, heads, keys] (the sink's share dropped)."""
    logits = torch.einsum("thd,kd->thk", q, kv.to(q.dtype)) * scale
    logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
    return softmax_with_sink(logits, sinks)


def masked_attention_ref(
    q: torch.Tensor, kv: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """`masked_attention_probs` applied to the values: -> [tokens, heads, dim]."""
    return torch.einsum("thk,kd->thd", masked_attention_probs(q, kv, visible, sinks, scale), kv.to(q.dtype))
