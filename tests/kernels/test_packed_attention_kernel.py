"""Decode and prefill sparse attention over packed v4 rows: the Triton kernels dequantize on load, against
the torch reference that dequantizes what it gathers (and against the dense fake-quant rows).

Run as a script (`python test_packed_attention_kernel.py out.pt`, under `TRITON_INTERPRET=1`); see `conftest.py`.
Decode cases run as planned, split over their keys (the merge kernel), and on the bf16 path (q in bf16, the
rows read as bf16: exact for e4m3 times a power of two). The kernels read v4 rows in place only on 8-byte
boundaries: other geometries and misaligned pools are refused.
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
SPLIT = {"splits": 3, "block_t": 16}
BF16_TOL = 1e-2
"""As in test_sparse_attention_kernel.py: max |error| / max |float64 reference| of the bf16 path."""


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

    # batch row 1 has no valid key, batch row 0 sees a row of every magnitude; a sink far above the logits
    gen = torch.Generator().manual_seed(2)
    rows = torch.randn(40, 64, generator=gen) * torch.logspace(-6, 2, 40)[:, None]
    idx = torch.arange(40).repeat(BATCH, 1)
    idx[1] = -1
    q = torch.randn(BATCH, 3, 64, generator=gen)
    cases["d64_row_without_keys"] = (q, [(pack_fp8_rows(rows, 8), idx)], torch.tensor([0.0, 4.0, -2.0]), 0.125,
                                     MainRowReader(64, 8, torch.float32))
    return cases


def _bf16(case: tuple) -> tuple:
    """The case as a bf16 model calls it: q in bf16 and rows read as bf16."""
    q, segments, sinks, scale, reader = case
    return q.bfloat16(), segments, sinks, scale, MainRowReader(reader.head_dim, reader.rope_dim, torch.bfloat16)


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


@pytest.mark.parametrize("variant", ["plan", "split"])
@pytest.mark.parametrize("name", list(CASES))
def test_packed_triton_matches_reference(triton_outputs, name, variant):
    q, segments, sinks, scale, reader = CASES[name]
    want = sparse_attention_ref(q, segments, sinks, scale, reader)
    dense = sparse_attention_ref(q, [(reader(p), r) for p, r in segments], sinks, scale)  # the fake-quant rows
    assert torch.equal(want, dense)
    got = triton_outputs[f"{name}/{variant}"]
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), f"max abs diff {(got - want).abs().max().item():.3g}"
    assert want.abs().max() > 0.01


@pytest.mark.parametrize("variant", ["bf16", "bf16_split"])
@pytest.mark.parametrize("name", list(CASES))
def test_packed_bf16_path_matches_reference(triton_outputs, name, variant):
    q, segments, sinks, scale, reader = _bf16(CASES[name])
    want = sparse_attention_ref(q.double(), segments, sinks.double(), scale, MainRowReader(reader.head_dim, reader.rope_dim, torch.float64))
    got = triton_outputs[f"{name}/{variant}"]
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert ((got.double() - want).abs().max() / want.abs().max()).item() <= BF16_TOL


def test_packed_row_without_keys_is_zero(triton_outputs):
    for variant in ("plan", "split", "bf16", "bf16_split"):
        got = triton_outputs[f"d64_row_without_keys/{variant}"]
        assert torch.equal(got[1], torch.zeros_like(got[1])), variant
        assert got[0].abs().max() > 0


def test_packed_rows_read_in_place_only_on_8_byte_boundaries(triton_outputs):
    """The row geometries the kernels read as stored (V4's, the built-in model's) and ones they refuse; a pool
    whose rows start off an 8-byte boundary is refused rather than read with misaligned 8-byte loads."""
    assert triton_outputs["reads_packed"] == {(512, 64): True, (64, 8): True, (32, 8): True, (16, 4): False, (48, 6): False,
                                              (1024, 64): False}
    assert "8-byte boundaries" in triton_outputs["misaligned_pool"]
    assert triton_outputs["misaligned_prefill_pool"].startswith("ValueError")
    assert "not read in place" in triton_outputs["unread_geometry"]


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
    from kernels.attention_triton import reads_packed

    res: dict = {}
    for name, case in CASES.items():
        for variant, options in (("plan", {}), ("split", SPLIT)):
            q, segs, sinks, scale, reader = case
            res[f"{name}/{variant}"] = sparse_attention_triton(q, segs, sinks, scale, packed=reader, **options)
            q, segs, sinks, scale, reader = _bf16(case)
            res[f"{name}/bf16{'' if variant == 'plan' else '_split'}"] = sparse_attention_triton(q, segs, sinks, scale, packed=reader,
                                                                                                 **options)
    for name, (q, segs, prefix, sinks, scale, reader) in PREFILL_CASES.items():
        res[name] = prefill_attention_triton(q, segs, prefix, sinks, scale, packed=reader)

    res["reads_packed"] = {dims: reads_packed(MainRowReader(*dims, torch.float32))
                           for dims in ((512, 64), (64, 8), (32, 8), (16, 4), (48, 6), (1024, 64))}
    q, segs, sinks, scale, reader = CASES["d64_r8"]
    pool, rows = segs[0]
    shifted = torch.zeros(pool.numel() + 4, dtype=torch.uint8)[4:].view(pool.shape)  # rows 4 bytes off alignment
    shifted.copy_(pool)
    for key, call in (
        ("misaligned_pool", lambda: sparse_attention_triton(q, [(shifted, rows)], sinks, scale, packed=reader)),
        ("misaligned_prefill_pool", lambda: prefill_attention_triton(q, [(shifted, rows)], None, sinks, scale, packed=reader)),
        ("unread_geometry", lambda: sparse_attention_triton(torch.randn(BATCH, 2, 16), [(pack_fp8_rows(torch.randn(5, 16), 4), rows)],
                                                            sinks[:2], scale, packed=MainRowReader(16, 4, torch.float32))),
    ):
        try:
            call()
            res[key] = "accepted"
        except ValueError as exc:
            res[key] = f"ValueError: {exc}"
    torch.save(res, out)


if __name__ == "__main__":
    _main(sys.argv[1])
