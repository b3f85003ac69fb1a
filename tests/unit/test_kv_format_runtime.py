"""Packed KV (`v4`) equals the dense reference numerics (`v4-dense`): prefill, decode, tier on and off.

The reference applies every v4 rounding where rows are made and keeps them in the compute dtype; the
packed runtime stores the bytes (layout, arena, host pool, hot buffers) and dequantizes where it reads.
Both read the same values, so on the CPU the logits agree to fp32 rounding and greedy tokens are equal.
"""

from __future__ import annotations

import pytest
import torch

from cachetier.layout import pack_layout, unpack_layout
from cachetier.store import LayoutStore, TieredStore
from core.configs import TierConfig
from core.kv_format import fp4_key_bytes, fp8_main_row_bytes
from core.request import Attempt, Request
from model.loader import load_model

PROMPTS = (40, 133)
STEPS = 40
TOL = 1e-4
"""Largest |logit difference| allowed between the packed runtime and the dense reference (fp32 CPU;
observed: 0 on plain layouts, ~1e-6 through the tiered store)."""


@pytest.fixture(scope="module")
def models(tiny_dir):
    return {fmt: load_model(tiny_dir, kv_format=fmt) for fmt in ("bf16", "v4-dense", "v4")}


def _prompts(cfg):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(6, cfg.vocab_size, (n,), generator=g).tolist() for n in PROMPTS]


def _run(model, store, chunk=None):
    """Prefill every prompt (in chunks of `chunk`), admit, greedy-decode STEPS tokens as one batch."""
    rids, toks, prefill_logits = [], [], []
    for i, ids in enumerate(_prompts(model.cfg)):
        layout = None
        for a in range(0, len(ids), chunk or len(ids)):
            logits, layout = model.prefill(ids[a : a + (chunk or len(ids))], layout, last_only=True)
        prefill_logits.append(logits[-1])
        layout = unpack_layout(pack_layout(layout, "test"))  # through the handoff's byte buffer
        store.admit(f"r{i}", layout, len(ids) + STEPS + 1)
        rids.append(f"r{i}")
        toks.append(int(logits[-1].argmax()))
    out, all_logits = [toks], []
    for _ in range(STEPS):
        logits = model.decode_step(store.batch(rids), toks)
        all_logits.append(logits)
        toks = logits.argmax(-1).tolist()
        out.append(toks)
    store.check_integrity()
    return torch.stack(prefill_logits), torch.stack(all_logits), out, store


def _stores(cfg):
    small_hot = TierConfig(offload=True, hot_buffer_slots=cfg.index_topk, reserved_slots=2,
                           device_budget_bytes=16 * 2**20, host_pool_bytes=16 * 2**20)
    return {"plain": LayoutStore(cfg), "tier_off": TieredStore(cfg, TierConfig(offload=False, device_budget_bytes=16 * 2**20)),
            "tier_on": TieredStore(cfg, small_hot)}


def test_packed_runtime_equals_dense_reference(models):
    ref_pre, ref_dec, ref_tok, _ = _run(models["v4-dense"], LayoutStore(models["v4-dense"].cfg))
    bf_pre = torch.stack([models["bf16"].prefill(ids, last_only=True)[0][-1] for ids in _prompts(models["bf16"].cfg)])
    assert (ref_pre - bf_pre).abs().max() > 1e-3  # the roundings are real: v4 numerics differ from bf16 ones
    for name, store in _stores(models["v4"].cfg).items():
        pre, dec, tok, store = _run(models["v4"], store)
        assert tok == ref_tok, name
        assert float((pre - ref_pre).abs().max()) <= TOL, name
        assert float((dec - ref_dec).abs().max()) <= TOL, name
        if name == "tier_on":
            stats = store.stats()
            assert stats["misses"] > 0  # the hot buffer was small enough to miss
            assert stats["bytes_h2d"] >= stats["misses"] * fp8_main_row_bytes(64, 8)


def test_packed_prefill_in_chunks_equals_dense(models):
    ref_pre, ref_dec, ref_tok, _ = _run(models["v4-dense"], LayoutStore(models["v4-dense"].cfg), chunk=50)
    pre, dec, tok, _ = _run(models["v4"], LayoutStore(models["v4"].cfg), chunk=50)
    assert tok == ref_tok
    assert float((dec - ref_dec).abs().max()) <= TOL


def test_packed_layout_and_arena_hold_bytes(models):
    cfg = models["v4"].cfg
    _, layout = models["v4"].prefill(_prompts(cfg)[1])
    main, idx = fp8_main_row_bytes(cfg.head_dim, cfg.rope_head_dim), fp4_key_bytes(cfg.index_head_dim)
    csa = next(lk for lk in layout.layers if lk.kind == "csa")
    assert csa.window.dtype == torch.uint8 and csa.window.shape == (cfg.sliding_window, main)
    assert csa.entries.dtype == torch.uint8 and csa.entries.shape[1] == main
    assert csa.index_keys.shape[1] == idx
    assert csa.compressor.kv.dtype == torch.float32  # compressor state keeps the compute dtype
    store = TieredStore(cfg, TierConfig(offload=True, device_budget_bytes=16 * 2**20, host_pool_bytes=16 * 2**20))
    assert store.arena.dtype == torch.uint8 and store.hot.host.kv.dtype == torch.uint8 and store.hot.host.kv.shape[-1] == main
    # a layout in another format is refused, not misread
    _, plain_layout = models["bf16"].prefill(_prompts(cfg)[0])
    with pytest.raises(ValueError, match="formats differ"):
        store.admit("x", plain_layout, 100)


@pytest.mark.parametrize("offload", [True, False], ids=["tier_on", "tier_off"])
def test_captured_step_with_packed_kv_equals_eager(models, offload):
    """The fixed-shape step captured whole (`torch.compile(fullgraph=True)`, eager backend) with packed rows:
    no graph break (no host sync, no data-dependent shape) and the eager step's logits."""
    from core.configs import StepConfig
    from decode.runner import StepRunner

    model = models["v4"]
    cfg = model.cfg
    out = {}
    for mode in ("eager", "compiled"):
        store = TieredStore(cfg, TierConfig(offload=offload, hot_buffer_slots=cfg.index_topk, reserved_slots=2,
                                            device_budget_bytes=16 * 2**20, host_pool_bytes=16 * 2**20))
        step = StepConfig(decode_mode=mode, compile_backend="eager", warmup=False)
        runner = StepRunner(model, store, max_running=4, cfg=step)
        toks = []
        for i, ids in enumerate(_prompts(cfg)[:2]):
            logits, layout = model.prefill(ids, last_only=True)
            store.admit(f"r{i}", layout, len(ids) + 13)
            toks.append(int(logits[-1].argmax()))
        steps = []
        for _ in range(12):
            logits = runner.run(["r0", "r1"], toks)
            steps.append(logits)
            toks = logits.argmax(-1).tolist()
        store.check_integrity()
        out[mode] = torch.stack(steps)
        if mode == "compiled":
            assert runner.mode == "compiled" and runner.compiles == 1
    assert float((out["compiled"] - out["eager"]).abs().max()) <= TOL


def test_prefix_cache_holds_packed_rows(models):
    """Prefill resumed from cached packed pages and state equals a cold packed prefill (same bytes, same logits)."""
    from core.configs import PrefillConfig, PrefixCacheConfig
    from core.types import SamplingParams
    from prefill.worker import PrefillWorker

    model = models["v4"]
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(6, model.cfg.vocab_size, (130,), generator=g).tolist()
    a, b = shared + [7, 8, 9, 10], shared + [11, 12, 13]
    sp = SamplingParams(max_tokens=4, temperature=0.0)

    def prefill(worker, tokens, rid):
        worker.submit(Attempt.of(Request(rid, tuple(tokens), sp, 1)))
        out = []
        while worker.has_work():
            out += worker.step()
        return out[0]

    cold = prefill(PrefillWorker(model, PrefillConfig(max_batch_tokens=512)), b, "cold")
    cached = PrefillWorker(model, PrefillConfig(max_batch_tokens=512,
                                                prefix_cache=PrefixCacheConfig(enabled=True, page_tokens=64)))
    prefill(cached, a, "a")
    warm = prefill(cached, b, "b")
    assert cached.prefix_cache.stats().hit_tokens >= 128
    assert warm.first_token.token_id == cold.first_token.token_id
    for lc, lw in zip(cold.layout.layers, warm.layout.layers):
        assert lw.window.dtype == torch.uint8 and torch.equal(lc.window, lw.window)
        if lc.entries is not None:
            assert torch.equal(lc.entries, lw.entries)
        if lc.index_keys is not None:
            assert torch.equal(lc.index_keys, lw.index_keys)
