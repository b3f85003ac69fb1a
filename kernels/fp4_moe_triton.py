"""Triton grouped matmul over MXFP4 experts: out[p] = a[rows[p]] @ dequant(W[experts[p]])^T.

Same contract as `kernels.fp4_moe_ref.fp4_expert_matmul_ref`. Pairs are first grouped by expert into
BLOCK_M-row blocks (`kernels.moe_align`, static shapes); one program takes one block and BLOCK_N outputs
of that block's expert, gathers its activation rows, and walks the input axis in BLOCK_K steps. Each step
loads BLOCK_K/2 packed bytes per output row, splits them into e2m1 codes (even input in the low nibble),
decodes the codes and their UE8M0 scales in registers, and multiplies. Every e2m1 value times a power of
two is exact in bf16, so the bf16 dot sees the same weights as the reference; fp32 activations use an
IEEE fp32 dot. Blocks without an expert (padding past the routed pairs) do nothing, and outputs of pairs
without an expert stay 0.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.formats import FP4_BLOCK
from kernels.moe_align import expert_blocks

# Triton 3.9's interpreter multiplies bf16 dot operands as their raw 16-bit patterns, so under it
# 16-bit activations take the fp32 dot (exact for e4m3/e2m1 weights); compiled kernels use the bf16 MMA.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _decode_e2m1(codes):
    """int32 codes 0..15 -> fp32 values: sign bit 3, exponent bits 1-2, mantissa bit 0 (no bias tricks)."""
    mag = codes & 7
    exp = mag >> 1
    half = (mag & 1).to(tl.float32) * 0.5
    pow2 = (1 << tl.maximum(exp - 1, 0)).to(tl.float32)  # 1, 1, 2, 4 for exponents 0..3
    val = tl.where(exp == 0, half, pow2 * (1.0 + half))
    return tl.where((codes & 8) != 0, -val, val)


@triton.jit
def _decode_e8m0(byte):
    """UE8M0 bytes -> fp32 2**(b - 127), built from bits: b = 0 is the subnormal 2**-127, b = 255 is NaN."""
    b = byte.to(tl.int32)
    bits = tl.where(b == 0, 0x00400000, tl.where(b == 255, 0x7FC00000, b << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _fp4_expert_kernel(
    a_ptr, a_stride_m, a_stride_k,
    rows_ptr, slot_pair_ptr, block_expert_ptr,
    w_ptr, w_stride_e, w_stride_n, w_stride_k,
    s_ptr, s_stride_e, s_stride_n, s_stride_k,
    out_ptr, out_stride_p, out_stride_n,
    N, K,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    COMPUTE_BF16: tl.constexpr,
):  # fmt: skip
    blk, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + blk)
    if expert >= 0:
        pair = tl.load(slot_pair_ptr + blk * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M], -1 = padding
        in_m = pair >= 0
        a_row = tl.load(rows_ptr + pair, mask=in_m, other=0)  # [BLOCK_M]
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        in_n = offs_n < N
        offs_b = tl.arange(0, BLOCK_K // 2)  # packed bytes of one step
        offs_g = tl.arange(0, BLOCK_K // GROUP)  # scale groups of one step
        offs_k = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + expert.to(tl.int64) * w_stride_e + offs_n[:, None].to(tl.int64) * w_stride_n
        s_rows = s_ptr + expert.to(tl.int64) * s_stride_e + offs_n[:, None].to(tl.int64) * s_stride_n
        a_rows = a_ptr + a_row[:, None].to(tl.int64) * a_stride_m
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            a = tl.load(a_rows + kk[None, :] * a_stride_k, mask=in_m[:, None] & (kk[None, :] < K), other=0.0)
            kb = k0 // 2 + offs_b
            packed = tl.load(w_rows + kb[None, :] * w_stride_k, mask=in_n[:, None] & (kb[None, :] < K // 2), other=0)
            packed = packed.to(tl.uint8, bitcast=True).to(tl.int32)  # [BLOCK_N, BLOCK_K/2]
            codes = tl.interleave(packed & 0xF, packed >> 4)  # [BLOCK_N, BLOCK_K], even inputs from the low nibble
            kg = k0 // GROUP + offs_g
            sbyte = tl.load(s_rows + kg[None, :] * s_stride_k, mask=in_n[:, None] & (kg[None, :] < tl.cdiv(K, GROUP)), other=127)
            scale = _decode_e8m0(sbyte)  # [BLOCK_N, BLOCK_K/GROUP]
            w = tl.reshape(_decode_e2m1(codes), (BLOCK_N, BLOCK_K // GROUP, GROUP)) * scale[:, :, None]
            w = tl.reshape(w, (BLOCK_N, BLOCK_K))
            if COMPUTE_BF16:
                acc += tl.dot(a.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
            else:
                acc += tl.dot(a.to(tl.float32), tl.trans(w), input_precision="ieee")
        out = out_ptr + pair[:, None].to(tl.int64) * out_stride_p + offs_n[None, :] * out_stride_n
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])


def _block_m(pairs: int, num_experts: int) -> int:
    """Rows per block: decode batches put a few pairs on each expert, so small blocks waste little."""
    per_expert = pairs / max(num_experts, 1)
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def fp4_expert_matmul_triton(
    a: torch.Tensor, rows: torch.Tensor, experts: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
    block_n: int = 64, block_k: int = 64,
) -> torch.Tensor:  # fmt: skip
    """Same contract as `fp4_expert_matmul_ref`."""
    num_experts, n, half_k = weight.shape
    k = a.shape[1]
    if k != 2 * half_k:
        raise ValueError(f"activations have {k} inputs but the packed experts hold {2 * half_k}")
    if block_k % FP4_BLOCK:
        raise ValueError(f"BLOCK_K={block_k} must be a multiple of the {FP4_BLOCK}-wide scale group")
    pairs = rows.shape[0]
    block_m = _block_m(pairs, num_experts)
    slot_pair, block_expert = expert_blocks(experts, num_experts, block_m)
    out = torch.zeros(pairs, n, dtype=a.dtype, device=a.device)  # pairs without an expert stay 0
    grid = (block_expert.shape[0], triton.cdiv(n, block_n))
    _fp4_expert_kernel[grid](
        a, a.stride(0), a.stride(1),
        rows, slot_pair, block_expert,
        weight, weight.stride(0), weight.stride(1), weight.stride(2),
        scale, scale.stride(0), scale.stride(1), scale.stride(2),
        out, out.stride(0), out.stride(1),
        n, k,
        GROUP=FP4_BLOCK, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        COMPUTE_BF16=a.dtype in (torch.bfloat16, torch.float16) and not _INTERPRETED,
    )  # fmt: skip
    return out
