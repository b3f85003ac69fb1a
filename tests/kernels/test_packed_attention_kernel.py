"""Decode and prefill sparse attention over packed v4 rows: the Triton kernels dequantize on load, against
the torch reference that dequantizes what it gathers (and against the dense fake-quant rows).

Run as a script (`python test_packed_attention_kernel.py out.pt`, under `TRITON_INTERPRET=1`); see `conftest.py`.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

from kernels.attention_ref import sparse_attention_ref
from kernels.kv_format import MainRowReader, pack_fp8_rows
from kernels.prefill_attention_ref import prefill_attention_ref

BATCH = 2


def make_cases() -> dict[str, tuple]:
    """name -> (q, packed segments, sinks, scale, reader); deterministic."""
    cases = {}
    for heads, dim, rope, lens, seed in ((4, 64, 8, (24, 9), 0), (2, 512, 64, (12, 0, 5), 1)):
        gen = torch.Generator().manual_seed(seed)
        q = torch.randn(BATCH, heads, dim, generator=gen)
        segments = []
        for i, seg_len in enumerate(lens):
            n = 11 + 5 * i
            # rows of mixed magnitudes, some tiny (subnormal e4m3 codes) and one all zero
            rows = torch.randn(n, dim, generator=gen) * torch.logspace(-4, 1, n)[:, None]
            rows[0] = 0
            idx = torch.randint(0, n, (BATCH, seg_len), generator=gen)
            idx = torch.where(torch.rand(BATCH, seg_len, generator=gen) < 0.2, -1, idx)
            segments.append((pack_fp8_rows(rows, rope), idx))
        reader = MainRowReader(dim, rope, torch.float32)
        cases[f"d{dim}_r{rope}"] = (q, segments, torch.randn(heads, generator=gen), 1 / math.sqrt(dim), reader)
    return cases


def make_prefill_cases() -> dict[str, tuple]:
    """name -> (q, packed segments, packed prefix, sinks, scale, reader): many queries, a window segment,
    a gathered segment and an HCA-like prefix, all packed."""
    cases = {}
    for heads, dim, rope, queries, n, seed in ((2, 64, 8, 7, 40, 5), (2, 512, 64, 5, 37, 6)):
        gen = torch.Generator().manual_seed(seed)
        q = torch.randn(queries, heads, dim, generator=gen)
        rows = torch.randn(n, dim, generator=gen)
        pool = pack_fp8_rows(rows, rope)
        sel = torch.randint(0, n, (queries, 6), generator=gen)
        sel = torch.where(torch.rand(queries, 6, generator=gen) < 0.3, -1, sel)
        win = torch.randint(0, n, (queries, 4), generator=gen)
        counts = torch.arange(queries) * 5 + 3  # each query sees a longer prefix
        reader = MainRowReader(dim, rope, torch.float32)
        cases[f"prefill_d{dim}"] = (q, [(pool, win), (pool, sel)], (pool, counts), torch.randn(heads, generator=gen),
                                    1 / math.sqrt(dim), reader)
    return cases


CASES = make_cases()
PREFILL_CASES = make_prefill_cases()


@pytest.mark.parametrize("name", list(CASES))
def test_packed_triton_matches_reference(triton_outputs, name):
    q, segments, sinks, scale, reader = CASES[name]
    want = sparse_attention_ref(q, segments, sinks, scale, reader)
    dense = sparse_attention_ref(q, [(reader(p), r) for p, r in segments], sinks, scale)  # the fake-quant rows
    assert torch.equal(want, dense)
    got = triton_outputs[name]
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), f"max abs diff {(got - want).abs().max().item():.3g}"
    assert want.abs().max() > 0.01


@pytest.mark.parametrize("name", list(PREFILL_CASES))
def test_packed_prefill_triton_matches_reference(triton_outputs, name):
    q, segments, prefix, sinks, scale, reader = PREFILL_CASES[name]
    want = prefill_attention_ref(q, segments, prefix, sinks, scale, 16, reader)
    got = triton_outputs[name]
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), f"max abs diff {(got - want).abs().max().item():.3g}"
    assert want.abs().max() > 0.01


def _main(out: str) -> None:
    from conftest import kernel_or_exit

    sparse_attention_triton = kernel_or_exit("kernels.attention_triton", "sparse_attention_triton")
    prefill_attention_triton = kernel_or_exit("kernels.prefill_attention_triton", "prefill_attention_triton")
    res = {name: sparse_attention_triton(q, segs, sinks, scale, packed=reader)
           for name, (q, segs, sinks, scale, reader) in CASES.items()}
    for name, (q, segs, prefix, sinks, scale, reader) in PREFILL_CASES.items():
        res[name] = prefill_attention_triton(q, segs, prefix, sinks, scale, packed=reader)
    torch.save(res, out)


if __name__ == "__main__":
    _main(sys.argv[1])
