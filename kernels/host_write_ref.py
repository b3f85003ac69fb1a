"""Torch reference of writing rows into the host pool (the CPU path, and the spec of the Triton kernel).

Decode emits new C4 entries on the device; their authoritative copy goes to the host pool. The
pool is [layers, rows, dim]; `rows` and `values` come from the step. The write goes into the pool
tensor itself with one `index_put_` (not through a per-layer view), so under `torch.compile` it
happens in place.
"""

from __future__ import annotations

import torch


def write_rows_ref(pool: torch.Tensor, layer: int, rows: torch.Tensor, values: torch.Tensor) -> None:
    """pool[layer, rows[i]] = values[i]; pool [layers, rows_total, dim], rows [n] int64, values [n, dim]."""
    rows = rows.to(pool.device)
    pool.index_put_((torch.full_like(rows, layer), rows), values.to(pool.device, pool.dtype))
