"""Triton block-scaled FP8 linear: W8A16 (weights e4m3, activations bf16/fp16/fp32) and W8A8.

Same contracts as `kernels.fp8_linear_ref`. One program computes a [BLOCK_M, BLOCK_N] output tile of one
group and walks the input axis in BLOCK_K steps. BLOCK_K divides the 128-wide scale tile, so every step
reads one scale per output row (`row // 128`) and scales the step's partial product before adding it to
the fp32 accumulator:

- W8A16: the e4m3 tile is widened to the activations' compute type (bf16 holds every e4m3 value exactly;
  fp32 activations use an IEEE fp32 dot so the result matches the reference up to summation order);
- W8A8: both tiles stay e4m3 (a native FP8 MMA on Hopper and later) and the product is scaled by the
  token's group scale and the weight tile's scale.

Partial tiles (a dimension that is not a multiple of 128) are masked loads; the scale of a partial tile
is read like any other. Scales arrive as fp32 (UE8M0 bytes are decoded once at load time).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.formats import FP8_BLOCK

# Triton 3.9's interpreter multiplies bf16 dot operands as their raw 16-bit patterns, so under it
# 16-bit activations take the fp32 dot (exact for e4m3/e2m1 weights); compiled kernels use the bf16 MMA.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _fp8_linear_kernel(
    x_ptr, x_stride_m, x_stride_g, x_stride_k,
    w_ptr, w_stride_g, w_stride_n, w_stride_k,
    s_ptr, s_stride_g, s_stride_n, s_stride_k,
    xs_ptr, xs_stride_m, xs_stride_k,
    out_ptr, out_stride_m, out_stride_g, out_stride_n,
    M, N, K,
    SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ACT_FP8: tl.constexpr,
    COMPUTE_BF16: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n, g = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_m, in_n = offs_m < M, offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + g * x_stride_g + offs_m[:, None].to(tl.int64) * x_stride_m  # [BLOCK_M, 1]
    w_rows = w_ptr + g * w_stride_g + offs_n[:, None].to(tl.int64) * w_stride_n  # [BLOCK_N, 1]
    s_rows = s_ptr + g * s_stride_g + (offs_n // SCALE_BLOCK) * s_stride_n  # [BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        in_k = kk < K
        x = tl.load(x_rows + kk[None, :] * x_stride_k, mask=in_m[:, None] & in_k[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_rows + kk[None, :] * w_stride_k, mask=in_n[:, None] & in_k[None, :], other=0.0)  # [BLOCK_N, BLOCK_K] e4m3
        kb = k0 // SCALE_BLOCK
        w_scale = tl.load(s_rows + kb * s_stride_k, mask=in_n, other=0.0)  # [BLOCK_N]
        if ACT_FP8:
            x_scale = tl.load(xs_ptr + offs_m * xs_stride_m + kb * xs_stride_k, mask=in_m, other=0.0)  # [BLOCK_M]
            part = tl.dot(x, tl.trans(w))
            acc += part * x_scale[:, None] * w_scale[None, :]
        elif COMPUTE_BF16:
            part = tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
            acc += part * w_scale[None, :]
        else:
            part = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            acc += part * w_scale[None, :]
    out = out_ptr + g * out_stride_g + offs_m[:, None].to(tl.int64) * out_stride_m + offs_n[None, :] * out_stride_n
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])


def _block_m(m: int) -> int:
    """Row tile: small for decode batches (no wasted rows), 64 for prefill."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


def _launch(x3, w3, s3, xs, out3, act_fp8: bool, block_n: int = 64, block_k: int = 64) -> None:
    """x3 [M, G, K], w3 [G, N, K], s3 [G, ceil(N/128), ceil(K/128)], out3 [M, G, N]."""
    m, groups, k = x3.shape
    n = w3.shape[1]
    if FP8_BLOCK % block_k:
        raise ValueError(f"BLOCK_K={block_k} must divide the {FP8_BLOCK}-wide scale tile")
    if xs is None:
        xs, xs_strides = s3, (0, 0)  # unused when ACT_FP8 is off
    else:
        xs_strides = (xs.stride(0), xs.stride(1))
    block_m = _block_m(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), groups)
    _fp8_linear_kernel[grid](
        x3, x3.stride(0), x3.stride(1), x3.stride(2),
        w3, w3.stride(0), w3.stride(1), w3.stride(2),
        s3, s3.stride(0), s3.stride(1), s3.stride(2),
        xs, *xs_strides,
        out3, out3.stride(0), out3.stride(1), out3.stride(2),
        m, n, k,
        SCALE_BLOCK=FP8_BLOCK, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        ACT_FP8=act_fp8, COMPUTE_BF16=x3.dtype in (torch.bfloat16, torch.float16) and not _INTERPRETED,
    )  # fmt: skip


def fp8_linear_triton(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W8A16 linear; same contract as `fp8_linear_ref`."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    out = torch.empty(x2.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    _launch(x2[:, None], weight[None], scale.float()[None], None, out[:, None], act_fp8=False)
    return out.reshape(*lead, weight.shape[0])


def fp8_linear_w8a8_triton(
    xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """W8A8 linear; same contract as `fp8_linear_w8a8_ref`."""
    out = torch.empty(xq.shape[0], weight.shape[0], dtype=out_dtype, device=xq.device)
    _launch(xq[:, None], weight[None], scale.float()[None], x_scale.float(), out[:, None], act_fp8=True)
    return out


def fp8_grouped_linear_triton(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Grouped projection, one launch for all groups; same contract as `fp8_grouped_linear_ref`."""
    *lead, groups, k = x.shape
    n = weight.shape[0] // groups
    if n % FP8_BLOCK:
        raise ValueError(f"a group of {n} rows does not end on a {FP8_BLOCK}-row scale tile")
    x3 = x.reshape(-1, groups, k)
    out = torch.empty(x3.shape[0], groups, n, dtype=x.dtype, device=x.device)
    w3 = weight.view(groups, n, k)
    s3 = scale.float().view(groups, n // FP8_BLOCK, scale.shape[1])
    _launch(x3, w3, s3, None, out, act_fp8=False)
    return out.reshape(*lead, groups, n)
