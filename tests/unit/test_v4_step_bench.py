"""`bench.v4_step` at a tiny size on the CPU, through its `bench.gpu_check` check: every column is there and the
figures agree with each other and with the floor's arithmetic done here by hand; the profiled step is the step."""

from __future__ import annotations

import json

import pytest
import torch

from bench import v4_step as vs
from bench.gpu_check import BY_NAME
from bench.gpu_check_util import Ctx
from bench.gpu_check_v4step import SMALL_SIZES, small_config, v4_step
from bench.tier import synthetic_layout
from cachetier.store import TieredStore
from core.config import CSA, HCA, SLIDING
from decode.runner import _forward
from model.realformat import random_packed_model


@pytest.fixture
def one_thread():
    # the shared CPU runs the tiny step ~10x faster without threads contending for it
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        path = tmp_path_factory.mktemp("v4step") / "result.json"
        ctx = Ctx("cpu", path)
        final = v4_step(ctx)
        ctx.flush(final)
        return ctx, final, json.loads(path.read_text())
    finally:
        torch.set_num_threads(before)


def test_registered_as_a_gpu_check():
    check = BY_NAME["v4_step"]
    assert check.target == "bench.gpu_check_v4step:v4_step" and check.needs_cuda and check.cpu_debug
    assert check.timeout_s >= 90  # the step is sized to about 90 s on an H200


def test_every_column_and_consistent_figures(checked):
    ctx, final, saved = checked
    assert final["ok"] is True and saved["ok"] is True
    # every part was recorded as it was known (what a timed-out run would still report), and saved to the file
    assert set(ctx.results) == {"model", "copy_bandwidth", *(f"context_{c}" for c in SMALL_SIZES.contexts)}
    assert saved["goal"] == final["goal"]
    bw = ctx.results["copy_bandwidth"]
    assert bw["bytes"] == SMALL_SIZES.copy_bytes and bw["bytes_per_s"] > 0
    model = ctx.results["model"]
    assert model["layer_types"] == [SLIDING, CSA, HCA, CSA] and model["kv_format"] == "v4" and model["dtype"] == "bfloat16"
    cfg = small_config()
    for context in SMALL_SIZES.contexts:
        c = ctx.results[f"context_{context}"]
        rows = c["rows"]
        assert rows == SMALL_SIZES.rows and c["step_mode"] == "fixed_eager" and c["finite_logits"]
        assert c["step_ms"] > 0 and len(c["step_ms_each"]) == SMALL_SIZES.steps
        assert c["bucket"]["blocks"] * c["bucket"]["block_tokens"] == context  # the context bucket is the context
        # the floor: both views count the same bytes; time at the measured bandwidth; the fraction in (0, 1]
        fl = c["floor"]
        assert fl["total_bytes"] > 0
        assert fl["total_bytes"] == sum(fl["by_kind"].values()) == sum(p["bytes"] for p in fl["parts"].values())
        assert fl["floor_ms"] == pytest.approx(fl["total_bytes"] / bw["bytes_per_s"] * 1e3, rel=1e-3)
        assert fl["fraction_of_floor"] == pytest.approx(fl["floor_ms"] / c["step_ms"], rel=1e-2, abs=1e-4)
        assert 0 < fl["fraction_of_floor"] <= 1
        # KV bytes by hand: per row the window of every layer, top-k + all indexer keys per CSA layer, all HCA rows
        main, key = fl["kv_per_row"]["main_row_bytes"], fl["kv_per_row"]["index_key_bytes"]
        assert (main, key) == (152, 17)  # v4 rows at 128 / 16 rope: 112 e4m3 + 16 bf16 rope + 8 scales; 32 e2m1 + 1 scale
        c4, hca = context // cfg.csa_rate, context // cfg.hca_rate
        n_csa = cfg.layer_types.count(CSA)
        assert fl["by_kind"]["kv_swa"] == rows * cfg.num_layers * cfg.sliding_window * main
        assert fl["by_kind"]["kv_topk_c4"] == rows * n_csa * min(cfg.index_topk, c4) * main
        assert fl["by_kind"]["kv_index_keys"] == rows * n_csa * c4 * key
        assert fl["by_kind"]["kv_hca"] == rows * hca * main
        per_expert = model["expert_bytes_each"]
        touched = [fl["parts"][f"{i}.moe"]["touched_experts"] for i in range(cfg.num_layers)]
        assert all(1 < t <= cfg.n_routed_experts for t in touched)  # the routing spreads rows over experts
        assert fl["by_kind"]["experts"] == sum(touched) * per_expert
        assert fl["by_kind"]["head"] == cfg.vocab_size * cfg.hidden_size * 2
        # the GPU sizes' arithmetic (a meta model, uniform routing) counts the same bytes but for the experts touched
        planned = vs.planned_floor(cfg, rows, context)
        assert {k: v for k, v in planned["by_kind"].items() if k != "experts"} == \
            {k: v for k, v in fl["by_kind"].items() if k != "experts"}
        assert planned["by_kind"]["experts"] == cfg.num_layers * planned["touched_experts_per_layer"] * per_expert
        # parts: every kind, attention and MoE, each against its own floor; the marked parts fit in the step
        parts = c["parts"]
        assert set(parts["by_kind"]) == {SLIDING, CSA, HCA}
        for kind in parts["by_kind"].values():
            for p in ("attention", "moe"):
                assert kind[p]["ms_per_layer"] > 0 and kind[p]["floor_ms_per_layer"] > 0
                assert kind[p]["x_floor"] == pytest.approx(kind[p]["ms_per_layer"] / kind[p]["floor_ms_per_layer"], rel=2e-2)
        marked = sum(e[p]["ms"] for e in parts["by_layer"] for p in ("attention", "moe")) + parts["head"]["ms"]
        assert marked + parts["other"]["ms"] == pytest.approx(parts["total_ms"], rel=1e-3)
        assert parts["other"]["ms"] > 0
        # kernels: aten ops per step are the parts' ops summed, every part issued some
        k = c["kernels"]
        by_layer = k["aten_ops_by_layer"]
        assert all(e["attention"] > 0 and e["moe"] > 0 for e in by_layer) and k["aten_ops_head"] > 0
        assert k["aten_ops_per_step"] == sum(e["attention"] + e["moe"] for e in by_layer) + k["aten_ops_head"] + k["aten_ops_other"]
        csa = [e["attention"] for e in by_layer if e["kind"] == CSA]
        assert min(csa) > max(e["attention"] for e in by_layer if e["kind"] != CSA)  # the indexer and the resolve
        mem = c["memory"]
        assert mem["peak_rss_bytes"] >= mem["rss_before_bytes"] > 0
        assert c["tier"]["hits"] + c["tier"]["misses"] > 0  # the C4 rows came through the tier
        goal = c["goal"]
        assert goal["worst_part_x_floor"] == max(
            [e[p]["x_floor"] for e in parts["by_kind"].values() for p in ("attention", "moe")] + [parts["head"]["x_floor"]])
        assert goal["met"] is (goal["fraction_of_floor"] >= 0.5 and goal["worst_part_x_floor"] <= 3)


def _state(obj, depth: int = 2) -> list[torch.Tensor]:
    """Every tensor the store holds, and those of the objects it keeps its tier state in (whatever their names)."""
    out = []
    for v in vars(obj).values():
        for t in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(t, torch.Tensor):
                out.append(t)
            elif depth and hasattr(t, "__dict__") and type(t).__module__.startswith("cachetier."):
                out += _state(t, depth - 1)
    return out


def test_the_profiled_step_is_the_step(one_thread):
    cfg = small_config()
    model = random_packed_model(cfg, torch.bfloat16, "cpu")
    store = TieredStore(cfg, vs._tier(cfg, 2, 512, torch.bfloat16), dtype=torch.bfloat16, device="cpu")
    lay = synthetic_layout(cfg, 300)
    for rid in ("a", "b"):
        store.admit(rid, lay, 512)
    view = store.step_view(["a", "b"], 2, tokens=[5, 9])
    state = _state(store)
    before = [t.clone() for t in state]
    marks, routed = vs.Marks(False), {}
    with torch.inference_mode():
        want = _forward(model, view)
        after_step = [t.clone() for t in state]
        for t, b in zip(state, before):
            t.copy_(b)
        got = vs.profiled_forward(model, view, marks, routed)
    assert torch.equal(got, want)  # the same ops in the same order
    assert all(torch.equal(a, t) for a, t in zip(after_step, state))  # and the same writes to the store
    assert any(not torch.equal(a, b) for a, b in zip(after_step, before))  # (which a step does make)
    spans = [(p, i) for p, i, _ in marks.ms()]
    assert spans == [(p, i) for i in range(cfg.num_layers) for p in ("attention", "moe")] + [("head", None)]
    assert sorted(routed) == list(range(cfg.num_layers)) and routed[0].shape == (2, cfg.num_experts_per_tok)
    store.close()
