"""The decode indexer as one operation over the stored keys (`DecodeKV.index_topk`, `kernels.index_topk_ref`).

The reference is the selection rule, ties and short rows included, in any tiling; it picks what the path
before it picked (a separate dense gather, decode, einsum and top-k over all scores: `bench.indexer.Before`);
both stores hand it the same keys; it traces whole with rows and blocks symbolic, and a CUDA graph could hold
it. Its transient memory is a tile's, not the context's.
"""

from __future__ import annotations

import math

import pytest
import torch

import kernels.index_topk_ref as ref
from bench.indexer import Before, arena, measure, picks
from cachetier.batch import LayoutBatch
from cachetier.store import TieredStore
from core.configs import TierConfig
from kernels.capture_guard import capture_guard, fake_cuda
from kernels.index_topk import index_topk
from kernels.index_topk_ref import PagedKeys, entry_scores, index_topk_ref
from kernels.kv_format import KVCodec


def brute_force(scores: torch.Tensor, counts: torch.Tensor, topk: int) -> torch.Tensor:
    """The rule written plainly: visible entries by (score descending, id ascending), first k, -1 padded."""
    k = min(topk, scores.shape[1])
    out = torch.full((scores.shape[0], k), -1, dtype=torch.long)
    for i, row in enumerate(scores.tolist()):
        ranked = sorted(range(int(counts[i])), key=lambda e: (-row[e], e))[:k]
        out[i, : len(ranked)] = torch.tensor(ranked, dtype=torch.long)
    return out


def tied_keys(fmt: str, rows: int, blocks: int, per: int, heads: int, dim: int, seed: int):
    """Integer keys, queries and dyadic weights (every score exact in any order), few distinct keys (many exact
    ties, whole groups scoring 0), blocks shuffled in the pool; counts from 0 to the gather length."""
    g = torch.Generator().manual_seed(seed)
    codec = KVCodec(fmt, 64, 8, dim, torch.float32)
    n = blocks * per
    distinct = torch.randint(-2, 3, (5, dim), generator=g).float()
    raw = distinct[torch.randint(0, 5, (rows, n), generator=g)]  # [rows, n, dim]
    stored = codec.pack_index(raw)
    width = stored.shape[-1]
    order = torch.randperm(rows * blocks + 1, generator=g)[: rows * blocks].view(rows, blocks)
    pool = torch.zeros(rows * blocks + 1, per, width, dtype=stored.dtype)
    pool[order] = stored.view(rows, blocks, per, width)
    counts = torch.linspace(0, n, rows).round().long()
    q = codec.index_query(torch.randint(-2, 3, (rows, heads, dim), generator=g).float())
    w = torch.randint(-4, 5, (rows, heads), generator=g).float() / 8
    return q, w, PagedKeys(pool.view(-1), order * per * width, counts, per, codec)


@pytest.mark.parametrize("per, blocks, topk", [(16, 4, 8), (12, 3, 16), (5, 7, 4), (64, 2, 200), (64, 1, 16)],
                         ids=["8_tiles", "12_a_block", "5_a_block", "k_past_entries", "one_block"])
@pytest.mark.parametrize("fmt", ["bf16", "v4"])
def test_reference_is_the_rule_on_ties(fmt, per, blocks, topk):
    q, w, keys = tied_keys(fmt, 6, blocks, per, 8, 16, seed=per * blocks)
    scores = entry_scores(q, w, keys.codec.unpack_index(keys.dense(), torch.float32))  # [rows, n], exact
    ranked = scores.sort(dim=1, descending=True).values
    assert bool((ranked[:, 1:] == ranked[:, :-1]).any())  # the case holds ties
    assert torch.equal(index_topk_ref(q, w, keys, topk), brute_force(scores, keys.counts, topk))


def test_tiles_do_not_change_the_choice(monkeypatch):
    """Whatever the tile count, the same ids (the running merge loses nothing a tile held)."""
    q, w, keys = tied_keys("bf16", 5, 6, 16, 8, 16, seed=3)
    want = index_topk_ref(q, w, keys, 16)
    for tiles in (1, 2, 16):
        monkeypatch.setattr(ref, "TILES", tiles)
        assert torch.equal(index_topk_ref(q, w, keys, 16), want), tiles


def test_picks_equal_the_path_before():
    """Random cases at V4's and the built-in model's indexer dimensions, v4 and bf16 keys, fp32 and bf16 compute,
    tied cases and rows shorter than k: no row selects other ids than before."""
    out = picks(24)
    assert out["rows"] == 96 and out["rows_differing"] == 0, out["by_kind"]


def test_the_path_before_is_what_bench_calls_it():
    """The baseline differs from the reference in how it gets there only: the same ids on one V4-sized case."""
    q, w, a = arena("v4", 4, 2048, seed=5)
    with torch.inference_mode():
        assert torch.equal(Before.index_topk(q, w, a, 512), index_topk(q, w, a.keys(), 512))


# --- the stores -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("offload", [False, True], ids=["tier_off", "tier_on"])
def test_both_stores_hand_over_the_same_keys_and_select_alike(tiny_model, offload):
    cfg = tiny_model.cfg
    g = torch.Generator().manual_seed(4)
    layouts = []
    for n in (300, 41, 130):
        _, lay = tiny_model.prefill(torch.randint(6, cfg.vocab_size, (n,), generator=g).tolist(), last_only=True)
        layouts.append(lay)
    plain = LayoutBatch(cfg, [lay.clone() for lay in layouts])
    store = TieredStore(cfg, TierConfig(offload=offload, hot_buffer_slots=cfg.index_topk, reserved_slots=2,
                                        device_budget_bytes=16 * 2**20, host_pool_bytes=16 * 2**20))
    for i, lay in enumerate(layouts):
        store.admit(f"r{i}", lay, lay.num_tokens + 4)
    view = store.step_view([f"r{i}" for i in range(3)], 4, num_blocks=plain.num_blocks)  # a padding row too
    q = torch.randn(4, cfg.index_n_heads, cfg.index_head_dim, generator=g)
    w = torch.randn(4, cfg.index_n_heads, generator=g)
    for layer in cfg.csa_layers:
        a, b = plain.index_source(layer), view.index_source(layer)
        assert a.num_entries == b.num_entries == plain.gather_len(cfg.csa_rate)
        assert torch.equal(b.counts[:3], a.counts) and int(b.counts[3]) == 0
        da, db = a.dense(), b.dense()
        for r, lay in enumerate(layouts):
            count = lay.layers[layer].index_keys.shape[0]
            assert torch.equal(db[r, :count], lay.layers[layer].index_keys)
            assert torch.equal(da[r, :count], db[r, :count])
        assert int(a.counts.max()) > cfg.index_topk > int(a.counts.min())  # a real choice, and a row short of k
        ids = view.index_topk(layer, q, w, cfg.index_topk)
        assert torch.equal(plain.index_topk(layer, q[:3], w[:3], cfg.index_topk), ids[:3])
        assert bool((ids[3] == -1).all())  # the padding row sees nothing
    store.close()


# --- fixed shapes ---------------------------------------------------------------------------------------


def test_traces_whole_with_rows_and_blocks_symbolic():
    """One graph for every bucket (fullgraph: no graph break, so no host sync), and the eager result."""
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    fn = torch.compile(index_topk_ref, fullgraph=True, backend=backend)
    for rows, blocks, seed in ((2, 2, 0), (4, 4, 1), (3, 8, 2)):
        q, w, keys = tied_keys("v4", rows, blocks, 16, 8, 16, seed)
        for t, dims in ((q, (0,)), (w, (0,)), (keys.pool, (0,)), (keys.starts, (0, 1)), (keys.counts, (0,))):
            for d in dims:
                torch._dynamo.maybe_mark_dynamic(t, d)
        assert torch.equal(fn(q, w, keys, 16), index_topk_ref(q, w, keys, 16))
    assert len(compiles) == 1


def test_holds_nothing_a_cuda_graph_cannot():
    with fake_cuda():
        q, w, keys = tied_keys("v4", 4, 8, 64, 8, 16, seed=6)
        keys = PagedKeys(keys.pool.to("cuda"), keys.starts.to("cuda"), keys.counts.to("cuda"), keys.per_block, keys.codec)
        q, w = q.to("cuda"), w.to("cuda")
        with torch.inference_mode(), capture_guard("cuda"):  # raises on a sync, a host copy, a shape from data
            ids = index_topk(q, w, keys, 16)
        assert ids.shape == (4, 16) and ids.device.type == "cuda"


def test_transient_memory_is_a_tiles_not_the_contexts():
    """At V4's dimensions the reference holds at most about 1/TILES of what scoring every entry at once holds,
    and its peak does not grow with the context faster than the keys do."""
    peaks = {}
    for entries in (1024, 4096):
        q, w, a = arena("v4", 8, entries, seed=7)
        _, before = measure(lambda q=q, w=w, a=a: Before.index_topk(q, w, a, 512))
        _, after = measure(lambda q=q, w=w, a=a: index_topk(q, w, a.keys(), 512))
        assert after.peak < before.peak * 2 / ref.TILES, (entries, after.peak, before.peak)
        peaks[entries] = after.peak
    assert peaks[4096] < 4 * peaks[1024] * 1.1  # linear in the entries, with a tile's share of them
    assert math.gcd(64, ref.TILES) == ref.TILES  # V4's 64 entries a block split into TILES equal tiles
