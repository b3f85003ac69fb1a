"""A replica of real processes (gloo, one thread each) computes what one process computes.

For each layout, every rank loads only its shard of a real safetensors checkpoint through the loader,
then runs the harness workload (see `replica_harness.py`): per DP group its own prompts (uneven; a group may
have none), prefill, 18 greedy decode steps through a tiered store whose hot buffer misses, requests
stopping at different steps (uneven rows, idle ranks). The reference runs each group's schedule with the
whole model in one process.

Checked in this order, so that a near-tie cannot pass for a bug or hide one: the router's and the
indexer's top-k picks equal the reference's; then logits within 1e-4 and identical greedy tokens; then
the tier really missed, and every rank entered the same collectives.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from replica_harness import DECODE_STEPS, run_reference, run_replica

from core.parallel import ParallelLayout
from model.builtin import random_init, tiny_config
from model.loader import build_empty, load_model, save_checkpoint

pytestmark = pytest.mark.timeout(300)

LENGTHS = [[150, 90, 40], [70], [120, 33], []]  # prompts per DP group: uneven, the fourth group has none
SEED = 7


def synthetic_config():
    """Wide enough to split where the built-in model is not: 8 heads, 4 output groups, 8 experts."""
    return dataclasses.replace(tiny_config(), name="synthetic-8h", num_heads=8, o_groups=4, n_routed_experts=8)


@pytest.fixture(scope="module")
def synthetic_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("synthetic-8h")
    model = build_empty(synthetic_config())
    random_init(model, 11)
    save_checkpoint(model, d)
    return d


@pytest.fixture(scope="module")
def packed_dir(tmp_path_factory):
    from model.realformat import write_realformat_checkpoint

    return write_realformat_checkpoint(tmp_path_factory.mktemp("realformat"))


def _check(layout_text: str, model_dir, tmp_path, weights: str = "packed") -> list[dict]:
    layout = ParallelLayout.parse(layout_text)
    whole = load_model(model_dir, weights=weights)
    layout.check(whole.cfg)
    ranks = run_replica(layout_text, str(model_dir), str(tmp_path), LENGTHS, SEED)
    ref = run_reference(whole, layout_text, LENGTHS, SEED)
    for r, got in enumerate(ranks):
        want = ref[layout.coords(r)[0]]
        assert len(got["router"]) == len(want["router"]), f"rank {r}: a different number of routed forwards"
        for a, b in zip(got["router"], want["router"]):
            assert torch.equal(a, b), f"rank {r}: the router picked other experts than one process does"
        assert len(got["index"]) == len(want["index"])
        for a, b in zip(got["index"], want["index"]):
            assert torch.equal(a, b), f"rank {r}: the indexer picked other C4 entries than one process does"
        for a, b in zip(got["prefill"], want["prefill"]):
            assert torch.allclose(a, b, atol=1e-4, rtol=0), f"rank {r}: prefill logits differ by {(a - b).abs().max()}"
        for la, lb in zip(got["logits"], want["logits"]):
            assert len(la) == len(lb)
            for a, b in zip(la, lb):
                assert torch.allclose(a, b, atol=1e-4, rtol=0), f"rank {r}: decode logits differ by {(a - b).abs().max()}"
        assert got["tokens"] == want["tokens"], f"rank {r}: greedy tokens differ"
        assert got["misses"] == want["misses"]
    assert any(got["misses"] > 0 for got in ranks), "the hot buffer never missed: the tier was not exercised"
    calls = [got["stats"]["calls"] for got in ranks]
    assert all(c == calls[0] or layout.tp > 1 for c in calls), f"ranks entered different collectives: {calls}"
    return ranks


@pytest.mark.parametrize("layout", ["dp2", "dp2+ep2", "tp2", "dp4+ep4"])
def test_builtin_model_layouts(layout, tiny_dir, tmp_path):
    ranks = _check(layout, tiny_dir, tmp_path)
    cfg = tiny_config()
    parsed = ParallelLayout.parse(layout)
    stats = ranks[0]["stats"]["calls"]
    steps = stats["meta_all_gather"]  # one row-count gather per forward, prefill included
    assert steps == DECODE_STEPS + 1
    if parsed.expert_parallel:  # two exchanges per MoE layer per forward, on every rank (idle ones too)
        assert stats["ep_all_gather"] == stats["ep_reduce_scatter"] == cfg.num_layers * steps
    else:
        assert "ep_all_gather" not in stats
    if parsed.tp > 1:  # one sum per attention layer per forward that has rows
        assert stats["tp_all_reduce"] % cfg.num_layers == 0 and stats["tp_all_reduce"] > 0
    if parsed.dp == 4:  # the fourth DP group had no request at all (with EP it only ever ran idle forwards)
        assert ranks[3]["tokens"] == []
        if parsed.expert_parallel:
            assert ranks[3]["stats"]["calls"]["ep_all_gather"] == cfg.num_layers * steps


@pytest.mark.parametrize("layout", ["tp4", "dp2xtp2+ep4"])
def test_synthetic_wide_model_layouts(layout, synthetic_dir, tmp_path):
    ranks = _check(layout, synthetic_dir, tmp_path)
    whole_bytes = sum(t.numel() * t.element_size() for t in load_model(synthetic_dir).state_dict().values())
    assert all(r["weight_bytes"] < whole_bytes for r in ranks)


def test_packed_checkpoint_split_on_tiles(packed_dir, tmp_path):
    """FP8 linears cut on 128-wide tiles (TP) and FP4 experts by whole experts (EP), read as slices."""
    _check("tp2+ep2", packed_dir, tmp_path)


def test_rank_shard_holds_only_its_part(synthetic_dir):
    cfg = synthetic_config()
    whole = load_model(synthetic_dir)
    layout = ParallelLayout.parse("dp2xtp2+ep4")
    for rank in range(layout.world):
        shard = layout.shard(rank)
        part = load_model(synthetic_dir, shard=shard)
        first, count = shard.experts(cfg)
        assert part.layers[1].ffn.experts.gate_up.shape[0] == count == 2
        assert torch.equal(part.layers[1].ffn.experts.gate_up, whole.layers[1].ffn.experts.gate_up[first : first + count])
        h0, nh = shard.heads(cfg)
        assert part.layers[2].attn.attn_sink.shape == (nh,)
        assert torch.equal(part.layers[2].attn.attn_sink, whole.layers[2].attn.attn_sink[h0 : h0 + nh])
        g0, ng = shard.groups(cfg)
        cols = slice(g0 * cfg.o_lora_rank, (g0 + ng) * cfg.o_lora_rank)
        assert torch.equal(part.layers[0].attn.wo_b.weight, whole.layers[0].attn.wo_b.weight[:, cols])


def test_split_that_does_not_divide_is_refused(tiny_dir):
    from model.loader import CheckpointError

    with pytest.raises(ValueError, match="must divide"):
        ParallelLayout(tp=4).check(tiny_config())  # 2 output groups
    with pytest.raises(ValueError, match="do not split evenly"):
        ParallelLayout(dp=3, expert_parallel=True).check(tiny_config())
    with pytest.raises(CheckpointError, match="must divide"):
        load_model(tiny_dir, shard=ParallelLayout(tp=4).shard(0))
