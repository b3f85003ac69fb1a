"""The decode indexer: the Triton kernel against the torch reference, over keys paged the way the arena pages them.

Run as a script (`python test_index_topk_kernel.py out.pt`, under `TRITON_INTERPRET=1`), this file runs every
case through `index_topk_triton` and saves the ids; see `conftest.py` for why.

Two kinds of case. *Exact* ones have values whose every product and sum fp32 holds exactly (small integers,
MXFP4-rounded values, power-of-two scales and weights), so any summation order gives the same scores and the
kernel must return the reference's ids exactly: ties (duplicated keys, all-ReLU-zero scores) broken the same
way, rows shorter than k, rows with nothing, splits and their merge. *Rounded* ones (Gaussian fp32 and bf16)
differ from the reference in summation order only, so the kernel's picks must be as good as the reference's:
the reference's scores of the picked ids are its own top-k scores. Blocks lie shuffled in a pool whose other
elements are NaN, so a key read through the wrong block, or one past a row's count that counts, shows.
The `gpu` tests run the compiled kernel at V4's indexer shapes (64 heads x 128, k 512).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import pytest
import torch

from kernels.index_topk_ref import PagedKeys, entry_scores, index_topk_ref
from kernels.kv_format import KVCodec


@dataclass(frozen=True)
class Case:
    fmt: str
    rows: int
    heads: int
    dim: int
    blocks: int
    per: int
    topk: int
    seed: int
    exact: bool
    splits: int | None = None
    dtype: torch.dtype = torch.float32


CASES = {
    "bf16_exact_ties": Case("bf16", 4, 8, 16, 4, 16, 16, 0, True),
    "bf16_exact_split": Case("bf16", 5, 8, 16, 6, 16, 16, 1, True, splits=3),
    "bf16_exact_k_past_entries": Case("bf16", 3, 8, 16, 1, 12, 16, 2, True),  # k > gather length; 12 entries a block
    "v4_exact": Case("v4", 4, 8, 64, 4, 16, 16, 3, True, splits=2),
    "v4_dense_bf16_exact": Case("v4-dense", 3, 8, 16, 3, 16, 16, 4, True, dtype=torch.bfloat16),
    "v4_exact_k128_split": Case("v4", 2, 16, 64, 8, 64, 128, 5, True, splits=3),
    "v4_exact_many_chunks": Case("v4", 2, 8, 64, 8, 64, 16, 9, True),  # one program walks 8 chunks, most skipped
    "fp32_rounded_odd_shapes": Case("bf16", 3, 12, 24, 8, 8, 20, 6, False, splits=2),  # heads, dim, k not powers of two
    "bf16_rounded": Case("bf16", 3, 8, 32, 4, 16, 16, 7, False, dtype=torch.bfloat16),
    "v4_rounded": Case("v4", 3, 8, 128, 4, 16, 16, 8, False),  # V4's key width: 64 pairs + 4 scales
}


def build(c: Case, device="cpu"):
    """(q [rows, heads, dim], w [rows, heads], PagedKeys) for a case; deterministic, so both processes agree."""
    g = torch.Generator().manual_seed(c.seed)
    codec = KVCodec(c.fmt, 64, 8, c.dim, c.dtype)
    n = c.blocks * c.per
    if c.exact and c.fmt == "bf16":  # small integers: exact products and sums
        raw = torch.randint(-3, 4, (c.rows, n, c.dim), generator=g).float()
        q = torch.randint(-2, 3, (c.rows, c.heads, c.dim), generator=g).float()
    else:  # v4 values have two significant bits: with power-of-two scales the sums stay exact too
        raw = torch.randn(c.rows, n, c.dim, generator=g)
        q = torch.randn(c.rows, c.heads, c.dim, generator=g)
    raw[:, 5] = raw[:, 2]  # equal keys: an exact tie between entries 2 and 5 of every row
    raw[:, 9] = 0  # a key that scores exactly 0 (ties with every all-ReLU-zero entry)
    stored = codec.pack_index(raw.to(c.dtype))  # [rows, n, width]
    width = stored.shape[-1]
    q = codec.index_query(q.to(c.dtype))
    if c.exact:
        w = torch.randint(-4, 5, (c.rows, c.heads), generator=g).float() / 8  # dyadic: exact products
    else:
        w = torch.randn(c.rows, c.heads, generator=g) * c.heads**-0.5
    slots = c.rows * c.blocks + 3  # pool blocks in shuffled order, the spare ones NaN
    order = torch.randperm(slots, generator=g)[: c.rows * c.blocks].view(c.rows, c.blocks)
    pool = torch.full((slots, c.per, width), float("nan"), dtype=c.dtype) if not codec.packed else \
        torch.randint(0, 256, (slots, c.per, width), generator=g, dtype=torch.uint8)
    pool[order] = stored.view(c.rows, c.blocks, c.per, width)
    counts = torch.randint(0, n + 1, (c.rows,), generator=g)
    counts[0], counts[-1] = n, min(n, 3)  # one row sees everything, one fewer than k
    if c.rows > 3:
        counts[1] = 0  # one row sees nothing
    if not codec.packed:  # what lies past a row's count is not a key: make it poison
        flat = pool.view(slots, c.per, width)
        for r in range(c.rows):
            for e in range(int(counts[r]), n):
                flat[order[r, e // c.per], e % c.per] = float("nan")
    keys = PagedKeys(pool.view(-1).to(device), (order * c.per * width).to(device), counts.to(device), c.per, codec)
    return q.to(device), w.to(device), keys


def _reference_scores(q, w, keys: PagedKeys) -> torch.Tensor:
    """Every entry's reference score, -inf past each row's count: [rows, n]."""
    s = entry_scores(q, w, keys.codec.unpack_index(keys.dense(), torch.float32))
    return s.masked_fill(torch.arange(s.shape[1], device=s.device) >= keys.counts[:, None], float("-inf"))


def assert_as_good(got: torch.Tensor, q, w, keys: PagedKeys, topk: int, rtol: float) -> None:
    """`got` is a valid selection whose reference scores are the reference's own top-k scores (within rtol):
    picks that differ from the reference's only swap entries a rounding apart."""
    want = index_topk_ref(q, w, keys, topk)
    assert got.shape == want.shape and torch.equal(got < 0, want < 0), "a different number of picks per row"
    scores = _reference_scores(q, w, keys)
    for r in range(got.shape[0]):
        picked = got[r][got[r] >= 0]
        assert picked.unique().numel() == picked.numel() and bool((picked < keys.counts[r]).all()), f"row {r}"
        mine, theirs = scores[r, picked], scores[r, want[r][want[r] >= 0]]
        torch.testing.assert_close(mine.sort(descending=True).values, theirs, rtol=rtol, atol=rtol * theirs.abs().max().item())


EXACT = [name for name, c in CASES.items() if c.exact]
ROUNDED = [name for name, c in CASES.items() if not c.exact]


def test_cases_hold_ties_and_short_rows():
    """The exact cases test what they say: tied top scores, and rows with fewer visible entries than k."""
    q, w, keys = build(CASES["bf16_exact_ties"])
    s = _reference_scores(q, w, keys)
    seen = keys.counts > 5
    assert bool(seen.any()) and bool((s[seen, 2] == s[seen, 5]).all())  # duplicated keys tie
    ranked = s.sort(dim=1, descending=True).values[:, : CASES["bf16_exact_ties"].topk]
    assert bool(((ranked[:, 1:] == ranked[:, :-1]) & (ranked[:, 1:] > float("-inf"))).any())  # ties inside the top k
    assert bool((index_topk_ref(q, w, keys, 16) == -1).any())


@pytest.mark.parametrize("name", EXACT)
def test_triton_equals_reference_exactly(triton_outputs, name):
    c = CASES[name]
    q, w, keys = build(c)
    assert torch.equal(triton_outputs[name], index_topk_ref(q, w, keys, c.topk))


@pytest.mark.parametrize("name", ROUNDED)
def test_triton_picks_are_as_good_as_the_reference(triton_outputs, name):
    c = CASES[name]
    q, w, keys = build(c)
    assert_as_good(triton_outputs[name], q, w, keys, c.topk, rtol=1e-5)


def test_split_plan_covers_every_entry():
    from kernels.index_topk_triton import MIN_SPLIT, plan_splits

    for rows, n, chunk, programs in ((64, 32768, 512, 132), (1, 32768, 512, 132), (8, 100, 64, 132), (1, 64, 64, 1)):
        splits, per = plan_splits(rows, n, chunk, programs)
        assert per % chunk == 0 and (splits - 1) * per < n <= splits * per
        assert splits == 1 or per >= min(MIN_SPLIT, n)
    assert plan_splits(64, 32768, 512, 132)[0] * 64 >= 2 * 132  # two programs per SM at V4's batch


# --- CUDA -----------------------------------------------------------------------------------------------

V4_SHAPES = [Case("v4", 64, 64, 128, 128, 64, 512, 11, False), Case("v4", 4, 64, 128, 512, 64, 512, 12, False),
             Case("bf16", 16, 64, 128, 64, 64, 512, 13, False, dtype=torch.bfloat16),
             Case("bf16", 16, 64, 128, 64, 64, 512, 14, False)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", V4_SHAPES, ids=["v4_64rows_8k", "v4_4rows_32k_split", "bf16_tensor_cores", "fp32_ieee"])
def test_triton_at_v4_shapes_on_cuda(case):
    from kernels.index_topk_triton import index_topk_triton

    q, w, keys = build(case, "cuda")
    got = index_topk_triton(q, w, keys, case.topk)
    assert_as_good(got, q, w, keys, case.topk, rtol=1e-4 if case.dtype == torch.float32 else 1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_in_a_cuda_graph_reads_this_steps_keys():
    """Captured once, replayed after the keys, queries and counts changed in place: the replay's ids are the new ones."""
    from kernels.index_topk_triton import index_topk_triton

    case = V4_SHAPES[1]
    q, w, keys = build(case, "cuda")
    index_topk_triton(q, w, keys, case.topk)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = index_topk_triton(q, w, keys, case.topk)
    q2, w2, keys2 = build(Case(**{**case.__dict__, "seed": 99}), "cuda")
    q.copy_(q2), w.copy_(w2), keys.counts.copy_(keys2.counts), keys.pool.copy_(keys2.pool), keys.starts.copy_(keys2.starts)
    graph.replay()
    assert_as_good(out, q, w, keys, case.topk, rtol=1e-4)


def _main(out: str) -> None:
    from conftest import kernel_or_exit

    index_topk_triton = kernel_or_exit("kernels.index_topk_triton", "index_topk_triton")
    results = {}
    for name, c in CASES.items():
        q, w, keys = build(c)
        results[name] = index_topk_triton(q, w, keys, c.topk, splits=c.splits)
    torch.save(results, out)


if __name__ == "__main__":
    _main(sys.argv[1])
