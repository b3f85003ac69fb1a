"""Dispatcher for prefill sparse attention: Triton on CUDA, the torch reference elsewhere."""

from __future__ import annotations

import torch

from core import device
from kernels.attention import dense_segments
from kernels.attention_ref import Unpack
from kernels.kv_format import MainRowReader
from kernels.prefill_attention_ref import Prefix, prefill_attention_ref


def prefill_attention(
    q: torch.Tensor,
    segments: list[tuple[torch.Tensor, torch.Tensor]],
    prefix: Prefix | None,
    sinks: torch.Tensor,
    scale: float,
    tile: int,
    unpack: Unpack = None,
) -> torch.Tensor:
    """Attention of q [queries, heads, dim] over its rows of each (pool, rows) segment and its prefix
    `pool[:counts[i]]`, with a sink; `tile` bounds the reference's transient (prefix rows read at once).
    Stored rows are read through `unpack` (packed KV formats)."""
    if device.current().use_triton and q.is_cuda:
        from kernels.attention_triton import reads_packed
        from kernels.prefill_attention_triton import prefill_attention_triton

        if isinstance(unpack, MainRowReader) and reads_packed(unpack):  # v4 main rows: the kernel dequantizes them as it loads them
            return prefill_attention_triton(q, segments, prefix, sinks, scale, packed=unpack)
        if unpack is not None:  # another row format: dequantize what the kernel will read first
            segments = dense_segments(segments, unpack)
            if prefix is not None:
                prefix = (unpack(prefix[0]), prefix[1])
        return prefill_attention_triton(q, segments, prefix, sinks, scale)
    return prefill_attention_ref(q, segments, prefix, sinks, scale, tile, unpack)
