"""Triton host-pool write: device rows stored straight into pinned host memory, with no host sync.

Same contract as `kernels.host_write_ref.write_rows_ref`. The pool stays a *pinned* CPU tensor and
the kernel stores through its pointer (unified virtual addressing maps a pinned allocation into
the device's address space), so a decode step that emits C4 entries writes their host copies from
inside a CUDA graph: no `.cpu()`, no staging buffer, no synchronisation. One program per row; a
pageable pool has no device mapping and is refused before launch. Under `TRITON_INTERPRET=1`
every tensor is an ordinary CPU tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_rows_kernel(
    pool_ptr,
    pool_stride_row,
    pool_stride_d,
    rows_ptr,
    values_ptr,
    values_stride_n,
    values_stride_d,
    dim,
    BLOCK_D: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + n)
    offs = tl.arange(0, BLOCK_D)
    for d0 in range(0, dim, BLOCK_D):
        in_d = d0 + offs < dim
        vals = tl.load(values_ptr + n * values_stride_n + (d0 + offs) * values_stride_d, mask=in_d)  # [BLOCK_D]
        tl.store(pool_ptr + row * pool_stride_row + (d0 + offs) * pool_stride_d, vals.to(pool_ptr.dtype.element_ty), mask=in_d)


def write_rows_triton(pool: torch.Tensor, layer: int, rows: torch.Tensor, values: torch.Tensor) -> None:
    """Triton twin of `write_rows_ref`: pool[layer, rows[i]] = values[i]."""
    # (checked when not capturing: a CUDA graph capture allows no pointer queries)
    if values.is_cuda and not pool.is_cuda and not torch.cuda.is_current_stream_capturing() and not pool.is_pinned():
        raise ValueError("the host pool must be pinned (or on the device) for the kernel to write it through UVA")
    n, dim = values.shape
    if n == 0:
        return
    target = pool[layer]  # [rows_total, dim]; only its pointer and strides go to the kernel
    _write_rows_kernel[(n,)](
        target,
        target.stride(0),
        target.stride(1),
        rows.contiguous(),
        values,
        values.stride(0),
        values.stride(1),
        dim,
        BLOCK_D=min(triton.next_power_of_2(dim), 256),
    )
