"""Decode sparse attention with a sink: the Triton kernel against the torch reference.

Run as a script (`python test_sparse_attention_kernel.py out.pt`, under `TRITON_INTERPRET=1`), this file
runs every case through `sparse_attention_triton` and saves the outputs; see `conftest.py` for why.

Each case runs as the plan chooses (one split under the interpreter), split over its keys with 16-row tiles
(partials and the merge kernel), and some with several head groups and on the bf16 path (whose bf16 operand
roundings the interpreter reproduces; see `kernels.attention_triton`). The `gpu` tests run the compiled
kernel at V4's shapes.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

from kernels.attention_ref import sparse_attention_ref
from kernels.kv_format import MainRowReader, pack_fp8_rows

BATCH = 3
BF16_TOL = 1e-2
"""bf16 path: max |error| / max |reference| (reference in float64 over the same bf16 inputs). The output is
rounded to bf16 (half an ulp: 2**-9, about 2e-3 relative) and so are the probabilities that multiply the
values (2**-9 each); fp32 accumulation adds little. A few 1e-3 is expected; 1e-2 leaves a margin."""
FP32_TOL = 1e-4
"""fp32 path at V4's shapes: IEEE fp32 dots over 1,664 keys against float64, relative to max |reference|."""


def _rows(gen, n: int, seg_len: int, holes: float = 0.25, batch: int = BATCH) -> torch.Tensor:
    """[batch, seg_len] rows into a pool of n, with about `holes` of them -1."""
    rows = torch.randint(0, n, (batch, seg_len), generator=gen)
    return torch.where(torch.rand(batch, seg_len, generator=gen) < holes, -1, rows)


def make_cases() -> dict[str, tuple]:
    """name -> (q, segments, sinks, scale); deterministic, so this process and the child agree."""
    cases = {}
    for heads, dim, lens, seed in (
        (2, 16, (20,), 0),
        (3, 24, (7, 0, 13), 1),  # dim not a power of two; an empty middle segment
        (4, 32, (0, 20, 5), 2),
        (4, 16, (1, 2), 3),
        (20, 16, (30, 9), 4),  # more heads than one 16-head program holds
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

    # no keys at all (every segment empty): every output is 0
    q = torch.randn(BATCH, 2, 16, generator=gen)
    pool = torch.randn(5, 16, generator=gen)
    cases["no_keys"] = (q, [(pool, torch.zeros(BATCH, 0, dtype=torch.long)), (pool, torch.zeros(BATCH, 0, dtype=torch.long))],
                        torch.randn(2, generator=gen), 0.25)
    return cases


CASES = make_cases()
SPLIT = {"splits": 4, "block_t": 16}
"""Forced split: 16-row tiles, up to 4 programs per (row, head group); every case with 17+ keys splits."""
BF16_CASES = ("h4_d32_lens0-20-5", "many_blocks", "strided_pool", "row_without_keys")
GROUPS_CASE = "h20_d16_lens30-9"


def _bf16(case: tuple) -> tuple:
    q, segments, sinks, scale = case
    return q.bfloat16(), [(p.bfloat16(), r) for p, r in segments], sinks, scale


def _reference_f64(q, segments, sinks, scale, reader=None) -> torch.Tensor:
    """The reference in float64 over exactly the values the kernel is given."""
    return sparse_attention_ref(q.double(), [(p if reader else p.double(), r) for p, r in segments], sinks.double(), scale,
                                None if reader is None else MainRowReader(reader.head_dim, reader.rope_dim, torch.float64))


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max().clamp(min=1e-30)).item()


def test_reference_sink_only_absorbs_mass():
    """One key and a sink z: the output is v * e^s / (e^s + e^z); with no keys it is 0."""
    v = torch.tensor([[1.0, 2.0]])  # [1, dim]
    q = torch.tensor([[[0.5, 0.25]]])  # [1, 1, dim]: s = 1.0 with scale 1
    out = sparse_attention_ref(q, [(v, torch.tensor([[0]]))], torch.tensor([0.0]), 1.0)
    p = math.exp(1.0) / (math.exp(1.0) + 1.0)
    assert torch.allclose(out, torch.tensor([[[p, 2 * p]]]))
    none = sparse_attention_ref(q, [(v, torch.tensor([[-1]]))], torch.tensor([0.0]), 1.0)
    assert torch.equal(none, torch.zeros_like(none))


@pytest.mark.parametrize("variant", ["plan", "split"])
@pytest.mark.parametrize("name", list(CASES))
def test_triton_matches_reference(triton_outputs, name, variant):
    q, segments, sinks, scale = CASES[name]
    want = sparse_attention_ref(q, segments, sinks, scale)
    got = triton_outputs[f"{name}/{variant}"]
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), f"max abs diff {(got - want).abs().max().item():.3g}"
    if name != "no_keys":
        assert want.abs().max() > 0.1  # the case really attends to something


def test_forced_split_really_splits(triton_outputs):
    """The split variant ran several programs per row wherever a case has more than one tile of keys."""
    for name, (_, segments, _, _) in CASES.items():
        keys = sum(rows.shape[1] for _, rows in segments)
        splits = triton_outputs[f"{name}/split/splits"]
        assert (1 < splits <= 4) if keys > 16 else splits == 1, (name, keys, splits)
    assert triton_outputs["many_blocks/split/splits"] == 3  # 90 keys: 4 slices of 32 rows leave the last empty


def test_head_groups_match_reference(triton_outputs):
    """20 heads in 16-head programs: a full group and a partial one, alone and split."""
    q, segments, sinks, scale = CASES[GROUPS_CASE]
    want = sparse_attention_ref(q, segments, sinks, scale)
    assert triton_outputs[f"{GROUPS_CASE}/groups/head_groups"] == 2
    for variant in ("groups", "groups_split"):
        got = triton_outputs[f"{GROUPS_CASE}/{variant}"]
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), f"{variant}: max abs diff {(got - want).abs().max().item():.3g}"


@pytest.mark.parametrize("variant", ["bf16", "bf16_split"])
@pytest.mark.parametrize("name", BF16_CASES)
def test_bf16_path_matches_reference(triton_outputs, name, variant):
    """bf16 q and rows: bf16 operands, fp32 accumulation, a bf16 output within BF16_TOL of the float64 reference."""
    q, segments, sinks, scale = _bf16(CASES[name])
    want = _reference_f64(q, segments, sinks, scale)
    got = triton_outputs[f"{name}/{variant}"]
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert _rel_err(got, want) <= BF16_TOL
    fp32 = triton_outputs[f"{name}/plan"]
    assert not torch.equal(got.float(), fp32)  # it took the bf16 path, not the fp32 one


def test_triton_row_without_keys_is_zero(triton_outputs):
    for variant in ("plan", "split", "bf16", "bf16_split"):
        got = triton_outputs[f"row_without_keys/{variant}"]
        assert torch.equal(got[2], torch.zeros_like(got[2])), variant
        assert got[:2].abs().max() > 0


def test_triton_rejects_bad_arguments(triton_outputs):
    assert "ValueError" in triton_outputs["too_many_segments"]
    assert "power of two" in triton_outputs["block_h_24"]


def test_plans_at_v4_shapes(triton_outputs):
    """At 64 heads x 512: 32 heads a program in bf16 (16 in fp32), 32-row tiles (16), no split once batch x
    head groups fills the 132 SMs, splits of at least MIN_SPLIT_ROWS keys at batch 1."""
    plans = triton_outputs["plans"]
    assert plans["b64_bf16"] == {"block_h": 32, "block_d": 512, "block_t": 32, "num_warps": 8, "head_groups": 2, "splits": 1,
                                 "chunk": 1664}
    assert plans["b64_fp32"]["block_h"] == 16 and plans["b64_fp32"]["block_t"] == 16 and plans["b64_fp32"]["splits"] == 1
    one = plans["b1_bf16"]
    assert one["splits"] == 13 and one["chunk"] == 128 and one["splits"] * one["chunk"] >= 1664
    assert plans["b8_bf16"]["splits"] == 8  # 16 programs from rows and groups: 132 // 16 = 8
    assert plans["b1_short"]["splits"] == 1  # 100 keys: below MIN_SPLIT_ROWS, not worth a split
    assert plans["b1_cpu"]["splits"] == 1  # the interpreter runs one program at a time


# --- V4 shapes on a GPU -----------------------------------------------------------------------------------

V4_HEADS, V4_DIM, V4_ROPE, V4_LENS = 64, 512, 64, (128, 512, 1024)


def v4_case(batch: int, packed: bool, dtype: torch.dtype, seed: int = 0) -> tuple:
    """(q, segments, sinks, scale, reader) at V4's shapes on the CPU: pools of mixed magnitudes (some rows tiny,
    the first all zero), rows with holes, and the last batch row (when there are two or more) without any key."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, V4_HEADS, V4_DIM, generator=gen).to(dtype)
    segments = []
    for n in V4_LENS:
        vals = torch.randn(2 * n + 7, V4_DIM, generator=gen) * torch.logspace(-3, 1, 2 * n + 7)[:, None]
        vals[0] = 0
        rows = _rows(gen, vals.shape[0], n, holes=0.2, batch=batch)
        if batch > 1:
            rows[-1] = -1
        segments.append((pack_fp8_rows(vals, V4_ROPE) if packed else vals.to(dtype), rows))
    reader = MainRowReader(V4_DIM, V4_ROPE, dtype) if packed else None
    return q, segments, torch.randn(V4_HEADS, generator=gen), V4_DIM**-0.5, reader


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("packed", [True, False], ids=["v4", "plain"])
@pytest.mark.parametrize("batch", [64, 1])
def test_v4_shapes_on_cuda(batch, packed, dtype):
    """64 heads x 512 (rope 64) over the window, top-k and HCA segments (128 / 512 / 1024 rows), as planned on
    this GPU: one split at batch 64, several at batch 1 (the merge kernel)."""
    from kernels.attention_triton import device_programs, plan_decode, sparse_attention_triton

    q, segments, sinks, scale, reader = v4_case(batch, packed, dtype)
    want = _reference_f64(q, segments, sinks, scale, reader)
    dev = torch.device("cuda")
    got = sparse_attention_triton(q.to(dev), [(p.to(dev), r.to(dev)) for p, r in segments], sinks.to(dev), scale, packed=reader)
    plan = plan_decode(batch, V4_HEADS, V4_DIM, sum(V4_LENS), dtype == torch.bfloat16, device_programs(dev))
    if batch == 1:
        assert plan.splits > 1
    got = got.cpu()
    assert got.dtype == dtype
    assert _rel_err(got, want) <= (BF16_TOL if dtype == torch.bfloat16 else FP32_TOL)
    if batch > 1:
        assert torch.equal(got[-1], torch.zeros_like(got[-1]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(CASES))
def test_compiled_triton_matches_reference_on_cuda(name):
    from kernels.attention_triton import sparse_attention_triton

    q, segments, sinks, scale = CASES[name]
    want = sparse_attention_ref(q, segments, sinks, scale)
    for options in ({}, SPLIT):
        got = sparse_attention_triton(q.cuda(), [(p.cuda(), r.cuda()) for p, r in segments], sinks.cuda(), scale, **options)
        assert torch.allclose(got.cpu(), want, atol=1e-5, rtol=1e-5)


def _main(out: str) -> None:
    from conftest import kernel_or_exit

    sparse_attention_triton = kernel_or_exit("kernels.attention_triton", "sparse_attention_triton")
    from kernels.attention_triton import plan_decode

    results: dict = {}
    for name, case in CASES.items():
        keys = sum(rows.shape[1] for _, rows in case[1])
        results[f"{name}/plan"] = sparse_attention_triton(*case)
        results[f"{name}/split"] = sparse_attention_triton(*case, **SPLIT)
        results[f"{name}/split/splits"] = plan_decode(BATCH, case[0].shape[1], case[0].shape[2], keys, False, 1, **SPLIT).splits
    for name in BF16_CASES:
        results[f"{name}/bf16"] = sparse_attention_triton(*_bf16(CASES[name]))
        results[f"{name}/bf16_split"] = sparse_attention_triton(*_bf16(CASES[name]), **SPLIT)
    q, segments, sinks, scale = CASES[GROUPS_CASE]
    results[f"{GROUPS_CASE}/groups"] = sparse_attention_triton(q, segments, sinks, scale, block_h=16)
    results[f"{GROUPS_CASE}/groups_split"] = sparse_attention_triton(q, segments, sinks, scale, block_h=16, **SPLIT)
    results[f"{GROUPS_CASE}/groups/head_groups"] = plan_decode(BATCH, q.shape[1], q.shape[2], 39, False, 1, block_h=16).head_groups

    q, segments, sinks, scale = CASES["row_without_keys"]
    for key, call in (("too_many_segments", lambda: sparse_attention_triton(q, segments + segments[:1], sinks, scale)),
                      ("block_h_24", lambda: sparse_attention_triton(q, segments, sinks, scale, block_h=24))):
        try:
            call()
            results[key] = "accepted"
        except ValueError as exc:
            results[key] = f"ValueError: {exc}"

    keys = sum(V4_LENS)
    plans = {
        "b64_bf16": plan_decode(64, V4_HEADS, V4_DIM, keys, True, 132),
        "b64_fp32": plan_decode(64, V4_HEADS, V4_DIM, keys, False, 132),
        "b1_bf16": plan_decode(1, V4_HEADS, V4_DIM, keys, True, 132),
        "b8_bf16": plan_decode(8, V4_HEADS, V4_DIM, keys, True, 132),
        "b1_short": plan_decode(1, V4_HEADS, V4_DIM, 100, True, 132),
        "b1_cpu": plan_decode(1, V4_HEADS, V4_DIM, keys, True, 1),
    }
    results["plans"] = {name: {f: getattr(p, f) for f in ("block_h", "block_d", "block_t", "num_warps", "head_groups", "splits",
                                                             "chunk")} for name, p in plans.items()}
    torch.save(results, out)


if __name__ == "__main__":
    _main(sys.argv[1])
