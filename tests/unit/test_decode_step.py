"""The fixed-shape decode step's parts: bucket rules, the static MoE dispatch, padded rows doing no harm."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cachetier.buckets import batch_bucket, batch_buckets, context_blocks, gather_len
from cachetier.store import TieredStore
from core.config import ModelConfig
from core.configs import StepConfig, TierConfig


def test_bucket_rules():
    assert [batch_bucket(n, 12) for n in (1, 2, 3, 5, 8, 9, 12)] == [1, 2, 4, 8, 8, 12, 12]
    assert batch_buckets(12) == [1, 2, 4, 8, 12] and batch_buckets(1) == [1]
    with pytest.raises(ValueError, match="max_running"):
        batch_bucket(13, 12)
    # context grows a token per step; the bucket moves only at powers of two of blocks
    assert [context_blocks(t, 256) for t in (1, 256, 257, 512, 513, 1024, 1025, 5000)] == [1, 1, 2, 2, 4, 4, 8, 32]
    assert gather_len(4, 256, 4) == 256 and gather_len(4, 256, 128) == 8


def _loop_experts(experts, x, idx, weights):
    """The obvious per-expert loop (reads expert ids back to the host): what the static dispatch must equal."""
    out = torch.zeros_like(x)
    for e in torch.unique(idx).tolist():
        tok, slot = torch.where(idx == e)
        gate, up = F.linear(x[tok], experts.gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate.clamp(max=experts.limit)) * up.clamp(-experts.limit, experts.limit), experts.down[e])
        out.index_add_(0, tok, y * weights[tok, slot, None])
    return out


@pytest.mark.parametrize("tokens", [1, 2, 16])  # pairs below and above the number of experts
def test_static_moe_equals_the_per_expert_loop(tokens):
    from model.layers import Experts

    cfg = ModelConfig(vocab_size=10, hidden_size=32, layer_types=("sliding",), num_heads=2, head_dim=16, rope_head_dim=4,
                      q_lora_rank=8, o_groups=1, o_lora_rank=8, sliding_window=4, n_routed_experts=6,
                      num_experts_per_tok=2, moe_intermediate_size=24, swiglu_limit=1.0)
    g = torch.Generator().manual_seed(tokens)
    experts = Experts(cfg)
    with torch.no_grad():
        experts.gate_up.copy_(torch.randn(experts.gate_up.shape, generator=g))
        experts.down.copy_(torch.randn(experts.down.shape, generator=g))
        x = torch.randn(tokens, 32, generator=g)
        idx = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(tokens)])
        weights = torch.rand(tokens, 2, generator=g)
        got = experts(x, idx, weights)
        want = _loop_experts(experts, x, idx, weights)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def _store_with(model, prompts):
    store = TieredStore(model.cfg, TierConfig(offload=True, hot_buffer_slots=model.cfg.index_topk, reserved_slots=2,
                                              device_budget_bytes=8 * 2**20, host_pool_bytes=8 * 2**20))
    # The host pool is allocated uninitialised (a real one is far too large to clear); zero this small one so
    # that the rows no request wrote compare equal between the two stores.
    store.hot.host.kv.zero_()
    for i, p in enumerate(prompts):
        _, layout = model.prefill(p, last_only=True)
        store.admit(f"r{i}", layout, len(p) + 40)
    return store


def test_padded_rows_write_only_scratch(tiny_model):
    """The same three requests decoded in a view of 3 rows and in one of 8: the same logits, and outside
    the scratch group / page / host block the same store contents, step after step."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(6, tiny_model.cfg.vocab_size, (n,), generator=g).tolist() for n in (9, 61, 130)]
    exact, padded = _store_with(tiny_model, prompts), _store_with(tiny_model, prompts)
    geo = exact.geo
    real_arena = geo.num_pages * geo.page_elems
    ids = ["r0", "r1", "r2"]
    tokens = [7, 8, 9]
    with torch.inference_mode():
        for _ in range(12):  # crosses C4 emissions of every request
            outs = []
            for store, rows in ((exact, 3), (padded, 8)):
                view = store.step_view(ids, rows, tokens=tokens)
                outs.append(tiny_model.decode_forward(view, view.token_ids)[:3])
                view.advance()
            assert torch.allclose(outs[0], outs[1], atol=1e-5)
            tokens = outs[0].argmax(-1).tolist()
            assert torch.allclose(exact.arena[:real_arena], padded.arena[:real_arena], atol=1e-5)
            host_rows = geo.num_host_blocks * geo.e4
            assert torch.allclose(exact.hot.host.kv[:, :host_rows], padded.hot.host.kv[:, :host_rows], atol=1e-5)
            for j in range(len(geo.csa_layers)):
                assert torch.equal(exact.hot.entry_map[j][: geo.num_pages * geo.e4], padded.hot.entry_map[j][: geo.num_pages * geo.e4])
                assert torch.equal(exact.hot.hot_entry_row[j][:-1], padded.hot.hot_entry_row[j][:-1])
                assert torch.equal(exact.hot.hot_stamp[j][:-1], padded.hot.hot_stamp[j][:-1])
    assert torch.equal(exact.hot.counters, padded.hot.counters) and exact.hot.counters[:, 1].sum() > 0
    exact.check_integrity()
    padded.check_integrity()


def test_compiled_mode_on_plain_layouts_decodes_eagerly(tiny_model):
    from cachetier.store import LayoutStore
    from decode.runner import StepRunner

    runner = StepRunner(tiny_model, LayoutStore(tiny_model.cfg), 4, StepConfig(decode_mode="compiled"))
    assert runner.mode == "eager" and not runner.fixed
    with pytest.raises(ValueError, match="decode_mode"):
        StepConfig(decode_mode="graphs")


def test_auto_compiles_once_before_serving_and_never_inside_a_step(tiny_model):
    """`--decode-mode auto` on the CPU: one graph, symbolic in rows and blocks, compiled by `warmup` (before the
    worker is ready); steps over many buckets afterwards run it without compiling again. (The `eager` backend
    keeps the compile quick; what it captures is what Inductor compiles.)"""
    from decode.runner import StepRunner

    store = TieredStore(tiny_model.cfg, TierConfig(hot_buffer_slots=16, device_budget_bytes=8 * 2**20,
                                                   host_pool_bytes=16 * 2**20, max_running=8))
    runner = StepRunner(tiny_model, store, 8, StepConfig(compile_backend="eager"))
    assert runner.mode == "compiled"
    runner.warmup()
    assert runner.compiles == 1 and runner.compile_log == [(2, 2)]  # at start-up, on scratch rows
    g = torch.Generator().manual_seed(3)
    ids = []
    for i, n in enumerate((5, 300, 700, 40, 1100, 9, 20)):  # contexts of 1 to 8 blocks
        prompt = torch.randint(6, tiny_model.cfg.vocab_size, (n,), generator=g).tolist()
        _, layout = tiny_model.prefill(prompt, last_only=True)
        store.admit(f"r{i}", layout, n + 8)
        ids.append(f"r{i}")
    for rows in (1, 2, 3, 5, 7):  # row buckets 2, 4 and 8, block buckets 2, 4 and 8
        for _ in range(2):
            runner.run(ids[:rows], [7] * rows)
    assert {r for r, _ in runner.steps_by_bucket} == {2, 4, 8} and {b for _, b in runner.steps_by_bucket} >= {2, 4, 8}
    assert runner.compiles == 1 and runner.eager_steps == 0  # no step compiled, none fell back to eager
    for rid in ids:
        store.free(rid)
    store.check_integrity()
