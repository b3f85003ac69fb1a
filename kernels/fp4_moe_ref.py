"""Torch reference of the grouped FP4 expert matmul: out[p] = a[rows[p]] @ dequant(W[experts[p]])^T.

One expert is decoded at a time and never the whole stack. Shapes are static (no per-expert token lists,
which would need the host to read the routing): every pair is multiplied by every expert and each pair
keeps its own expert's row, so the work is `experts / top_k` times the routed FLOPs. That is the price of
a CPU path that compiles to one graph; GPUs run the Triton kernel, which computes only routed rows.
"""

from __future__ import annotations

import torch

from kernels.formats import dequant_fp4


def fp4_expert_matmul_ref(
    a: torch.Tensor, rows: torch.Tensor, experts: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """a [m, in]; rows, experts [pairs] (expert -1: the pair's output is 0); weight packed [E, out, in/2],
    scale UE8M0 [E, out, ceil(in/32)] -> [pairs, out] in a's dtype, accumulated in fp32."""
    x = a[rows].float()  # [pairs, in]
    out = x.new_zeros(rows.shape[0], weight.shape[1])  # [pairs, out]
    for e in range(weight.shape[0]):
        y = x @ dequant_fp4(weight[e], scale[e]).T  # [pairs, out]
        out = torch.where((experts == e)[:, None], y, out)
    return out.to(a.dtype)
