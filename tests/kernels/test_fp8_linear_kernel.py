"""Block-scaled FP8 linear: the Triton kernel against the torch reference and the dequantized matmul.

Run as a script (`python test_fp8_linear_kernel.py out.pt`, under `TRITON_INTERPRET=1`), this file runs every
case through the Triton kernels and saves the outputs; see `conftest.py` for why.
"""

from __future__ import annotations

import sys

import pytest
import torch

from kernels.formats import FP8_BLOCK, dequant_fp8, quantize_act_fp8, quantize_fp8
from kernels.fp8_linear_ref import fp8_grouped_linear_ref, fp8_linear_ref, fp8_linear_w8a8_ref


def _extremes() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """UE8M0 extremes: tile (0, 0) scaled by 2**-127 (byte 0) and tile (1, 1) by 2**127 (byte 254).

    The activations of input block 0 are 2**100 and of input block 1 are 2**-100, so every product stays
    finite in fp32 and an extreme scale that decoded wrongly (0, inf, off by a power of two) shows.
    """
    gen = torch.Generator().manual_seed(7)
    w = (torch.randn(256, 256, generator=gen) * 100).clamp(-448, 448)
    w[FP8_BLOCK:, FP8_BLOCK:] *= 2.0**-9  # |w| <= 0.875 there, so w * 2**127 stays below the fp32 maximum
    w = w.to(torch.float8_e4m3fn)
    scale_bytes = torch.tensor([[0, 127], [120, 254]], dtype=torch.uint8)
    x = torch.randn(3, 256, generator=gen)
    x[:, :FP8_BLOCK] *= 2.0**100
    x[:, FP8_BLOCK:] *= 2.0**-100
    return x, w, scale_bytes.view(torch.float8_e8m0fnu).float()


def make_cases() -> dict[str, tuple]:
    """name -> (kind, inputs); deterministic, so this process and the child agree."""
    cases: dict[str, tuple] = {}
    for name, (m, n, k, dtype, seed) in {
        "partial_fp32": (5, 200, 300, torch.float32, 0),  # neither dimension a multiple of 128
        "aligned_fp32": (3, 256, 256, torch.float32, 1),
        "decode_row_fp32": (1, 130, 129, torch.float32, 2),  # one token, one column past a tile
        "partial_bf16": (4, 130, 260, torch.bfloat16, 3),
    }.items():
        gen = torch.Generator().manual_seed(seed)
        q, s = quantize_fp8(torch.randn(n, k, generator=gen) * 0.05)
        cases[name] = ("w8a16", (torch.randn(m, k, generator=gen).to(dtype), q, s))
    cases["ue8m0_extremes"] = ("w8a16", _extremes())
    gen = torch.Generator().manual_seed(4)
    q, s = quantize_fp8(torch.randn(2 * 128, 96, generator=gen))
    cases["grouped"] = ("grouped", (torch.randn(3, 2, 96, generator=gen), q, s))
    q, s = quantize_fp8(torch.randn(200, 300, generator=gen) * 0.05)
    xq, xs = quantize_act_fp8(torch.randn(4, 300, generator=gen))
    cases["w8a8"] = ("w8a8", (xq, xs, q, s, torch.float32))
    return cases


CASES = make_cases()


def reference(kind: str, args: tuple) -> torch.Tensor:
    return {"w8a16": fp8_linear_ref, "grouped": fp8_grouped_linear_ref, "w8a8": fp8_linear_w8a8_ref}[kind](*args)


def dequantized_matmul(kind: str, args: tuple) -> torch.Tensor:
    """The whole weight dequantized, one fp32 matmul: what the reference must equal up to summation order."""
    if kind == "w8a16":
        x, w, s = args
        return x.float() @ dequant_fp8(w, s).T
    if kind == "grouped":
        x, w, s = args
        return torch.einsum("tgi,goi->tgo", x, dequant_fp8(w, s).unflatten(0, (x.shape[1], -1)))
    xq, xs, w, s, _ = args
    x = xq.float() * xs.repeat_interleave(FP8_BLOCK, dim=-1)[:, : xq.shape[1]]
    return x @ dequant_fp8(w, s).T


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> tuple[bool, float]:
    """Relative to each output row's largest magnitude (rows mix very different scales in the extremes case)."""
    err = (got.float() - want.float()).abs()
    rel = (err / want.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-30)).max().item()
    return rel <= rtol, rel


@pytest.mark.parametrize("name", list(CASES))
def test_reference_equals_dequantized_matmul(name):
    kind, args = CASES[name]
    ok, rel = _close(reference(kind, args), dequantized_matmul(kind, args), 2e-6 if args[0].dtype == torch.float32 else 1e-2)
    assert ok, f"relative error {rel:.3g}"


def test_extreme_scales_are_decoded_exactly():
    x, w, s = CASES["ue8m0_extremes"][1]
    assert s[0, 0] == 2.0**-127 and s[1, 1] == 2.0**127
    out = fp8_linear_ref(x, w, s)
    assert torch.isfinite(out).all()
    # input block 0 of output rows 0..127 only reaches the output through the 2**-127 scale
    part = x[:, :FP8_BLOCK].double() @ (w[:FP8_BLOCK, :FP8_BLOCK].double() * 2.0**-127).T
    rest = x[:, FP8_BLOCK:].double() @ (w[:FP8_BLOCK, FP8_BLOCK:].double()).T
    assert torch.allclose(out[:, :FP8_BLOCK].double(), part + rest, rtol=1e-5)


@pytest.mark.parametrize("name", list(CASES))
def test_triton_matches_reference(triton_outputs, name):
    kind, args = CASES[name]
    want = reference(kind, args)
    got = triton_outputs[name]
    assert got.shape == want.shape and got.dtype == want.dtype
    # fp32 differs from the reference by summation order only; bf16 outputs by one rounding of the result
    ok, rel = _close(got, want, 1e-5 if want.dtype == torch.float32 else 8e-3)
    assert ok, f"relative error {rel:.3g}"
    assert want.abs().max() > 0


def test_triton_rejects_a_group_off_the_tiles(triton_outputs):
    assert "ValueError" in triton_outputs["group_off_tiles"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(CASES))
def test_compiled_triton_matches_reference_on_cuda(name):
    from kernels.fp8_linear_triton import fp8_grouped_linear_triton, fp8_linear_triton, fp8_linear_w8a8_triton

    kind, args = CASES[name]
    fn = {"w8a16": fp8_linear_triton, "grouped": fp8_grouped_linear_triton, "w8a8": fp8_linear_w8a8_triton}[kind]
    got = fn(*[a.cuda() if isinstance(a, torch.Tensor) else a for a in args]).cpu()
    ok, rel = _close(got, reference(kind, args), 1e-4 if got.dtype == torch.float32 else 8e-3)
    assert ok, f"relative error {rel:.3g}"


def _main(out: str) -> None:
    from conftest import kernel_or_exit

    fns = {
        "w8a16": kernel_or_exit("kernels.fp8_linear_triton", "fp8_linear_triton"),
        "grouped": kernel_or_exit("kernels.fp8_linear_triton", "fp8_grouped_linear_triton"),
        "w8a8": kernel_or_exit("kernels.fp8_linear_triton", "fp8_linear_w8a8_triton"),
    }
    results: dict = {name: fns[kind](*args) for name, (kind, args) in CASES.items()}
    q, s = quantize_fp8(torch.randn(2 * 64, 32))
    try:
        fns["grouped"](torch.randn(1, 2, 32), q, s)  # groups of 64 rows share a 128-row scale tile
        results["group_off_tiles"] = "accepted"
    except ValueError as exc:
        results["group_off_tiles"] = f"ValueError: {exc}"
    torch.save(results, out)


if __name__ == "__main__":
    _main(sys.argv[1])
