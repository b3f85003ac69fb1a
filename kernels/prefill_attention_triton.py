"""Triton prefill sparse attention: the decode kernel's per-row program, one program per query.

Same contract as `kernels.prefill_attention_ref.prefill_attention_ref`. A program takes one query
and a block of heads, walks its gathered segments (sliding window, selected C4 entries) with the
decode kernel's `_attend_segment`, then its prefix of the HCA entries (rows 0..count-1, no row
list at all) with `_attend_prefix`, all under one online softmax that starts at the sink. Nothing
of size queries x entries is ever materialised: the prefix is streamed `BLOCK_L` rows at a time.
Packed v4 rows are dequantized as they are loaded, as in the decode kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention_triton import _attend_segment, _fold_rows, packed_pool_error, reads_packed

MAX_SEGMENTS = 2


@triton.jit
def _attend_prefix(
    q,
    m,
    denom,
    acc,
    pool_ptr,
    pool_stride_row,
    pool_stride_d,
    count,
    offs_d,
    in_d,
    scale,
    BLOCK_L: tl.constexpr,
    PACKED_NOPE: tl.constexpr,
    SCALE_OFF: tl.constexpr,
):
    """Fold `pool[0:count]` into the running (max, denominator, numerator) of every head."""
    offs_l = tl.arange(0, BLOCK_L)
    for start in range(0, count, BLOCK_L):
        rows = (start + offs_l).to(tl.int64)
        m, denom, acc = _fold_rows(q, m, denom, acc, pool_ptr, rows, rows < count, pool_stride_row, pool_stride_d,
                                   offs_d, in_d, scale, PACKED_NOPE, SCALE_OFF)
    return m, denom, acc


@triton.jit
def _prefill_attention_kernel(
    q_ptr,
    q_stride_t,
    q_stride_h,
    q_stride_d,
    out_ptr,
    out_stride_t,
    out_stride_h,
    out_stride_d,
    sinks_ptr,
    pool0_ptr,
    pool0_stride_row,
    pool0_stride_d,
    rows0_ptr,
    rows0_stride_t,
    rows0_stride_j,
    len0,
    pool1_ptr,
    pool1_stride_row,
    pool1_stride_d,
    rows1_ptr,
    rows1_stride_t,
    rows1_stride_j,
    len1,
    prefix_ptr,
    prefix_stride_row,
    prefix_stride_d,
    counts_ptr,
    heads,
    dim,
    scale,
    HAS_PREFIX: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_L: tl.constexpr,
    PACKED_NOPE: tl.constexpr,
    SCALE_OFF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)  # the query
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_h = offs_h < heads
    offs_d = tl.arange(0, BLOCK_D)
    in_d = offs_d < dim
    q = tl.load(
        q_ptr + t * q_stride_t + offs_h[:, None] * q_stride_h + offs_d[None, :] * q_stride_d,
        mask=in_h[:, None] & in_d[None, :],
        other=0.0,
    ).to(tl.float32)  # [BLOCK_H, BLOCK_D]
    m = tl.load(sinks_ptr + offs_h, mask=in_h, other=0.0).to(tl.float32)  # [BLOCK_H]
    denom = tl.zeros([BLOCK_H], tl.float32) + 1.0  # exp(sink - m) with m == sink
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)

    m, denom, acc = _attend_segment(
        q, m, denom, acc, pool0_ptr, pool0_stride_row, pool0_stride_d, rows0_ptr, rows0_stride_t, rows0_stride_j, len0,
        t, offs_d, in_d, scale, BLOCK_L, PACKED_NOPE, SCALE_OFF,
    )
    m, denom, acc = _attend_segment(
        q, m, denom, acc, pool1_ptr, pool1_stride_row, pool1_stride_d, rows1_ptr, rows1_stride_t, rows1_stride_j, len1,
        t, offs_d, in_d, scale, BLOCK_L, PACKED_NOPE, SCALE_OFF,
    )
    if HAS_PREFIX:
        count = tl.load(counts_ptr + t)
        m, denom, acc = _attend_prefix(
            q, m, denom, acc, prefix_ptr, prefix_stride_row, prefix_stride_d, count, offs_d, in_d, scale, BLOCK_L,
            PACKED_NOPE, SCALE_OFF,
        )

    out = acc / denom[:, None]  # [BLOCK_H, BLOCK_D]
    tl.store(
        out_ptr + t * out_stride_t + offs_h[:, None] * out_stride_h + offs_d[None, :] * out_stride_d,
        out.to(out_ptr.dtype.element_ty),
        mask=in_h[:, None] & in_d[None, :],
    )


def prefill_attention_triton(
    q: torch.Tensor,
    segments: list[tuple[torch.Tensor, torch.Tensor]],
    prefix: tuple[torch.Tensor, torch.Tensor] | None,
    sinks: torch.Tensor,
    scale: float,
    packed=None,
) -> torch.Tensor:
    """Triton twin of `prefill_attention_ref` (the tile argument does not apply: rows stream in blocks).
    `packed` (a `kernels.kv_format.MainRowReader`): every pool holds uint8 v4 main rows, dequantized on load."""
    if not 1 <= len(segments) <= MAX_SEGMENTS:
        raise ValueError(f"expected 1..{MAX_SEGMENTS} gathered segments, got {len(segments)}")
    n_q, heads, dim = q.shape
    if packed is not None and (packed.head_dim != dim or not reads_packed(packed)):
        raise ValueError(f"packed rows of {packed.head_dim} / {packed.rope_dim} channels are not read in place for q {tuple(q.shape)}")

    def fits(pool: torch.Tensor) -> bool:
        if packed is not None:  # the decode kernel's loader reads rows on 8-byte boundaries
            return packed_pool_error(pool) is None
        return pool.dim() == 2 and pool.shape[1] == dim

    for pool, rows in segments:
        if not fits(pool) or rows.dim() != 2 or rows.shape[0] != n_q:
            raise ValueError(f"segment pool {tuple(pool.shape)} / rows {tuple(rows.shape)} do not fit q {tuple(q.shape)}")
    out = torch.empty_like(q)  # [queries, heads, dim]
    if n_q == 0 or heads == 0:
        return out
    padded = list(segments) + [segments[0]] * (MAX_SEGMENTS - len(segments))
    lengths = [rows.shape[1] for _, rows in segments] + [0] * (MAX_SEGMENTS - len(segments))
    seg_args = []
    for (pool, rows), seg_len in zip(padded, lengths):
        seg_args += [pool, pool.stride(0), pool.stride(1), rows, rows.stride(0), rows.stride(1), seg_len]
    if prefix is not None:
        pool, counts = prefix
        if not fits(pool) or counts.shape != (n_q,):
            raise ValueError(f"prefix pool {tuple(pool.shape)} / counts {tuple(counts.shape)} do not fit q {tuple(q.shape)}")
        prefix_args = [pool, pool.stride(0), pool.stride(1), counts.to(device=q.device, dtype=torch.int32)]
    else:
        prefix_args = [q, 0, 0, q]  # never read: HAS_PREFIX is off
    # The decode kernel's block rule: tl.dot wants blocks of at least 16; wide rows get fewer heads.
    block_d = max(16, triton.next_power_of_2(dim))
    block_h = max(16, min(triton.next_power_of_2(heads), 64 if block_d <= 128 else 16))
    block_l = 32 if block_d <= 256 else 16
    grid = (n_q, triton.cdiv(heads, block_h))
    _prefill_attention_kernel[grid](
        q,
        *q.stride(),
        out,
        *out.stride(),
        sinks.contiguous(),
        *seg_args,
        *prefix_args,
        heads,
        dim,
        scale,
        HAS_PREFIX=prefix is not None,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        BLOCK_L=block_l,
        PACKED_NOPE=packed.nope if packed is not None else 0,
        SCALE_OFF=packed.scale_offset if packed is not None else 0,
        num_warps=4 if block_d <= 128 else 8,
    )
    return out
