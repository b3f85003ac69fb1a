"""Dispatcher for decode-time sparse attention: Triton on CUDA, the torch reference elsewhere."""

from __future__ import annotations

import torch

from core import device
from kernels.attention_ref import Unpack, sparse_attention_ref
from kernels.kv_format import MainRowReader


def dense_segments(segments: list[tuple[torch.Tensor, torch.Tensor]], unpack: Unpack) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Packed segments as plain ones: each segment's rows gathered and dequantized into a pool of their own
    ([batch * len, dim], row i of batch b at b * len + i). The Triton kernels read plain rows only."""
    out = []
    for pool, rows in segments:
        b, n = rows.shape
        dense = unpack(pool[rows.clamp(min=0)]).flatten(0, 1)
        own = torch.arange(b * n, device=rows.device).view(b, n)
        out.append((dense, torch.where(rows >= 0, own, -1)))
    return out


def sparse_attention(
    q: torch.Tensor, segments: list[tuple[torch.Tensor, torch.Tensor]], sinks: torch.Tensor, scale: float,
    unpack: Unpack = None,
) -> torch.Tensor:
    """Attention of q [batch, heads, dim] over `pool[rows]` of each (pool, rows) segment, with a sink;
    stored rows read through `unpack` (packed KV formats)."""
    if q.is_cuda and device.current().use_triton:
        from kernels.attention_triton import reads_packed, sparse_attention_triton

        if isinstance(unpack, MainRowReader) and reads_packed(unpack):  # v4 main rows: dequantized as they are loaded
            return sparse_attention_triton(q, segments, sinks, scale, packed=unpack)
        if unpack is not None:  # another row format or geometry: gather and dequantize first
            segments = dense_segments(segments, unpack)
        return sparse_attention_triton(q, segments, sinks, scale)
    return sparse_attention_ref(q, segments, sinks, scale, unpack)
