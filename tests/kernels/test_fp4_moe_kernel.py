"""Grouped MXFP4 expert matmul: the Triton kernel against the torch reference and the dequantized matmul.

Run as a script (`python test_fp4_moe_kernel.py out.pt`, under `TRITON_INTERPRET=1`), this file runs every
case through `fp4_expert_matmul_triton` and saves the outputs; see `conftest.py` for why.
"""

from __future__ import annotations

import sys

import pytest
import torch

from kernels.formats import FP4_BLOCK, dequant_fp4, quantize_fp4
from kernels.fp4_moe_ref import fp4_expert_matmul_ref
from kernels.moe_align import expert_blocks, num_slots


def _case(gen, num_experts: int, n: int, k: int, m: int, experts: torch.Tensor, dtype=torch.float32) -> tuple:
    weight, scale = quantize_fp4(torch.randn(num_experts, n, k, generator=gen) * 0.1)
    a = torch.randn(m, k, generator=gen).to(dtype)
    rows = torch.randint(0, m, (experts.numel(),), generator=gen)
    return a, rows, experts, weight, scale


def _extremes(gen) -> tuple:
    """UE8M0 extremes per input group: 2**127 (byte 254) on group 0, 2**-127 (byte 0) on group 1.

    Activations of group 0 are 2**-125 and of group 1 are 2**125, so both groups add O(1) terms and a
    scale decoded wrongly (0, inf, off by a power of two) shows in the output.
    """
    a, rows, experts, weight, scale = _case(gen, 2, 40, 3 * FP4_BLOCK, 4, torch.tensor([0, 1, 1, 0, 1, -1]))
    scale[:, :, 0] = 254
    # keep group 0's codes at |value| <= 1.5 (sign and low two bits of each nibble), so w * 2**127 stays finite
    weight[:, :, : FP4_BLOCK // 2] = (weight[:, :, : FP4_BLOCK // 2].view(torch.uint8) & 0xBB).view(torch.int8)
    scale[:, :, 1] = 0
    a[:, :FP4_BLOCK] *= 2.0**-125
    a[:, FP4_BLOCK : 2 * FP4_BLOCK] *= 2.0**125
    return a, rows, experts, weight, scale


def make_cases() -> dict[str, tuple]:
    """name -> (a, rows, experts, weight, scale); deterministic, so this process and the child agree."""
    gen = torch.Generator().manual_seed(0)
    cases = {
        # k = 96 is one and a half BLOCK_K steps; n = 70 a partial output tile; a pair without an expert
        "partial": _case(gen, 4, 70, 96, 6, torch.tensor([2, 0, -1, 2, 3, 2, 0, 1, 3, 3, 0, 2])),
        # expert 1 gets 35 pairs (several row blocks), expert 3 none
        "skewed": _case(gen, 4, 64, 128, 20, torch.cat((torch.ones(35, dtype=torch.long), torch.tensor([0, 2] * 8)))),
        "bf16": _case(gen, 3, 48, 64, 5, torch.tensor([1, 1, 0, 2, 0, 1, 2]), torch.bfloat16),
        "single_pair": _case(gen, 5, 33, 64, 1, torch.tensor([4])),
        "ue8m0_extremes": _extremes(gen),
    }
    return cases


CASES = make_cases()


def dequantized_matmul(a, rows, experts, weight, scale) -> torch.Tensor:
    """Every expert dequantized, one pair at a time: the plain definition the reference must equal."""
    w = dequant_fp4(weight, scale)  # [E, n, k]
    out = torch.zeros(rows.numel(), weight.shape[1])
    for p in range(rows.numel()):
        if experts[p] >= 0:
            out[p] = w[experts[p]] @ a[rows[p]].float()
    return out


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max error relative to each output row's largest magnitude (rows of zeros must stay exactly 0)."""
    err = (got.float() - want.float()).abs()
    return (err / want.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-30)).max().item()


@pytest.mark.parametrize("name", list(CASES))
def test_reference_equals_dequantized_matmul(name):
    want = dequantized_matmul(*CASES[name])
    got = fp4_expert_matmul_ref(*CASES[name])
    assert torch.isfinite(got).all()
    assert _rel(got, want) <= (2e-6 if got.dtype == torch.float32 else 1e-2)


def test_extreme_scales_reach_the_output():
    a, rows, experts, weight, scale = CASES["ue8m0_extremes"]
    got = fp4_expert_matmul_ref(a, rows, experts, weight, scale)
    vals = dequant_fp4(weight, scale)
    assert vals[0, 0, 0].abs().item() in (0.0, *(v * 2.0**127 for v in (0.5, 1, 1.5)))
    assert torch.isfinite(vals).all()
    # drop group 1 (scale 2**-127, activations 2**125): the output must change, so it was not decoded as 0
    without = vals.clone()
    without[:, :, FP4_BLOCK : 2 * FP4_BLOCK] = 0
    p = 0
    assert not torch.allclose(got[p], without[experts[p]] @ a[rows[p]], rtol=1e-3)


def test_alignment_puts_every_pair_once_in_its_experts_blocks():
    experts = torch.tensor([2, 0, -1, 2, 3, 2, 0, 1, 3, 3, 0, 2, -1])
    slot_pair, block_expert = expert_blocks(experts, 5, 4)
    assert slot_pair.numel() == num_slots(13, 5, 4) and block_expert.numel() == slot_pair.numel() // 4
    placed = slot_pair[slot_pair >= 0]
    assert sorted(placed.tolist()) == [p for p in range(13) if experts[p] >= 0]
    for b, e in enumerate(block_expert.tolist()):
        in_block = slot_pair[4 * b : 4 * b + 4]
        in_block = in_block[in_block >= 0]
        if e < 0:
            assert in_block.numel() == 0
        else:
            assert in_block.numel() > 0 and (experts[in_block] == e).all()
    # one expert's pairs keep their order (stable sort)
    assert slot_pair[slot_pair >= 0][:3].tolist() == [1, 6, 10]


def test_alignment_compiles_to_one_graph():
    experts = torch.tensor([3, 0, -1, 3, 1])
    compiled = torch.compile(expert_blocks, fullgraph=True, backend="eager", dynamic=False)
    for got, want in zip(compiled(experts, 4, 2), expert_blocks(experts, 4, 2)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("name", list(CASES))
def test_triton_matches_reference(triton_outputs, name):
    want = fp4_expert_matmul_ref(*CASES[name])
    got = triton_outputs[name]
    assert got.shape == want.shape and got.dtype == want.dtype
    assert _rel(got, want) <= (1e-5 if want.dtype == torch.float32 else 8e-3)
    experts = CASES[name][2]
    assert torch.equal(got[experts < 0], torch.zeros_like(got[experts < 0]))
    assert want.abs().max() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(CASES))
def test_compiled_triton_matches_reference_on_cuda(name):
    from kernels.fp4_moe_triton import fp4_expert_matmul_triton

    got = fp4_expert_matmul_triton(*[t.cuda() for t in CASES[name]]).cpu()
    want = fp4_expert_matmul_ref(*CASES[name])
    assert _rel(got, want) <= (1e-4 if want.dtype == torch.float32 else 8e-3)


def _main(out: str) -> None:
    from conftest import kernel_or_exit

    fp4_expert_matmul_triton = kernel_or_exit("kernels.fp4_moe_triton", "fp4_expert_matmul_triton")
    torch.save({name: fp4_expert_matmul_triton(*case) for name, case in CASES.items()}, out)


if __name__ == "__main__":
    _main(sys.argv[1])
