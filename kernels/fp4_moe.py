"""Dispatcher for the grouped FP4 expert matmul: Triton on CUDA, the torch reference elsewhere."""

from __future__ import annotations

import torch

from core import device
from kernels.fp4_moe_ref import fp4_expert_matmul_ref


def fp4_expert_matmul(
    a: torch.Tensor, rows: torch.Tensor, experts: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
    routed_experts: int | None = None,
) -> torch.Tensor:
    """out[p] = a[rows[p]] @ dequant(weight[experts[p]], scale[experts[p]])^T, 0 where experts[p] == -1.

    a [m, in]; rows, experts [pairs] int64; weight packed e2m1 [E, out, in/2]; scale UE8M0 uint8
    [E, out, ceil(in/32)] -> [pairs, out] in a's dtype. `routed_experts` is how many experts the router
    picks from (default E; more on an expert-parallel rank): the kernel sizes its row blocks by it.
    """
    if device.current().use_triton and a.is_cuda:
        from kernels.fp4_moe_triton import fp4_expert_matmul_triton

        return fp4_expert_matmul_triton(a, rows, experts, weight, scale, routed_experts=routed_experts)
    return fp4_expert_matmul_ref(a, rows, experts, weight, scale)
