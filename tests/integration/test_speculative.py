"""Speculative decoding through the decode worker: the tokens are spec-off's, greedy and sampled, tier on and off.

The built-in model with its trained MTP head decodes held-out prompts with `TierConfig.speculative_tokens` 0 and 3
side by side (eager steps; one compiled case with Dynamo's eager backend, which captures the whole step in one
graph). Every event (request, token index, token, finish reason) must be the same. Sampled requests draw with the
sampler's counter-based noise keyed by (seed, token index), and the speculative step accepts a draft only where it
equals what the target sampler draws there, so a seeded request gives the same tokens with speculation on or off;
a chi-square test on a small vocabulary (six allowed tokens) checks the speculative positions' tokens against the
model's own distribution. Requests the speculative step does not cover (penalties, log-probabilities, grammars)
take plain steps, with the same output. The adaptive draft count and the refusals are checked here too.
"""

from __future__ import annotations

import math

import pytest
import torch

from cachetier.store import TieredStore
from core.configs import StepConfig, TierConfig
from core.types import SampledToken, SamplingParams
from decode.speculative import DraftPolicy
from decode.worker import DecodeRequest, DecodeWorker

pytestmark = pytest.mark.usefixtures("one_torch_thread")

N = 3


@pytest.fixture(scope="module")
def spec_model(tiny_dir):
    from model.loader import load_model

    return load_model(tiny_dir, mtp=True)


@pytest.fixture(scope="module")
def prompts(tiny_dir):
    from bench.trained import held_out_prompts
    from model.tokenizer import load_tokenizer

    return [p for _, p in held_out_prompts(load_tokenizer(tiny_dir), 4, 120)]


def _run(model, prompts, params, n, offload=True, step=None, seeds=None, **tier):
    tier = TierConfig(offload=offload, speculative_tokens=n, device_budget_bytes=64 << 20, reserved_slots=2, **tier)
    store = TieredStore(model.cfg, tier, dtype=model.dtype)
    w = DecodeWorker(model, store, max_running=16,
                     step_config=step or StepConfig(decode_mode="eager", speculative_adaptive=False))
    with torch.inference_mode():
        for i, (p, sp) in enumerate(zip(prompts, params)):
            logits, lay = model.prefill(p, last_only=True)
            first = SampledToken(int(logits[-1].argmax()))
            w.submit(DecodeRequest.fresh(f"r{i}", lay, first, sp, seed=seeds[i] if seeds else 100 + i, prompt_token_ids=p))
    events = []
    while w.has_work():
        events.extend((e.request_id, e.index, e.token.token_id, e.finish_reason) for e in w.step())
    w.check_integrity()
    return sorted(events), w.stats()


@pytest.mark.parametrize("offload", [True, False], ids=["tier_on", "tier_off"])
def test_greedy_tokens_are_spec_offs(spec_model, prompts, offload):
    eos = spec_model.cfg.eos_token_ids
    params = [SamplingParams(max_tokens=25 + 9 * i, stop_token_ids=(13,) if i == 1 else ()) for i in range(len(prompts))]
    off, _ = _run(spec_model, prompts, params, 0, offload)
    on, stats = _run(spec_model, prompts, params, N, offload)
    assert on == off
    spec = stats["speculation"]
    assert spec["steps"] > 0 and spec["acceptance_length"] > 1.2, spec  # it kept drafts, not one token a step
    assert stats["steps"] < len(off) / len(prompts), "speculation did not take fewer steps than tokens"
    assert any(r == "length" for *_, r in on) and eos is not None


def test_sampled_tokens_are_spec_offs(spec_model, prompts):
    params = [SamplingParams(max_tokens=30, temperature=0.8, top_p=0.95),
              SamplingParams(max_tokens=24, temperature=1.0, top_k=40, logit_bias={13: 3.0}),
              SamplingParams(max_tokens=20, temperature=0.7, min_tokens=10),
              SamplingParams(max_tokens=28)]
    off, _ = _run(spec_model, prompts, params, 0)
    on, stats = _run(spec_model, prompts, params, N)
    assert on == off
    assert stats["speculation"]["steps"] > 0


def test_requests_it_does_not_cover_take_plain_steps(spec_model, prompts):
    """Penalties read the token history and log-probabilities are per token: such a batch takes plain steps."""
    params = [SamplingParams(max_tokens=16, temperature=0.8, frequency_penalty=0.5),
              SamplingParams(max_tokens=16, logprobs=2)] + [SamplingParams(max_tokens=16)] * 2
    off, _ = _run(spec_model, prompts, params, 0)
    on, stats = _run(spec_model, prompts, params, N)
    assert on == off
    assert stats["speculation"]["steps"] == 0


def test_the_compiled_speculative_step_gives_the_same_tokens(spec_model, prompts):
    """The fixed-shape step padded to buckets, captured whole by Dynamo (fullgraph: a graph break would raise)."""
    params = [SamplingParams(max_tokens=20 + 5 * i) for i in range(3)]
    off, _ = _run(spec_model, prompts[:3], params, 0)
    step = StepConfig(decode_mode="compiled", compile_backend="eager", speculative_adaptive=False)
    on, stats = _run(spec_model, prompts[:3], params, 1, step=step)
    assert on == off
    assert stats["step"].mode == "compiled" and stats["step"].eager_steps == 0
    assert stats["speculation"]["steps"] > 0


def test_speculative_positions_draw_from_the_models_distribution(spec_model, prompts):
    """Six allowed tokens, temperature 1, 300 seeds of one prompt, 4 tokens each: index 1 comes from the first
    speculative step (no drafts yet), index 2 from the second step's position 0 and index 3 from its position 1,
    where the draft was verified (kept when it equals what the target draws there). The frequencies of index 1, and
    of index 3 after the most common (index 1, index 2), must fit the model's probabilities (chi-square, p > 0.001)."""
    allowed = (19, 13, 271, 486, 821, 543)
    n = 300
    sp = SamplingParams(max_tokens=4, temperature=1.0, allowed_token_ids=allowed, ignore_eos=True)
    prompt = prompts[0][:60]
    events, stats = _run(spec_model, [prompt] * n, [sp] * n, 2, seeds=list(range(n)), max_running=64)
    assert stats["speculation"]["acceptance_length"] > 1.0  # drafts were kept at position 1
    by = {}
    for rid, index, tok, _ in events:
        by.setdefault(rid, {})[index] = tok
    assert all(sorted(by[r]) == [1, 2, 3] for r in by)
    with torch.inference_mode():
        logits, lay = spec_model.prefill(prompt, last_only=True)
        first = int(logits[-1].argmax())
        _fits([by[r][1] for r in by], _allowed_probs(spec_model.decode_layouts([lay.clone()], [first])[0], allowed), allowed)
        pairs = [(by[r][1], by[r][2]) for r in by]
        common = max(set(pairs), key=pairs.count)
        lay2 = lay.clone()
        spec_model.decode_layouts([lay2], [first])
        spec_model.decode_layouts([lay2], [common[0]])
        probs3 = _allowed_probs(spec_model.decode_layouts([lay2], [common[1]])[0], allowed)
    _fits([by[r][3] for r in by if (by[r][1], by[r][2]) == common], probs3, allowed)


def _allowed_probs(logits: torch.Tensor, allowed) -> list[float]:
    return torch.softmax(logits.float()[list(allowed)], dim=-1).tolist()


def _fits(samples: list[int], probs: list[float], allowed) -> None:
    """Chi-square goodness of fit, cells with expected count < 5 pooled; fails below p = 0.001."""
    n = len(samples)
    cells = [(sum(s == t for s in samples), p * n) for t, p in zip(allowed, probs)]
    big = [c for c in cells if c[1] >= 5]
    small = [c for c in cells if c[1] < 5]
    if small:
        big.append((sum(c[0] for c in small), sum(c[1] for c in small)))
    stat = sum((o - e) ** 2 / e for o, e in big)
    dof = len(big) - 1
    assert dof >= 1 and n >= 40, (cells, n)
    assert stat < _chi2_critical(dof), f"chi-square {stat:.1f} with {dof} dof: {cells}"


def _chi2_critical(dof: int) -> float:
    """The p = 0.001 critical value of chi-square (Wilson-Hilferty)."""
    z = 3.0902
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


# --- the adaptive draft count ----------------------------------------------------------------------------


def test_the_policy_drafts_when_it_pays_and_stops_when_it_does_not():
    def settle(cost_of, kept_fraction, steps=400, bucket=8):
        p = DraftPolicy(3, adaptive=True, probe=2, explore_every=1000)
        for _ in range(steps):
            n = p.choose(bucket)
            d = [n] * bucket
            a = [min(n, int(kept_fraction * (n + 1))) for _ in range(bucket)]
            p.record(bucket, n, cost_of(n), d if n else None, a if n else None)
        return max(p.choices[bucket], key=p.choices[bucket].get)

    # an overhead-bound step: verifying 4 positions costs little more than 1, drafts are mostly kept
    assert settle(lambda n: 1.0 + 0.05 * n, 0.9) == 3
    # a compute-bound step (high batch): the cost grows with the positions verified faster than the tokens kept
    assert settle(lambda n: 1.0 + 1.0 * n, 0.5) == 0
    p = DraftPolicy(3, adaptive=False)
    assert {p.choose(4) for _ in range(10)} == {3}


# --- refusals ----------------------------------------------------------------------------------------------


def test_a_model_without_a_head_is_refused(tiny_model):
    store = TieredStore(tiny_model.cfg, TierConfig(speculative_tokens=2, device_budget_bytes=16 << 20))
    with pytest.raises(ValueError, match="MTP head"):
        DecodeWorker(tiny_model, store, step_config=StepConfig(decode_mode="eager"))


def test_a_hot_buffer_too_small_for_the_union_is_refused(tiny_model):
    k = tiny_model.cfg.index_topk
    with pytest.raises(ValueError, match=r"at least 48"):
        TieredStore(tiny_model.cfg, TierConfig(speculative_tokens=2, hot_buffer_slots=2 * k, device_budget_bytes=16 << 20))
    store = TieredStore(tiny_model.cfg, TierConfig(speculative_tokens=2, device_budget_bytes=16 << 20))
    assert store.geo.lru == 3 * k and store.geo.mtp_slots == tiny_model.cfg.sliding_window + 2
