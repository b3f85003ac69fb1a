"""Speculative decoding through the decode worker: the tokens are spec-off's, greedy and sampled, tier on and off.

The built-in model with its trained MTP head decodes held-out prompts with `TierConfig.speculative_tokens` 0 and 3
side by side (eager steps; one compiled case with Dynamo's eager backend, which captures the whole step in one
graph). Every event (request, token index, token, finish reason) must be the same. Sampled requests draw with the
sampler's counter-based noise keyed by (seed, token index), and the speculative step accepts a draft only where it
equals what the target sampler draws there, so a seeded request gives the same tokens with speculation on or off;
a chi-square test on a small vocabulary (six allowed tokens) checks the speculative positions' tokens against the
model's own distribution. Constrained requests (each position under the matcher's mask after its drafts), penalised
ones and bad words of several tokens (each position's history with its drafts) and log-probability requests
speculate too, with spec-off's output. The adaptive draft count and the refusals are checked here too.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from cachetier.store import TieredStore
from core.configs import StepConfig, TierConfig
from core.types import SampledToken, SamplingParams
from decode.speculative import DraftPolicy
from decode.worker import DecodeRequest, DecodeWorker
from kernels.resolve_ref import EVICTIONS

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
    tier = TierConfig(**{"offload": offload, "speculative_tokens": n, "device_budget_bytes": 64 << 20, "reserved_slots": 2,
                         **tier})
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


def test_penalty_and_logprob_rows_speculate_beside_plain_ones(spec_model, prompts):
    """A penalised row (it reads its token history) and a log-probability row beside greedy ones: the whole batch
    speculates (no request sends its group to plain steps any more) and gives spec-off's tokens."""
    params = [SamplingParams(max_tokens=16, temperature=0.8, frequency_penalty=0.5),
              SamplingParams(max_tokens=16, logprobs=2)] + [SamplingParams(max_tokens=16)] * 2
    off, _ = _run(spec_model, prompts, params, 0)
    on, stats = _run(spec_model, prompts, params, N)
    assert on == off
    assert stats["speculation"]["steps"] > 0


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


def test_a_fixed_shape_worker_times_its_steps_before_serving(spec_model, prompts):
    """Before its first request, an adaptive fixed-shape worker times the speculative step against the plain one per
    batch bucket (`StepRunner.step_costs`) and seeds its policy with the ratios; the timing runs over padding rows
    only, so no step, forward or eager fallback is counted, and serving gives spec-off's tokens. An eager worker
    times nothing (its step's cost is not its bucket's)."""
    store = TieredStore(spec_model.cfg, TierConfig(speculative_tokens=N, device_budget_bytes=64 << 20), dtype=spec_model.dtype)
    w = DecodeWorker(spec_model, store, max_running=4,
                     step_config=StepConfig(decode_mode="compiled", compile_backend="eager", speculative_adaptive=True))
    seeds = {b: w.policy.buckets[b].seeds for b in w.policy.buckets}
    assert sorted(seeds) == [1, 2, 4] and all(set(s) == {N} and s[N] > 0 for s in seeds.values()), seeds
    assert w.runner.steps_by_bucket == {} and w.runner.idle_forwards == 0 and w.runner.eager_steps == 0
    eager = TieredStore(spec_model.cfg, TierConfig(speculative_tokens=N, device_budget_bytes=64 << 20), dtype=spec_model.dtype)
    assert DecodeWorker(spec_model, eager, step_config=StepConfig(decode_mode="eager")).policy.buckets == {}


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
    # a speculative step that costs more than N + 1 plain ones never pays: past its probes it is never run again
    p = DraftPolicy(3, adaptive=True, probe=2, explore_every=5, counts=[0, 3])
    for _ in range(200):
        n = p.choose(1)
        p.record(1, n, 60.0 if n else 1.0, [n] if n else None, [n] if n else None)
    assert p.choices[1][3] == 2 and p.could_pay(1) == [0]
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


def test_a_plain_step_searches_only_the_slots_a_store_without_speculation_has(spec_model, prompts):
    """A default hot buffer sized for speculative steps ((N + 1) k LRU slots) is searched whole only by them: a plain
    step's misses take victims among the first 2k (`Geometry.plain_lru`), as a store without speculation would, and
    the other slots stay as they were. A size the user gives is searched whole."""
    k = spec_model.cfg.index_topk
    tier = TierConfig(speculative_tokens=N, device_budget_bytes=64 << 20, reserved_slots=2)
    assert TieredStore(spec_model.cfg, dataclasses.replace(tier, hot_buffer_slots=5 * k)).geo.plain_lru == 5 * k
    store = TieredStore(spec_model.cfg, tier, dtype=spec_model.dtype)
    assert (store.geo.lru, store.geo.plain_lru) == ((N + 1) * k, 2 * k)
    w = DecodeWorker(spec_model, store, max_running=4, step_config=StepConfig(decode_mode="eager"))
    w.policy = None  # this worker never speculates: every step is a plain one
    prompt = [t for p in prompts for t in p]  # ~120 C4 entries: more than the 2k slots searched
    with torch.inference_mode():
        logits, lay = spec_model.prefill(prompt, last_only=True)
        w.submit(DecodeRequest.fresh("long", lay, SampledToken(int(logits[-1].argmax())), SamplingParams(max_tokens=48,
                                                                                                         ignore_eos=True), seed=0))
        for _ in range(40):
            w.step()
    group = store.residents["long"].group
    for j in range(len(spec_model.cfg.csa_layers)):
        stamps = store.hot.hot_stamp[j][group]
        assert (stamps[: 2 * k] >= 0).all() and (stamps[2 * k :] == -1).all(), stamps.tolist()
    assert sum(int(c[EVICTIONS]) for c in store.hot.counters) > 0  # the first 2k slots were taken over, not the rest


# --- constrained, penalised and log-probability requests speculate too ------------------------------------------

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9},
                                           "sunny": {"type": "boolean"}},
          "required": ["city", "days", "sunny"], "additionalProperties": False}


@pytest.fixture(scope="module")
def spec_tok(tiny_dir):
    from model.tokenizer import load_tokenizer

    return load_tokenizer(tiny_dir)


@pytest.fixture(scope="module")
def spec_grammar(spec_tok, spec_model):
    from model.grammar import GrammarEngine

    return GrammarEngine(spec_tok, spec_model.cfg.vocab_size, spec_model.cfg.eos_token_ids)


def _events(model, asks, n, grammar=None, max_running=16):
    """Decode `asks` (prompt, params, seed, structure or None) to the end through one worker drafting `n` tokens;
    the first token is drawn as prefill draws it (under the request's grammar) -> (the first tokens, every
    TokenEvent sorted by request and index, the worker's stats)."""
    from core.request import Attempt, Request
    from model.grammar import GrammarMasks
    from model.sampling import sample

    tier = TierConfig(offload=True, speculative_tokens=n, device_budget_bytes=64 << 20, reserved_slots=2)
    w = DecodeWorker(model, TieredStore(model.cfg, tier, dtype=model.dtype), max_running=max_running, grammar=grammar,
                     step_config=StepConfig(decode_mode="eager", speculative_adaptive=False))
    firsts = {}
    with torch.inference_mode():
        for i, (prompt, sp, seed, structure) in enumerate(asks):
            logits, lay = model.prefill(prompt, last_only=True)
            mask = None
            if structure is not None:
                mask = GrammarMasks(1, grammar.words, "cpu").fill([grammar.state(structure)])
            first = sample(logits[-1:], [sp], [seed], [0], model.cfg.eos_token_ids, [(prompt, ())], mask)[0]
            key = f"r{i}"
            firsts[key] = first.token_id
            request = Request(key, tuple(prompt), sp, seed, prompt_len=lay.num_tokens, structure=structure)
            w.submit(DecodeRequest(Attempt(request, key), first, 1, layout=lay))
    events = []
    while w.has_work():
        events.extend(w.step())
    w.check_integrity()
    return firsts, sorted(events, key=lambda e: (e.request_id, e.index)), w.stats()


def _ids(events):
    return [(e.request_id, e.index, e.token.token_id, e.finish_reason) for e in events]


def test_structured_outputs_speculate_with_spec_offs_tokens(spec_model, spec_tok, spec_grammar):
    """Greedy JSON-schema requests beside a free one: each verified position is sampled under the matcher's mask
    after the drafts before it, so the tokens are spec-off's (a mask only at position 0 lets a draft the grammar
    forbids be kept), every constrained reply parses, validates and ends on its grammar."""
    import json

    import jsonschema

    from core.structure import Structure

    structure = Structure("json_schema", json.dumps(SCHEMA))
    texts = ["The weather report as JSON: ", "Report 1: ", "Tomorrow, as JSON: "]
    asks = [(spec_tok.encode(t), SamplingParams(max_tokens=120), 0, structure) for t in texts]
    asks.append((spec_tok.encode("Free text: "), SamplingParams(max_tokens=30), 0, None))
    first_off, off, _ = _events(spec_model, asks, 0, spec_grammar)
    first_on, on, stats = _events(spec_model, asks, N, spec_grammar)
    assert _ids(on) == _ids(off) and first_on == first_off
    spec = stats["speculation"]
    assert spec["steps"] > 0 and spec["acceptance_length"] > 1.0, spec
    for i in range(len(texts)):
        mine = [e for e in on if e.request_id == f"r{i}"]
        assert mine[-1].finish_reason == "stop"
        text = spec_tok.decode([first_on[f"r{i}"]] + [e.token.token_id for e in mine])
        jsonschema.validate(json.loads(text), SCHEMA)


def test_penalties_and_multi_token_bad_words_speculate_with_spec_offs_tokens(spec_model, prompts):
    """Sampled and greedy requests with frequency, presence and repetition penalties and two-token bad words: position
    j of a verified row reads a scratch history holding the request's tokens plus its first j drafts, and only the
    kept tokens join the request's own row, so every draw is spec-off's. The bad words are pairs spec-off writes
    without the ban, so the bans do work here (and hold: no pair appears with them)."""
    def params(bad=()):
        return [SamplingParams(max_tokens=30, temperature=0.5, frequency_penalty=0.5, presence_penalty=0.5, bad_words_token_ids=bad),
                SamplingParams(max_tokens=26, temperature=0.6, repetition_penalty=1.3, top_k=50, bad_words_token_ids=bad),
                SamplingParams(max_tokens=24, frequency_penalty=1.0, repetition_penalty=1.2, bad_words_token_ids=bad),
                SamplingParams(max_tokens=28, temperature=0.7)]

    def pairs(events):
        by = {}
        for e in events:
            if e.request_id != "r3":  # the row without bad words
                by.setdefault(e.request_id, []).append(e.token.token_id)
        return [(a, b) for toks in by.values() for a, b in zip(toks, toks[1:])]

    asks = lambda ps: [(p, sp, 200 + i, None) for i, (p, sp) in enumerate(zip(prompts, ps))]  # noqa: E731
    _, free, _ = _events(spec_model, asks(params()), 0)
    words = tuple(sorted(set(pairs(free)), key=lambda w: (-pairs(free).count(w), w))[:3])
    off_firsts, off, _ = _events(spec_model, asks(params(words)), 0)
    on_firsts, on, stats = _events(spec_model, asks(params(words)), N)
    assert _ids(on) == _ids(off) and on_firsts == off_firsts
    assert _ids(off) != _ids(free)  # the bans changed what was drawn
    assert not set(words) & set(pairs(on))
    assert stats["speculation"]["steps"] > 0 and stats["speculation"]["acceptance_length"] > 1.0, stats["speculation"]


def test_logprob_requests_speculate_with_spec_offs_tokens_and_scores(spec_model, prompts):
    """Log-probabilities come from the raw distribution at each kept position, as a plain step gives them: the
    same tokens, the same top ids, the same scores (to float32 rounding between a one-position forward and a
    verify forward)."""
    ps = [SamplingParams(max_tokens=20, logprobs=3), SamplingParams(max_tokens=18, temperature=0.8, logprobs=1),
          SamplingParams(max_tokens=22), SamplingParams(max_tokens=16, temperature=0.9, frequency_penalty=0.5, logprobs=2)]
    asks = [(p, sp, 300 + i, None) for i, (p, sp) in enumerate(zip(prompts, ps))]
    _, off, _ = _events(spec_model, asks, 0)
    _, on, stats = _events(spec_model, asks, N)
    assert _ids(on) == _ids(off)
    assert stats["speculation"]["steps"] > 0 and stats["speculation"]["acceptance_length"] > 1.0, stats["speculation"]
    for a, b in zip(on, off):
        asked = ps[int(a.request_id[1:])].logprobs
        if asked is None:
            assert a.token.logprob is None and b.token.logprob is None
            continue
        assert a.token.logprob == pytest.approx(b.token.logprob, abs=1e-4)
        assert [i for i, _ in a.token.top_logprobs] == [i for i, _ in b.token.top_logprobs] and len(a.token.top_logprobs) == asked
        assert [v for _, v in a.token.top_logprobs] == pytest.approx([v for _, v in b.token.top_logprobs], abs=1e-4)



def test_speculation_through_elastic_pauses(spec_model, prompts):
    """Elastic admission (`reserve=estimate`, blocks of 128 tokens, an output estimate of 8): speculative steps grow
    the requests by the positions they verify as they cross block boundaries, and every 7th step the newest running
    request is paused by force (device state, MTP ring included, to host memory) and resumes at the next; the greedy
    tokens are spec-off's and the store checks out after every pause and resume."""
    params = [SamplingParams(max_tokens=150 + 10 * i, ignore_eos=True) for i in range(len(prompts))]
    off, _ = _run(spec_model, prompts, params, 0)
    tier = TierConfig(offload=True, speculative_tokens=N, device_budget_bytes=64 << 20, reserved_slots=2, block_tokens=128,
                      reserve="estimate", output_estimate_tokens=8)
    w = DecodeWorker(spec_model, TieredStore(spec_model.cfg, tier, dtype=spec_model.dtype), max_running=16,
                     step_config=StepConfig(decode_mode="eager", speculative_adaptive=False))
    with torch.inference_mode():
        for i, (p, sp) in enumerate(zip(prompts, params)):
            logits, lay = spec_model.prefill(p, last_only=True)
            w.submit(DecodeRequest.fresh(f"r{i}", lay, SampledToken(int(logits[-1].argmax())), sp, seed=100 + i,
                                         prompt_token_ids=p))
    events, steps, grown = [], 0, 0
    while w.has_work():
        if steps % 7 == 6 and len(w.running) > 1:
            w._pause(next(reversed(w.running)))
            w.check_integrity()
        before = {rid: len(r.blocks) for rid, r in w.store.residents.items()}
        events.extend((e.request_id, e.index, e.token.token_id, e.finish_reason) for e in w.step())
        grown += sum(1 for rid, r in w.store.residents.items() if len(r.blocks) > before.get(rid, len(r.blocks)))
        steps += 1
        w.check_integrity()
    stats = w.stats()
    assert sorted(events) == off
    assert stats["swaps"] >= 3 and stats["resumes"] == stats["swaps"], stats
    assert grown >= 1  # requests took blocks as they decoded, not all at admission
    assert stats["speculation"]["acceptance_length"] > 1.2


@pytest.mark.parametrize("decode_mode", ["eager", "compiled"])
def test_speculation_through_resident_transitions(spec_model, prompts, decode_mode):
    """Resident C4 entries (`TierConfig.resident`) under speculation: every request resident from its first step,
    then every 5th step one of them is flipped by force (shrunk to its hot buffer, or grown back; nothing else moves
    them), so speculative
    steps run all-resident and mixed, eagerly and captured whole; the greedy tokens are spec-off's and the store
    checks out after every flip."""
    params = [SamplingParams(max_tokens=150 + 10 * i, ignore_eos=True) for i in range(len(prompts))]
    off, _ = _run(spec_model, prompts, params, 0)
    tier = TierConfig(offload=True, speculative_tokens=N, device_budget_bytes=64 << 20, reserved_slots=2, block_tokens=128,
                      resident=True)
    step = StepConfig(decode_mode=decode_mode, compile_backend="eager", warmup=False, speculative_adaptive=False)
    w = DecodeWorker(spec_model, TieredStore(spec_model.cfg, tier, dtype=spec_model.dtype), max_running=16, step_config=step)
    with torch.inference_mode():
        for i, (p, sp) in enumerate(zip(prompts, params)):
            logits, lay = spec_model.prefill(p, last_only=True)
            w.submit(DecodeRequest.fresh(f"r{i}", lay, SampledToken(int(logits[-1].argmax())), sp, seed=100 + i,
                                         prompt_token_ids=p))
    events, steps = [], 0
    store = w.store
    while w.has_work():
        if steps == 1:  # all resident now: from here on only the forced flips change residency
            store.rebalance = lambda: False
        if steps % 5 == 4 and w.running:
            rid = list(w.running)[(steps // 5) % len(w.running)]
            if store.residents[rid].c4_pages:
                store.drop_resident(rid)
            else:
                store.make_resident(rid)
            w.check_integrity()
        events.extend((e.request_id, e.index, e.token.token_id, e.finish_reason) for e in w.step())
        steps += 1
    w.check_integrity()
    stats = w.stats()
    assert sorted(events) == off
    kinds = store.stats()["c4_mode_steps"]
    assert kinds.get("resident", 0) >= 3 and kinds.get("mixed", 0) >= 10, kinds
    assert store.demotions >= 5 and store.promotions >= len(prompts) + 3
    assert stats["speculation"]["acceptance_length"] > 1.2
    if decode_mode == "compiled":
        assert stats["step"].mode == "compiled"


def test_acceptance_is_learnt_as_served_but_not_from_restarted_rings(spec_model, prompts):
    """A new request's MTP ring fills from its admission on: its drafts are what the traffic gets, so the policy learns
    from them from the first. A ring that plain steps restarted holds less than a window for a while: what those
    drafts keep is a transition (a re-measurement after a plain stretch), so the policy learns nothing from them
    until the ring is full again."""
    window = spec_model.cfg.sliding_window

    def policy_after(max_tokens, plain_steps):
        tier = TierConfig(offload=True, speculative_tokens=N, device_budget_bytes=64 << 20, reserved_slots=2)
        w = DecodeWorker(spec_model, TieredStore(spec_model.cfg, tier, dtype=spec_model.dtype), max_running=16,
                         step_config=StepConfig(decode_mode="eager", speculative_adaptive=False))
        steps = iter(range(10**6))
        w.policy.choose = lambda bucket: 0 if next(steps) < plain_steps else N
        with torch.inference_mode():
            for i, p in enumerate(prompts[:2]):
                logits, lay = spec_model.prefill(p, last_only=True)
                w.submit(DecodeRequest.fresh(f"r{i}", lay, SampledToken(int(logits[-1].argmax())),
                                             SamplingParams(max_tokens=max_tokens, ignore_eos=True), seed=i))
            while w.has_work():
                w.step()
        assert w.spec_steps > 0
        return w.policy

    fresh = DraftPolicy(N)
    # speculating from admission on, over partial rings only: learnt
    assert policy_after(window - 4, plain_steps=0).reached[1] != fresh.reached[1]
    # the same after 5 plain steps: the restarted rings never hold a window before the requests end, nothing learnt
    cold = policy_after(window - 4 + 5, plain_steps=5)
    assert cold.reached == fresh.reached and cold.kept == fresh.kept
    # restarted rings that fill again: learnt from then on
    assert policy_after(window + 60, plain_steps=5).reached[1] != fresh.reached[1]


def test_speculation_over_shared_prefix_pages(spec_model, prompts):
    """Requests whose prompts begin with the same two pages of 128 tokens hold them once (`--share-prefixes`): the
    speculative step resolves their C4 entries through each holder's own map blocks, and the greedy tokens are
    spec-off's with every request holding its own copy."""
    common = [t for p in prompts[:3] for t in p][:300]
    shared = [common + p[: 20 + 30 * i] for i, p in enumerate(prompts)]
    params = [SamplingParams(max_tokens=40 + 10 * i, ignore_eos=True) for i in range(len(prompts))]
    off, _ = _run(spec_model, shared, params, 0, block_tokens=128)
    on, stats = _run(spec_model, shared, params, N, block_tokens=128, share_prefixes=2)
    assert on == off
    assert stats["share_shared_pages"] == 2 * (len(prompts) - 1) and stats["shared_pages_now"] == 0
    assert stats["speculation"]["acceptance_length"] > 1.2
