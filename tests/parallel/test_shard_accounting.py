"""The planner's per-rank weight figures are the runtime's: for every layout, the parameters a rank's
shard holds after the loader read it equal what `hisparse plan --layout` counts for that rank."""

from __future__ import annotations

import dataclasses

import pytest

from cachetier.planner import estimate_weights
from core.parallel import ParallelLayout
from model.builtin import random_init, tiny_config
from model.loader import build_empty, load_model, save_checkpoint


def _numel(model) -> int:
    return sum(t.numel() for t in (*model.parameters(), *model.buffers()))


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    cfg = dataclasses.replace(tiny_config(), name="synthetic-8h", num_heads=8, o_groups=4, n_routed_experts=8)
    model = build_empty(cfg)
    random_init(model, 3)
    d = tmp_path_factory.mktemp("wide")
    save_checkpoint(model, d)
    return d


@pytest.mark.parametrize("which,layout", [
    ("tiny", "dp1"), ("tiny", "dp2+ep2"), ("tiny", "tp2"), ("tiny", "dp4+ep4"),
    ("wide", "tp4"), ("wide", "dp2xtp2+ep4"), ("wide", "dp8+ep8"),
])
def test_rank_parameters_match_the_planner(which, layout, tiny_dir, wide_dir):
    model_dir = tiny_dir if which == "tiny" else wide_dir
    parsed = ParallelLayout.parse(layout)
    whole = load_model(model_dir)
    planned = estimate_weights(whole.cfg, 0, "dequantize", parsed).served_params
    for rank in {0, parsed.world - 1}:
        assert _numel(load_model(model_dir, shard=parsed.shard(rank))) == planned
    if not parsed.single and (parsed.expert_parallel or parsed.tp > 1):
        assert planned < _numel(whole)


@pytest.mark.parametrize("layout", ["dp1", "dp2+ep2", "tp2", "dp4+ep4"])
def test_a_rank_s_mtp_block_matches_the_planner(layout, tiny_dir):
    """The built-in model's MTP head, split like a layer on each rank, holds what the planner counts for one
    MTP block on that rank."""
    parsed = ParallelLayout.parse(layout)
    cfg = load_model(tiny_dir).cfg
    planned = estimate_weights(cfg, 1, "dequantize", parsed).mtp_params
    for rank in {0, parsed.world - 1}:
        model = load_model(tiny_dir, shard=parsed.shard(rank), mtp=True)
        assert model.mtp is not None and _numel(model.mtp) == planned
