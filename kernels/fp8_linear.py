"""Dispatcher for the block-scaled FP8 linear: Triton on CUDA, the torch reference elsewhere."""

from __future__ import annotations

import torch

from core import device
from kernels.formats import quantize_act_fp8
from kernels.fp8_linear_ref import fp8_grouped_linear_ref, fp8_linear_ref, fp8_linear_w8a8_ref


def _triton(x: torch.Tensor) -> bool:
    return device.current().use_triton and x.is_cuda


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, act_fp8: bool = False) -> torch.Tensor:
    """x [..., in] @ dequant(weight, scale)^T -> [..., out] in x's dtype.

    `act_fp8` quantizes the activations per token and 128-wide group to e4m3 first (W8A8), which changes
    the numerics; the default keeps them as they are (W8A16).
    """
    if not act_fp8:
        if _triton(x):
            from kernels.fp8_linear_triton import fp8_linear_triton

            return fp8_linear_triton(x, weight, scale)
        return fp8_linear_ref(x, weight, scale)
    lead, k = x.shape[:-1], x.shape[-1]
    xq, xs = quantize_act_fp8(x.reshape(-1, k))
    if _triton(x):
        from kernels.fp8_linear_triton import fp8_linear_w8a8_triton

        out = fp8_linear_w8a8_triton(xq, xs, weight, scale, x.dtype)
    else:
        out = fp8_linear_w8a8_ref(xq, xs, weight, scale, x.dtype)
    return out.reshape(*lead, weight.shape[0])


def fp8_grouped_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., groups, in]; group g uses rows g*n..(g+1)*n of weight [groups*n, in] -> [..., groups, n]."""
    if _triton(x):
        from kernels.fp8_linear_triton import fp8_grouped_linear_triton

        return fp8_grouped_linear_triton(x, weight, scale)
    return fp8_grouped_linear_ref(x, weight, scale)
