"""Decode sparse attention with a sink: the Triton kernel against the torch reference.

Run as a script (`python test_sparse_attention_kernel.py out.pt`, under `TRITON_INTERPRET=1`), this file
runs every case through `sparse_attention_triton` and saves the outputs; see `conftest.py` for why.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

from kernels.attention_ref import sparse_attention_ref

BATCH = 3


def _rows(gen, n: int, seg_len: int, holes: float = 0.25) -> torch.Tensor:
    """[BATCH, seg_len] rows into a pool of n, with about `holes` of them -1."""
    rows = torch.randint(0, n, (BATCH, seg_len), generator=gen)
    return torch.where(torch.rand(BATCH, seg_len, generator=gen) < holes, -1, rows)


def make_cases() -> dict[str, tuple]:
    """name -> (q, segments, sinks, scale); deterministic, so this process and the child agree."""
    cases = {}
    for heads, dim, lens, seed in (
        (2, 16, (20,), 0),
        (3, 24, (7, 0, 13), 1),  # dim not a power of two; an empty middle segment
        (4, 32, (0, 20, 5), 2),
        (4, 16, (1, 2), 3),
    ):
        gen = torch.Generator().manual_seed(seed)
        q = torch.randn(BATCH, heads, dim, generator=gen)  # [batch, heads, dim]
        segments = []
        for i, seg_len in enumerate(lens):
            n = 10 + 7 * i
            pool = torch.randn(n, dim, generator=gen)  # [n, dim]
            rows = _rows(gen, n, seg_len)
            if seg_len:
                rows[1] = -1  # batch row 1 sees nothing of this segment
            segments.append((pool, rows))
        cases[f"h{heads}_d{dim}_lens{'-'.join(map(str, lens))}"] = (q, segments, torch.randn(heads, generator=gen), 1 / math.sqrt(dim))

    gen = torch.Generator().manual_seed(10)
    # rows of a strided view (a slice of wider rows), as a per-layer view of a shared buffer would be
    wide = torch.randn(30, 40, generator=gen)
    q = torch.randn(BATCH, 2, 24, generator=gen)
    cases["strided_pool"] = (
        q,
        [(wide[:, 8:32], _rows(gen, 30, 11)), (wide[:, :24], _rows(gen, 30, 4))],
        torch.randn(2, generator=gen),
        0.2,
    )

    # large logits spread over several key blocks, so the running maximum moves and rescales
    q = 4 * torch.randn(BATCH, 3, 16, generator=gen)
    pool = torch.randn(90, 16, generator=gen)
    cases["many_blocks"] = (q, [(pool, _rows(gen, 90, 70, holes=0.1)), (pool, _rows(gen, 90, 20))], torch.randn(3, generator=gen), 0.5)

    # batch row 2 has no valid key anywhere: the sink takes all the mass and the output is 0
    q = torch.randn(BATCH, 2, 16, generator=gen)
    segments = [(torch.randn(12, 16, generator=gen), _rows(gen, 12, 9)) for _ in range(3)]
    for _, rows in segments:
        rows[2] = -1
    cases["row_without_keys"] = (q, segments, torch.full((2,), 3.0), 0.25)
    return cases


CASES = make_cases()


def test_reference_sink_only_absorbs_mass():
    """One key and a sink z: the output is v * e^s / (e^s + e^z); with no keys it is 0."""
    v = torch.tensor([[1.0, 2.0]])  # [1, dim]
    q = torch.tensor([[[0.5, 0.25]]])  # [1, 1, dim]: s = 1.0 with scale 1
    out = sparse_attention_ref(q, [(v, torch.tensor([[0]]))], torch.tensor([0.0]), 1.0)
    p = math.exp(1.0) / (math.exp(1.0) + 1.0)
    assert torch.allclose(out, torch.tensor([[[p, 2 * p]]]))
    none = sparse_attention_ref(q, [(v, torch.tensor([[-1]]))], torch.tensor([0.0]), 1.0)
    assert torch.equal(none, torch.zeros_like(none))


@pytest.mark.parametrize("name", list(CASES))
def test_triton_matches_reference(triton_outputs, name):
    q, segments, sinks, scale = CASES[name]
    want = sparse_attention_ref(q, segments, sinks, scale)
    got = triton_outputs[name]
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), f"max abs diff {(got - want).abs().max().item():.3g}"
    assert want.abs().max() > 0.1  # the case really attends to something


def test_triton_row_without_keys_is_zero(triton_outputs):
    got = triton_outputs["row_without_keys"]
    assert torch.equal(got[2], torch.zeros_like(got[2]))
    assert got[:2].abs().max() > 0


def test_triton_rejects_more_than_three_segments(triton_outputs):
    assert "ValueError" in triton_outputs["too_many_segments"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(CASES))
def test_compiled_triton_matches_reference_on_cuda(name):
    from kernels.attention_triton import sparse_attention_triton

    q, segments, sinks, scale = CASES[name]
    want = sparse_attention_ref(q, segments, sinks, scale)
    got = sparse_attention_triton(q.cuda(), [(p.cuda(), r.cuda()) for p, r in segments], sinks.cuda(), scale)
    assert torch.allclose(got.cpu(), want, atol=1e-5, rtol=1e-5)


def _main(out: str) -> None:
    from conftest import kernel_or_exit

    sparse_attention_triton = kernel_or_exit("kernels.attention_triton", "sparse_attention_triton")
    results: dict = {name: sparse_attention_triton(*case) for name, case in CASES.items()}
    q, segments, sinks, scale = CASES["row_without_keys"]
    try:
        sparse_attention_triton(q, segments + segments[:1], sinks, scale)
        results["too_many_segments"] = "accepted"
    except ValueError as exc:
        results["too_many_segments"] = f"ValueError: {exc}"
    torch.save(results, out)


if __name__ == "__main__":
    _main(sys.argv[1])
