"""Dispatcher for writing device rows into the host pool: Triton on CUDA, the torch reference elsewhere."""

from __future__ import annotations

import torch

from core import device
from kernels.host_write_ref import write_rows_ref


def write_rows(pool: torch.Tensor, layer: int, rows: torch.Tensor, values: torch.Tensor) -> None:
    """pool[layer, rows[i]] = values[i] for a host pool [layers, rows_total, dim] (see `kernels.host_write_ref`)."""
    if values.is_cuda and device.current().use_triton:
        from kernels.host_write_triton import write_rows_triton

        write_rows_triton(pool, layer, rows, values)
        return
    write_rows_ref(pool, layer, rows, values)
