"""The indexer's top-k rule: untiled and tiled agree exactly, ties included; scores do not depend on the tile."""

from __future__ import annotations

import pytest
import torch

from model.index_topk import SMALL, key_ids, key_scores, selection_keys, tiled_topk, topk_keys
from model.layers import Indexer, select_topk
from model.prefill import score_block


def brute_force(scores: torch.Tensor, counts: torch.Tensor, topk: int) -> torch.Tensor:
    """The rule written plainly: visible entries by (score descending, id ascending), first k, -1 padded."""
    n = scores.shape[1]
    k = min(topk, n)
    out = torch.full((scores.shape[0], k), -1, dtype=torch.long)
    for i, row in enumerate(scores.tolist()):
        ranked = sorted(range(int(counts[i])), key=lambda e: (-row[e], e))[:k]
        out[i, : len(ranked)] = torch.tensor(ranked, dtype=torch.long)
    return out


def tied_scores(queries: int, n: int, seed: int) -> torch.Tensor:
    """Scores with many exact ties: few distinct values, including both zeros (a ReLU sum is often 0)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(-3, 4, (queries, n), generator=g).float()
    s[s == 0] = torch.where(torch.rand(int((s == 0).sum()), generator=g) < 0.5, -0.0, 0.0)
    return s


def prefix_counts(queries: int, start: int, rate: int = 4) -> torch.Tensor:
    return (torch.arange(start, start + queries) + 1) // rate


def test_keys_round_trip_and_order():
    scores = torch.tensor([1.5, -2.0, 0.0, -0.0, float("inf"), float("-inf"), 3e-38, -3e-38])
    ids = torch.arange(8)
    keys = selection_keys(scores, ids)
    assert torch.equal(key_scores(keys), torch.where(scores == 0, 0.0, scores))  # -0.0 comes back as +0.0
    assert key_ids(keys).tolist() == [0, 1, 2, 3, 4, -1, 6, 7]  # a -inf score is "no entry"
    order = keys.argsort(descending=True).tolist()
    assert order == [4, 0, 6, 2, 3, 7, 1, 5]  # +0 and -0 tie, so the lower id (2) goes first


@pytest.mark.parametrize("n", [5, SMALL, SMALL + 1, 700])
def test_untiled_rule_equals_brute_force_on_ties(n):
    scores = tied_scores(40, n, seed=n)
    counts = torch.linspace(0, n, 40).long()
    visible = torch.arange(n)[None, :] < counts[:, None]
    assert torch.equal(select_topk(scores, visible, 16), brute_force(scores, counts, 16))


@pytest.mark.parametrize("tile", [3, 64, 100, 512, 4096])
@pytest.mark.parametrize("start", [0, 37, 900])
def test_tiled_equals_untiled_on_ties(tile, start):
    queries = 300
    counts = prefix_counts(queries, start)
    n = int(counts[-1])
    scores = tied_scores(queries, n, seed=tile + start)

    def score(rows, t0, t1):
        return scores[rows, t0:t1].clone()

    visible = torch.arange(n)[None, :] < counts[:, None]
    want = select_topk(scores, visible, 16)
    assert torch.equal(want, brute_force(scores, counts, 16))
    for block in (None, 7):
        assert torch.equal(tiled_topk(score, counts, 16, tile, score_block=block), want)
        assert torch.equal(tiled_topk(score, counts, 16, tile, score_block=block, exhaustive=True), want)


def test_tiled_handles_fewer_entries_than_k_and_empty():
    counts = torch.tensor([0, 0, 1, 2, 2, 5])
    scores = tied_scores(6, 5, seed=1)
    got = tiled_topk(lambda rows, a, b: scores[rows, a:b].clone(), counts, 4, 2)
    assert torch.equal(got, brute_force(scores, counts, 4))
    assert tiled_topk(lambda rows, a, b: scores[rows, a:b], torch.zeros(3, dtype=torch.long), 4, 2).shape == (3, 0)


def test_indexer_scores_do_not_depend_on_the_tile(tiny_model):
    """The premise of tiling: an entry's score is bit-identical however the keys and queries are split."""
    idx = tiny_model.layers[tiny_model.cfg.csa_layers[0]].attn.indexer
    assert isinstance(idx, Indexer)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(150, idx.n_heads, idx.head_dim, generator=g)
    w = torch.randn(150, idx.n_heads, generator=g)
    keys = torch.randn(1100, idx.head_dim, generator=g)
    full = idx.scores(q, w, keys)
    for step in (1, 7, 64, 100, 512):
        n = 150 if step < 64 else 1100  # one-entry calls take BLAS's matrix-vector path: the case to cover
        assert torch.equal(torch.cat([idx.scores(q, w, keys[a : min(a + step, n)]) for a in range(0, n, step)], 1), full[:, :n])
    for rows in (1, 13, score_block(512)):
        assert torch.equal(torch.cat([idx.scores(q[a : a + rows], w[a : a + rows], keys) for a in range(0, 150, rows)]), full)


def test_tiled_indexer_picks_what_the_untiled_one_picks(tiny_model):
    """Real indexer scores (near-ties included) over 2,000 entries: same ids, in the same order."""
    idx = tiny_model.layers[tiny_model.cfg.csa_layers[0]].attn.indexer
    g = torch.Generator().manual_seed(1)
    q = torch.randn(512, idx.n_heads, idx.head_dim, generator=g)
    w = torch.randn(512, idx.n_heads, generator=g)
    counts = prefix_counts(512, 7488)
    keys = torch.randn(int(counts[-1]), idx.head_dim, generator=g)
    keys[100:140] = keys[50]  # exact duplicates: equal scores
    visible = torch.arange(keys.shape[0])[None, :] < counts[:, None]
    want = select_topk(idx.scores(q, w, keys), visible, idx.topk)
    got = tiled_topk(lambda rows, a, b: idx.scores(q[rows], w[rows], keys[a:b]), counts, idx.topk, 256, score_block=64)
    assert torch.equal(got, want)
    assert bool((want >= 0).all())


def test_topk_keys_keeps_leading_shape():
    scores = tied_scores(6, 300, seed=3).view(2, 3, 300)
    visible = torch.ones_like(scores, dtype=torch.bool)
    got = topk_keys(scores, visible, 8)
    assert got.shape == (2, 3, 8)
    assert torch.equal(got.view(6, 8), brute_force(scores.view(6, 300), torch.full((6,), 300), 8))
