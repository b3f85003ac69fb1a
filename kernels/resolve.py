"""Dispatcher for the hot-buffer resolve: Triton on CUDA, the torch reference elsewhere."""

from __future__ import annotations

import torch

from core import device
from kernels.resolve_ref import HotState, resolve_ref


def resolve(
    ids: torch.Tensor,
    map_rows: torch.Tensor,
    host_rows: torch.Tensor,
    books: torch.Tensor,
    hot_rows: torch.Tensor,
    kv_pool: torch.Tensor,
    state: HotState,
    victim_slots: int | None = None,
) -> torch.Tensor:
    """Resolve selected entries to hot-buffer slots (see `kernels.resolve_ref` for the policy); returns slots [batch, k]."""
    if kv_pool.is_cuda and state.entry_map.is_cuda and device.current().use_triton:
        # Imported here so that the CPU path never needs triton installed.
        from kernels.resolve_triton import resolve_triton

        return resolve_triton(ids, map_rows, host_rows, books, hot_rows, kv_pool, state, victim_slots)
    return resolve_ref(ids, map_rows, host_rows, books, hot_rows, kv_pool, state, victim_slots)
