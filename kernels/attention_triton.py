"""Triton decode-time sparse attention: one query per batch row over gathered rows, with a per-head sink.

Same contract as `kernels.attention_ref.sparse_attention_ref`. Each program takes one batch row and
a block of heads; the keys are shared by all heads (V4 has one KV head, and keys are the values), so
one gathered block of rows serves every head of the block. The segments (hot-buffer slots, SWA
ring, HCA entries...) are walked one after the other under a single online softmax; the sink
starts the running maximum and the denominator, which is exactly "sink in the denominator only"
and also keeps the running maximum finite when a row has no valid key at all (output 0, as in the
reference).

Products are taken in fp32 with `input_precision="ieee"`: TF32 would cost about three decimal
digits against the reference, and decode attention is bound by the row gather, not the math.

Packed v4 rows (`kernels.kv_format`: e4m3 nope bytes, bf16 rope, UE8M0 scales per 64) are read as
bytes and dequantized as they are loaded (`PACKED_NOPE` > 0): e4m3 and bf16 are decoded with integer
operations, which are exact, so the kernel sees the values the torch reference's `unpack` gives.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_SEGMENTS = 3


@triton.jit
def _load_packed(pool_ptr, rows, ok, row_bytes, offs_d, in_d, NOPE: tl.constexpr, SCALE_OFF: tl.constexpr):
    """Rows [BLOCK_L] of packed v4 bytes -> fp32 values [BLOCK_L, BLOCK_D] (0 where masked)."""
    base = pool_ptr + rows[:, None].to(tl.int64) * row_bytes  # [BLOCK_L, 1]
    live = ok[:, None] & in_d[None, :]
    is_nope = (offs_d < NOPE)[None, :]
    byte = tl.load(base + offs_d[None, :], mask=live & is_nope, other=0).to(tl.int32)
    e = (byte >> 3) & 15
    man = (byte & 7).to(tl.float32)
    # e4m3: (1 + m/8) * 2**(e - 7) = (8 + m) * 2**(e - 10); subnormal (e = 0): m * 2**-9
    mag = tl.where(e == 0, man * 0.001953125, (8.0 + man) * tl.exp2((e - 10).to(tl.float32)))
    val = tl.where((byte & 0x80) != 0, -mag, mag)
    sbyte = tl.load(base + SCALE_OFF + offs_d[None, :] // 64, mask=live & is_nope, other=127).to(tl.float32)
    nope = val * tl.exp2(sbyte - 127.0)
    r = tl.where(offs_d >= NOPE, offs_d - NOPE, 0)  # rope channel index
    rmask = live & ~is_nope
    lo = tl.load(base + NOPE + 2 * r[None, :], mask=rmask, other=0).to(tl.int32)
    hi = tl.load(base + NOPE + 2 * r[None, :] + 1, mask=rmask, other=0).to(tl.int32)
    rope = ((hi << 24) | (lo << 16)).to(tl.float32, bitcast=True)  # bf16 bits in the top half of an fp32
    return tl.where(is_nope, nope, rope)


@triton.jit
def _fold_rows(q, m, denom, acc, pool_ptr, rows, ok, pool_stride_row, pool_stride_d, offs_d, in_d, scale,
               PACKED_NOPE: tl.constexpr, SCALE_OFF: tl.constexpr):
    """Load pool rows `rows` [BLOCK_L] (where `ok`) and fold them into the running (max, denominator,
    numerator) of every head; every segment and prefix loop of the attention kernels calls this."""
    if PACKED_NOPE > 0:
        kv = _load_packed(pool_ptr, rows, ok, pool_stride_row, offs_d, in_d, PACKED_NOPE, SCALE_OFF)
    else:
        kv = tl.load(
            pool_ptr + rows[:, None] * pool_stride_row + offs_d[None, :] * pool_stride_d,
            mask=ok[:, None] & in_d[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_L, BLOCK_D]
    s = tl.dot(q, tl.trans(kv), input_precision="ieee") * scale  # [BLOCK_H, BLOCK_L]
    s = tl.where(ok[None, :], s, float("-inf"))
    # m starts at the sink logit, so it is finite and a fully masked block gives p == 0, not NaN.
    m_new = tl.maximum(m, tl.max(s, axis=1))  # [BLOCK_H]
    alpha = tl.exp(m - m_new)  # [BLOCK_H]
    p = tl.exp(s - m_new[:, None])  # [BLOCK_H, BLOCK_L]
    denom = denom * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p, kv, input_precision="ieee")  # [BLOCK_H, BLOCK_D]
    return m_new, denom, acc


@triton.jit
def _attend_segment(
    q,
    m,
    denom,
    acc,
    pool_ptr,
    pool_stride_row,
    pool_stride_d,
    rows_ptr,
    rows_stride_b,
    rows_stride_j,
    seg_len,
    b,
    offs_d,
    in_d,
    scale,
    BLOCK_L: tl.constexpr,
    PACKED_NOPE: tl.constexpr,
    SCALE_OFF: tl.constexpr,
):
    """Fold `pool[rows[b, :seg_len]]` into the running (max, denominator, numerator) of every head."""
    offs_l = tl.arange(0, BLOCK_L)
    for start in range(0, seg_len, BLOCK_L):
        in_l = start + offs_l < seg_len
        rows = tl.load(rows_ptr + b * rows_stride_b + (start + offs_l) * rows_stride_j, mask=in_l, other=-1)  # [BLOCK_L]
        m, denom, acc = _fold_rows(q, m, denom, acc, pool_ptr, rows, rows >= 0, pool_stride_row, pool_stride_d,
                                   offs_d, in_d, scale, PACKED_NOPE, SCALE_OFF)
    return m, denom, acc


@triton.jit
def _sparse_attention_kernel(
    q_ptr,
    q_stride_b,
    q_stride_h,
    q_stride_d,
    out_ptr,
    out_stride_b,
    out_stride_h,
    out_stride_d,
    sinks_ptr,
    pool0_ptr,
    pool0_stride_row,
    pool0_stride_d,
    rows0_ptr,
    rows0_stride_b,
    rows0_stride_j,
    len0,
    pool1_ptr,
    pool1_stride_row,
    pool1_stride_d,
    rows1_ptr,
    rows1_stride_b,
    rows1_stride_j,
    len1,
    pool2_ptr,
    pool2_stride_row,
    pool2_stride_d,
    rows2_ptr,
    rows2_stride_b,
    rows2_stride_j,
    len2,
    heads,
    dim,
    scale,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_L: tl.constexpr,
    PACKED_NOPE: tl.constexpr,
    SCALE_OFF: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_h = offs_h < heads
    offs_d = tl.arange(0, BLOCK_D)
    in_d = offs_d < dim
    q = tl.load(
        q_ptr + b * q_stride_b + offs_h[:, None] * q_stride_h + offs_d[None, :] * q_stride_d,
        mask=in_h[:, None] & in_d[None, :],
        other=0.0,
    ).to(tl.float32)  # [BLOCK_H, BLOCK_D]
    m = tl.load(sinks_ptr + offs_h, mask=in_h, other=0.0).to(tl.float32)  # [BLOCK_H]
    denom = tl.zeros([BLOCK_H], tl.float32) + 1.0  # exp(sink - m) with m == sink
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)

    m, denom, acc = _attend_segment(
        q,
        m,
        denom,
        acc,
        pool0_ptr,
        pool0_stride_row,
        pool0_stride_d,
        rows0_ptr,
        rows0_stride_b,
        rows0_stride_j,
        len0,
        b,
        offs_d,
        in_d,
        scale,
        BLOCK_L,
        PACKED_NOPE,
        SCALE_OFF,
    )
    m, denom, acc = _attend_segment(
        q,
        m,
        denom,
        acc,
        pool1_ptr,
        pool1_stride_row,
        pool1_stride_d,
        rows1_ptr,
        rows1_stride_b,
        rows1_stride_j,
        len1,
        b,
        offs_d,
        in_d,
        scale,
        BLOCK_L,
        PACKED_NOPE,
        SCALE_OFF,
    )
    m, denom, acc = _attend_segment(
        q,
        m,
        denom,
        acc,
        pool2_ptr,
        pool2_stride_row,
        pool2_stride_d,
        rows2_ptr,
        rows2_stride_b,
        rows2_stride_j,
        len2,
        b,
        offs_d,
        in_d,
        scale,
        BLOCK_L,
        PACKED_NOPE,
        SCALE_OFF,
    )

    out = acc / denom[:, None]  # [BLOCK_H, BLOCK_D]
    tl.store(
        out_ptr + b * out_stride_b + offs_h[:, None] * out_stride_h + offs_d[None, :] * out_stride_d,
        out.to(out_ptr.dtype.element_ty),
        mask=in_h[:, None] & in_d[None, :],
    )


def sparse_attention_triton(
    q: torch.Tensor, segments: list[tuple[torch.Tensor, torch.Tensor]], sinks: torch.Tensor, scale: float,
    packed=None,
) -> torch.Tensor:
    """Triton twin of `sparse_attention_ref`: q [batch, heads, dim] over `pool[rows]` of each segment -> [batch, heads, dim].

    `packed` (a `kernels.kv_format.MainRowReader`): the pools are uint8 v4 main rows, dequantized on load."""
    if not 1 <= len(segments) <= MAX_SEGMENTS:
        raise ValueError(f"expected 1..{MAX_SEGMENTS} segments, got {len(segments)}")
    batch, heads, dim = q.shape
    if packed is not None and packed.head_dim != dim:
        raise ValueError(f"packed rows of {packed.head_dim} channels do not fit q {tuple(q.shape)}")
    for pool, rows in segments:
        ok_pool = (pool.dtype == torch.uint8 and pool.stride(1) == 1) if packed is not None else pool.shape[1] == dim
        if pool.dim() != 2 or not ok_pool or rows.dim() != 2 or rows.shape[0] != batch:
            raise ValueError(f"segment pool {tuple(pool.shape)} / rows {tuple(rows.shape)} do not fit q {tuple(q.shape)}")
    out = torch.empty_like(q)  # [batch, heads, dim]
    if batch == 0 or heads == 0:
        return out
    # Missing segments are length 0, so the kernel has one shape whatever the caller passes.
    padded = list(segments) + [segments[0]] * (MAX_SEGMENTS - len(segments))
    lengths = [rows.shape[1] for _, rows in segments] + [0] * (MAX_SEGMENTS - len(segments))
    seg_args = []
    for (pool, rows), seg_len in zip(padded, lengths):
        seg_args += [pool, pool.stride(0), pool.stride(1), rows, rows.stride(0), rows.stride(1), seg_len]
    # tl.dot wants every block dimension to be at least 16; wide rows get fewer heads per program so the
    # fp32 accumulator [BLOCK_H, BLOCK_D] stays in registers.
    block_d = max(16, triton.next_power_of_2(dim))
    block_h = max(16, min(triton.next_power_of_2(heads), 64 if block_d <= 128 else 16))
    block_l = 32 if block_d <= 256 else 16
    grid = (batch, triton.cdiv(heads, block_h))
    _sparse_attention_kernel[grid](
        q,
        *q.stride(),
        out,
        *out.stride(),
        sinks.contiguous(),
        *seg_args,
        heads,
        dim,
        scale,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        BLOCK_L=block_l,
        PACKED_NOPE=packed.nope if packed is not None else 0,
        SCALE_OFF=packed.scale_offset if packed is not None else 0,
        num_warps=4 if block_d <= 128 else 8,
    )
    return out
