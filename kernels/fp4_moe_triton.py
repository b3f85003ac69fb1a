"""Triton grouped matmul over MXFP4 experts: out[p] = a[rows[p]] @ dequant(W[experts[p]])^T.

Same contract as `kernels.fp4_moe_ref.fp4_expert_matmul_ref`. Pairs are first grouped by expert into
BLOCK_M-row blocks (`kernels.moe_align`, static shapes; the block size follows the expected rows per expert,
`moe_align.block_m`); one program takes one block and BLOCK_N outputs of that block's expert, gathers its
activation rows, and walks the input axis in BLOCK_K steps. Blocks without an expert (padding past the routed
pairs) do nothing, and outputs of pairs without an expert stay 0.

Two ways to multiply a step:

- Decoded in registers (Hopper and older, and every fp32/fp16 activation): each step loads BLOCK_K/2 packed
  bytes per output row. The low nibbles are the even inputs and the high nibbles the odd ones, so instead of
  interleaving the nibbles back into input order the step runs two dots, even activations against low
  nibbles and odd against high. A nibble becomes its fp32 value from its bits in a few integer ops
  (`_e2m1_value`), times its UE8M0 scale. Every e2m1 value times a power of two is exact in bf16, so the
  bf16 dot sees the same weights as the reference; fp32 activations use an IEEE fp32 dot.
- `tl.dot_scaled` (bf16 activations on compute capability 10+, `native_fp4`): the packed bytes and the scale
  bytes go to the dot as they are, and Triton's Blackwell lowering does the decoding.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kernels.formats import FP4_BLOCK
from kernels.moe_align import BLOCK_M_SIZES, block_m, expert_blocks

# Triton 3.9's interpreter multiplies bf16 dot operands as their raw 16-bit patterns, so under it
# 16-bit activations take the fp32 dot (exact for e4m3/e2m1 weights); compiled kernels use the bf16 MMA.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

NATIVE_FP4_MAJOR = 10
"""The first CUDA compute capability (Blackwell) whose tensor cores take MXFP4 operands."""


@triton.jit
def _e2m1_value(mag, sign):
    """One e2m1 code's fp32 value, exact: `mag` its three magnitude bits (exponent e, mantissa m) as uint32
    0..7, `sign` its sign bit already moved to bit 31 (uint32 0 or 0x80000000).

    Under an fp32 exponent bias of 126, (e, m) reads as u = 2**(e-1) * (1 + m/2), which is the e2m1 value for
    e >= 1. For e = 0 (codes 0 and 1) it reads 0.5 and 0.75 where the values are 0 and 0.5: 2u - 1 gives
    those, and 2u - 1 >= u whenever u >= 1, so min(u, 2u - 1) is right for all eight. No table, no branch,
    and no subnormal anywhere (a flush-to-zero unit decodes it the same).

    Per weight, with the caller's scale: mask out the three bits and shift them (2), add the bias (1), fma
    and min (2), shift and mask the sign bit and or it in (2-3), multiply by the scale (1), and for bf16
    half a pack-convert: about 9 instructions. Compiled for sm_90 at 16-row blocks (`bench.fp4_moe_sass`)
    the bf16 K loop is 17.2 instructions per weight, loads, shared-memory staging and MMAs included; the
    arithmetic decoder this replaced (exponent and mantissa as floats, a power of two built by a shift, two
    selects, a negation, the nibbles interleaved back into input order) made it 30.9.
    """
    u = ((mag << 22) + 0x3F000000).to(tl.float32, bitcast=True)  # 0.5, 0.75, 1, 1.5, 2, 3, 4, 6
    value = tl.minimum(u, 2.0 * u - 1.0)  # 0, 0.5, 1, 1.5, 2, 3, 4, 6
    return (value.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_pair(packed):
    """uint32 bytes 0..255 -> (value of the low nibble, value of the high nibble), fp32, same shape."""
    low = _e2m1_value(packed & 7, (packed << 28) & 0x80000000)
    high = _e2m1_value((packed >> 4) & 7, (packed << 24) & 0x80000000)
    return low, high


@triton.jit
def _decode_e8m0(byte):
    """UE8M0 bytes -> fp32 2**(b - 127), built from bits: b = 0 is the subnormal 2**-127, b = 255 is NaN."""
    b = byte.to(tl.int32)
    bits = tl.where(b == 0, 0x00400000, tl.where(b == 255, 0x7FC00000, b << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _scaled(w, scale, GROUP: tl.constexpr):
    """w [BLOCK_N, bytes] (one nibble of each byte) times scale [BLOCK_N, bytes / (GROUP/2)]: GROUP inputs
    are GROUP/2 bytes."""
    n: tl.constexpr = w.shape[0]
    nbytes: tl.constexpr = w.shape[1]
    w = tl.reshape(w, (n, nbytes // (GROUP // 2), GROUP // 2)) * scale[:, :, None]
    return tl.reshape(w, (n, nbytes))


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
    NATIVE_FP4: tl.constexpr,
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
        w_rows = w_ptr + expert.to(tl.int64) * w_stride_e + offs_n[:, None].to(tl.int64) * w_stride_n
        s_rows = s_ptr + expert.to(tl.int64) * s_stride_e + offs_n[:, None].to(tl.int64) * s_stride_n
        a_rows = a_ptr + a_row[:, None].to(tl.int64) * a_stride_m
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kb = k0 // 2 + offs_b
            packed = tl.load(w_rows + kb[None, :] * w_stride_k, mask=in_n[:, None] & (kb[None, :] < K // 2), other=0)
            packed = packed.to(tl.uint8, bitcast=True)  # [BLOCK_N, BLOCK_K/2], even input in the low nibble
            kg = k0 // GROUP + offs_g
            sbyte = tl.load(s_rows + kg[None, :] * s_stride_k, mask=in_n[:, None] & (kg[None, :] < tl.cdiv(K, GROUP)), other=127)
            if NATIVE_FP4:
                kk = k0 + tl.arange(0, BLOCK_K)
                a = tl.load(a_rows + kk[None, :] * a_stride_k, mask=in_m[:, None] & (kk[None, :] < K), other=0.0)
                # rhs [BLOCK_K/2, BLOCK_N] packed along K, its scales [BLOCK_N, BLOCK_K/32] untransposed
                acc = tl.dot_scaled(a.to(tl.bfloat16), None, "bf16", tl.trans(packed), sbyte.to(tl.uint8), "e2m1", acc)
            else:
                ke = k0 + 2 * offs_b  # the step's even inputs; the odd ones are ke + 1 (K is even)
                in_k = in_m[:, None] & (ke[None, :] < K)
                a_even = tl.load(a_rows + ke[None, :] * a_stride_k, mask=in_k, other=0.0)  # [BLOCK_M, BLOCK_K/2]
                a_odd = tl.load(a_rows + (ke[None, :] + 1) * a_stride_k, mask=in_k, other=0.0)
                scale = _decode_e8m0(sbyte)  # [BLOCK_N, BLOCK_K/GROUP]
                low, high = _e2m1_pair(packed.to(tl.uint32))
                w_even = _scaled(low, scale, GROUP)  # [BLOCK_N, BLOCK_K/2]
                w_odd = _scaled(high, scale, GROUP)
                if COMPUTE_BF16:
                    acc = tl.dot(a_even.to(tl.bfloat16), tl.trans(w_even.to(tl.bfloat16)), acc)
                    acc = tl.dot(a_odd.to(tl.bfloat16), tl.trans(w_odd.to(tl.bfloat16)), acc)
                else:
                    acc = tl.dot(a_even.to(tl.float32), tl.trans(w_even), acc, input_precision="ieee")
                    acc = tl.dot(a_odd.to(tl.float32), tl.trans(w_odd), acc, input_precision="ieee")
        out = out_ptr + pair[:, None].to(tl.int64) * out_stride_p + offs_n[None, :] * out_stride_n
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])


def largest_block_m(dtype: torch.dtype) -> int:
    """The tallest row block worth compiling for these activations. The fp32 path's IEEE dot runs on CUDA
    cores, and at 64 rows its accumulator, decoded tile and activations no longer fit in registers: compiled
    for sm_90 (`bench.fp4_moe_sass`) its K loop spills and costs 229 instructions per weight against 60 at
    32 rows, 3.6 against 1.9 per weight and row. Tensor-core dots stay cheaper per row up to 64."""
    return 32 if dtype == torch.float32 else BLOCK_M_SIZES[-1]


@functools.cache
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def native_fp4(dev: torch.device) -> bool:
    """Whether `dev` multiplies MXFP4 operands in its tensor cores (compute capability 10 and later). Asked of
    the driver once per device and cached, so a captured step only reads a Python dict."""
    if dev.type != "cuda":
        return False
    return _capability_major(torch.cuda.current_device() if dev.index is None else dev.index) >= NATIVE_FP4_MAJOR


def fp4_expert_matmul_triton(
    a: torch.Tensor, rows: torch.Tensor, experts: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
    block_n: int = 64, block_k: int = 64, *, routed_experts: int | None = None, native: bool | None = None,
) -> torch.Tensor:  # fmt: skip
    """Same contract as `fp4_expert_matmul_ref`.

    `routed_experts`: how many experts the router picks from (default: the experts in `weight`; on an
    expert-parallel rank, every rank's), which sets the expected rows per expert and so the block size.
    `native`: multiply through `tl.dot_scaled` (default: bf16 activations on a `native_fp4` device).
    """
    num_experts, n, half_k = weight.shape
    k = a.shape[1]
    if k != 2 * half_k:
        raise ValueError(f"activations have {k} inputs but the packed experts hold {2 * half_k}")
    if block_k % FP4_BLOCK:
        raise ValueError(f"BLOCK_K={block_k} must be a multiple of the {FP4_BLOCK}-wide scale group")
    routed = num_experts if routed_experts is None else routed_experts
    if routed < num_experts:
        raise ValueError(f"the router picks from {routed} experts, fewer than the {num_experts} held here")
    if native is None:
        native = a.dtype == torch.bfloat16 and native_fp4(a.device)
    elif native and a.dtype != torch.bfloat16:
        raise ValueError(f"the dot_scaled path multiplies bf16 activations, not {a.dtype}")
    pairs = rows.shape[0]
    bm = block_m(pairs, routed, largest_block_m(a.dtype))
    slot_pair, block_expert = expert_blocks(experts, num_experts, bm)
    out = torch.zeros(pairs, n, dtype=a.dtype, device=a.device)  # pairs without an expert stay 0
    grid = (block_expert.shape[0], triton.cdiv(n, block_n))
    _fp4_expert_kernel[grid](
        a, a.stride(0), a.stride(1),
        rows, slot_pair, block_expert,
        weight, weight.stride(0), weight.stride(1), weight.stride(2),
        scale, scale.stride(0), scale.stride(1), scale.stride(2),
        out, out.stride(0), out.stride(1),
        n, k,
        GROUP=FP4_BLOCK, BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k,
        COMPUTE_BF16=a.dtype in (torch.bfloat16, torch.float16) and not _INTERPRETED,
        NATIVE_FP4=native,
    )  # fmt: skip
    return out
