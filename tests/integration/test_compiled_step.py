"""The compiled decode step against HF `transformers` and the eager step, through the tiered store.

A random two-layer HF model (a CSA layer with a hash-routed MoE, an HCA layer with a routed one: every
kind of compressed attention and MoE the step has) saved by HF and loaded by our loader; two requests
of different lengths decoding greedily side by side, HF decoding each alone. Two layers, not the
built-in four, because Inductor's first compile grows with the layers (about 40 s here against 85 s).
With the tier on (a hot buffer small enough to miss) the step runs through Inductor, compiled once
for the module (its on-disk cache makes later runs quick); with the tier off it is captured with
the `eager` backend. Logits stay within 1e-4 of HF and the greedy tokens are HF's, compiled and
eager alike.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_reference import hf_and_ours  # noqa: E402

from cachetier.store import TieredStore  # noqa: E402
from core.configs import StepConfig, TierConfig  # noqa: E402
from decode.runner import StepRunner  # noqa: E402

TOL = 1e-4
PROMPTS = (37, 290)  # one context block and two: the bucket is (2 rows, 2 blocks) for every step
STEPS = 24
SPEC = dict(layers=["csa", "hca"], window=8, hca=8, topk=4, hc=2, mlp=["hash_moe", "moe"])


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(HF model, our model loaded from HF's save_pretrained directory)."""
    return hf_and_ours(SPEC, 5, tmp_path_factory.mktemp("hf-step"))


@pytest.fixture(scope="module")
def hf_greedy(pair):
    """Per request: HF's logits of every decode step [STEPS, vocab] and its greedy tokens, from a 1-token-at-a-time run."""
    hf, ours = pair
    g = torch.Generator().manual_seed(12)
    out = []
    with torch.no_grad():
        for n in PROMPTS:
            prompt = torch.randint(6, ours.cfg.vocab_size, (1, n), generator=g)
            r = hf(prompt, use_cache=True)
            tokens, logits, pkv = [int(r.logits[0, -1].argmax())], [], r.past_key_values
            for _ in range(STEPS):
                r = hf(torch.tensor([[tokens[-1]]]), past_key_values=pkv, use_cache=True)
                pkv = r.past_key_values
                logits.append(r.logits[0, -1])
                tokens.append(int(r.logits[0, -1].argmax()))
            out.append((prompt[0].tolist(), torch.stack(logits), tokens))
    return out


def _decode(model, hf_greedy, offload: bool, step: StepConfig):
    """Our greedy decode of the same prompts through a runner: (logits [requests, STEPS, vocab], tokens, runner, store)."""
    cfg = model.cfg
    store = TieredStore(cfg, TierConfig(offload=offload, hot_buffer_slots=cfg.index_topk, reserved_slots=2,
                                        device_budget_bytes=16 * 2**20, host_pool_bytes=16 * 2**20))
    runner = StepRunner(model, store, max_running=4, cfg=step)
    ids, last = [], []
    for i, (prompt, _, _) in enumerate(hf_greedy):
        logits, layout = model.prefill(prompt, last_only=True)
        store.admit(f"r{i}", layout, len(prompt) + STEPS + 1)
        ids.append(f"r{i}")
        last.append(int(logits[0].argmax()))
    tokens = [[t] for t in last]
    steps = []
    for _ in range(STEPS):
        logits = runner.run(ids, [t[-1] for t in tokens])
        steps.append(logits)
        for t, row in zip(tokens, logits):
            t.append(int(row.argmax()))
    store.check_integrity()
    return torch.stack(steps, dim=1), tokens, runner, store


@pytest.mark.parametrize(
    "offload, step",
    [
        # Inductor's first compile of the step is most of a minute; its on-disk cache makes reruns quick
        pytest.param(True, StepConfig(decode_mode="compiled", warmup=False), marks=pytest.mark.slow),
        (False, StepConfig(decode_mode="compiled", compile_backend="eager", warmup=False)),
        (True, StepConfig(decode_mode="eager")),
    ],
    ids=["tier_on_inductor", "tier_off_captured", "tier_on_eager"],
)
def test_step_matches_hf(pair, hf_greedy, offload, step):
    logits, tokens, runner, store = _decode(pair[1], hf_greedy, offload, step)
    for b, (_, ref_logits, ref_tokens) in enumerate(hf_greedy):
        assert (logits[b] - ref_logits).abs().max().item() <= TOL, f"request {b}"
        assert tokens[b] == ref_tokens, f"request {b}"
    if step.decode_mode == "compiled":
        assert runner.mode == "compiled"
        assert runner.steps_by_bucket == {(2, 2): STEPS}
        assert runner.compiles == 1  # compiled at the first step, never again in its bucket
    if offload:
        totals = store.counter_totals()
        assert totals["misses"] > 0 and totals["hits"] > 0 and totals["bytes_d2h"] > 0
