"""Dispatcher for the decode indexer (stored keys in, top-k entry ids out): Triton on CUDA, the torch reference elsewhere."""

from __future__ import annotations

import torch

from core import device
from kernels.index_topk_ref import PagedKeys, index_topk_ref


def index_topk(q: torch.Tensor, w: torch.Tensor, keys: PagedKeys, topk: int) -> torch.Tensor:
    """One CSA layer's selection for a decode step (`kernels.index_topk_ref.index_topk_ref` is the contract):
    q [rows, heads, dim] in the keys' space, w [rows, heads] fp32 -> ids [rows, min(topk, gather length)]."""
    if q.is_cuda and keys.pool.is_cuda and device.current().use_triton:
        # Imported here so that the CPU path never needs triton installed.
        from kernels.index_topk_triton import index_topk_triton

        return index_topk_triton(q, w, keys, topk)
    return index_topk_ref(q, w, keys, topk)
