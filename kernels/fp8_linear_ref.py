"""Torch reference of the block-scaled FP8 linear: y = x @ (w * s)^T, one column of weight tiles at a time.

The weight never exists dequantized as a whole: each step decodes the [out, 128] strip of one input block
(`FP8_BLOCK` columns) and adds its product, which is also how the Triton kernel walks the input axis.
Accumulation is fp32; the result has the activations' dtype.
"""

from __future__ import annotations

import torch

from kernels.formats import FP8_BLOCK


def _strip(weight: torch.Tensor, scale: torch.Tensor, kb: int) -> torch.Tensor:
    """Columns of input block `kb` of an e4m3 weight [out, in], decoded: fp32 [out, <=128]."""
    cols = weight[:, kb * FP8_BLOCK : (kb + 1) * FP8_BLOCK].float()
    rows_scale = scale[:, kb].float().repeat_interleave(FP8_BLOCK)[: weight.shape[0]]  # [out]
    return cols * rows_scale[:, None]


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W8A16: x [..., in] (bf16/fp16/fp32), weight e4m3 [out, in], scale fp32 [ceil(out/128), ceil(in/128)] -> [..., out]."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k).float()  # [tokens, in]
    out = x2.new_zeros(x2.shape[0], weight.shape[0])  # [tokens, out]
    for kb in range(scale.shape[1]):
        out += x2[:, kb * FP8_BLOCK : (kb + 1) * FP8_BLOCK] @ _strip(weight, scale, kb).T
    return out.to(x.dtype).reshape(*lead, weight.shape[0])


def fp8_linear_w8a8_ref(
    xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """W8A8: e4m3 activations xq [tokens, in] with per-token-group scales [tokens, ceil(in/128)] -> [tokens, out]."""
    out = torch.zeros(xq.shape[0], weight.shape[0], device=xq.device)  # [tokens, out]
    for kb in range(scale.shape[1]):
        xk = xq[:, kb * FP8_BLOCK : (kb + 1) * FP8_BLOCK].float() * x_scale[:, kb : kb + 1].float()
        out += xk @ _strip(weight, scale, kb).T
    return out.to(out_dtype)


def fp8_grouped_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Grouped projection: x [tokens, groups, in] with group g using rows g*n..(g+1)*n of weight [groups*n, in].

    Group boundaries must fall on scale tiles (n a multiple of 128), so each group is an ordinary block-FP8
    linear over its own rows and scale rows. -> [tokens, groups, n].
    """
    groups = x.shape[-2]
    n = weight.shape[0] // groups
    if n % FP8_BLOCK:
        raise ValueError(f"a group of {n} rows does not end on a {FP8_BLOCK}-row scale tile")
    nb = n // FP8_BLOCK
    outs = [
        fp8_linear_ref(x[..., g, :], weight[g * n : (g + 1) * n], scale[g * nb : (g + 1) * nb]) for g in range(groups)
    ]
    return torch.stack(outs, dim=-2)
