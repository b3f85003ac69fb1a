"""Dispatcher for the hot-buffer resolve: Triton on CUDA, the torch reference elsewhere."""

from __future__ import annotations

import torch

from core import device
from kernels.resolve_ref import resolve_ref


def resolve(
    ids: torch.Tensor,
    map_rows: torch.Tensor,
    host_rows: torch.Tensor,
    books: torch.Tensor,
    hot_rows: torch.Tensor,
    entry_map: torch.Tensor,
    kv_pool: torch.Tensor,
    hot_entry_row: torch.Tensor,
    hot_stamp: torch.Tensor,
    host_pool: torch.Tensor,
    step: torch.Tensor,
    counters: torch.Tensor,
) -> torch.Tensor:
    """Resolve selected entries to hot-buffer slots (see `kernels.resolve_ref` for the policy); returns slots [batch, k]."""
    args = (ids, map_rows, host_rows, books, hot_rows, entry_map, kv_pool, hot_entry_row, hot_stamp, host_pool, step, counters)
    if kv_pool.is_cuda and entry_map.is_cuda and device.current().use_triton:
        # Imported here so that the CPU path never needs triton installed.
        from kernels.resolve_triton import resolve_triton

        return resolve_triton(*args)
    return resolve_ref(*args)
