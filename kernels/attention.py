"""Dispatcher for decode-time sparse attention: Triton on CUDA, the torch reference elsewhere."""

from __future__ import annotations

import torch

from core import device
from kernels.attention_ref import sparse_attention_ref


def sparse_attention(
    q: torch.Tensor, segments: list[tuple[torch.Tensor, torch.Tensor]], sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of q [batch, heads, dim] over `pool[rows]` of each (pool, rows) segment, with a sink."""
    if q.is_cuda and device.current().use_triton:
        from kernels.attention_triton import sparse_attention_triton

        return sparse_attention_triton(q, segments, sinks, scale)
    return sparse_attention_ref(q, segments, sinks, scale)
