"""Constrained decoding through the workers with the built-in model: a JSON-schema request's output parses and
validates, greedy and sampled, across the PD split (prefill samples the first token under the grammar, decode
rebuilds the matcher from it), after a retry that re-prefills with the tokens so far, on the fixed-shape step,
and beside free rows that the mask leaves alone; a grammar that ends ends its request; grammar state leaves
with its request."""

from __future__ import annotations

import json

import jsonschema
import pytest

from cachetier.store import TieredStore
from cluster.inprocess import InProcessEngine, decode_request
from core.configs import EAGER_STEP, StepConfig, TierConfig
from core.request import Attempt, Request
from core.structure import Structure
from core.types import SamplingParams
from decode.worker import DecodeRequest, DecodeWorker
from model.grammar import GrammarEngine
from model.tokenizer import load_tokenizer
from prefill.worker import PrefillWorker

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9},
                                           "sunny": {"type": "boolean"}},
          "required": ["city", "days", "sunny"], "additionalProperties": False}
JSON = Structure("json_schema", json.dumps(SCHEMA))
TIER = TierConfig(max_running=8)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return load_tokenizer(tiny_dir)


@pytest.fixture(scope="module")
def engine(tok, tiny_model):
    return GrammarEngine(tok, tiny_model.cfg.vocab_size, tiny_model.cfg.eos_token_ids)


def prompt(tok, text="The weather report as JSON: "):
    return tuple(tok.encode(text))


def run(tiny_model, engine, requests, step=EAGER_STEP):
    return InProcessEngine(tiny_model, TIER, step=step, grammar=engine).generate(requests)


def valid(tok, completion) -> dict:
    ids = completion.token_ids
    assert completion.finish_reason == "stop", tok.decode(ids)
    value = json.loads(tok.decode(ids))
    jsonschema.validate(value, SCHEMA)
    return value


@pytest.mark.parametrize("temperature", [0.0, 0.6])
def test_json_schema_output_parses_and_validates(tiny_model, engine, tok, temperature):
    sp = SamplingParams(max_tokens=120, temperature=temperature)
    reqs = [Request(f"r{i}", prompt(tok), sp, seed=i, structure=JSON) for i in range(3)]
    out = run(tiny_model, engine, reqs)
    values = [valid(tok, out[r.request_id]) for r in reqs]
    if temperature:
        assert len({json.dumps(v) for v in values}) > 1  # seeds differ, draws differ: sampled, not forced
    free = run(tiny_model, engine, [Request("free", prompt(tok), sp, seed=0)])["free"]
    with pytest.raises(ValueError):  # the unconstrained model does not write this object by itself
        jsonschema.validate(json.loads(tok.decode(free.token_ids)), SCHEMA)


def test_prefill_samples_the_first_token_under_the_grammar(tiny_model, engine, tok):
    choice = Structure("choice", json.dumps(["zebra", "yak"]))
    sp = SamplingParams(max_tokens=8, temperature=0.0)
    worker = PrefillWorker(tiny_model, grammar=engine)
    worker.submit(Attempt.of(Request("c", prompt(tok, "Pick one: "), sp, seed=1, structure=choice)))
    worker.submit(Attempt.of(Request("f", prompt(tok, "Pick one: "), sp, seed=1)))
    results = {}
    while worker.has_work():
        results.update((r.key, r) for r in worker.step())
    first = tok.decode([results["c"].first_token.token_id])
    assert "zebra".startswith(first) or "yak".startswith(first)
    plain = PrefillWorker(tiny_model)
    plain.submit(Attempt.of(Request("f", prompt(tok, "Pick one: "), sp, seed=1)))
    alone = {}
    while plain.has_work():
        alone.update((r.key, r) for r in plain.step())
    assert results["f"].first_token == alone["f"].first_token  # a free row beside it is sampled as before
    with pytest.raises(Exception, match="no grammar engine"):
        plain.submit(Attempt.of(Request("c2", prompt(tok), sp, seed=1, structure=choice)))


def test_free_rows_beside_constrained_ones_are_unchanged_and_pay_nothing(tiny_model, engine, tok):
    sp = SamplingParams(max_tokens=24, temperature=0.7)
    free = [Request(f"f{i}", prompt(tok, f"Line {i}: "), sp, seed=10 + i) for i in range(3)]
    alone_engine = InProcessEngine(tiny_model, TIER, step=EAGER_STEP, grammar=engine)
    alone = alone_engine.generate(free)
    assert alone_engine.decode.masks is None  # no constrained row ever: no mask was made
    mixed = run(tiny_model, engine, free + [Request("j", prompt(tok), SamplingParams(max_tokens=80, temperature=0.7),
                                                    seed=3, structure=JSON)])
    assert all(mixed[r.request_id].token_ids == alone[r.request_id].token_ids for r in free)
    valid(tok, mixed["j"])


def test_the_fixed_shape_step_takes_the_mask_as_an_input(tiny_model, engine, tok):
    step = StepConfig(decode_mode="compiled", compile_backend="eager", warmup=False)
    sp = SamplingParams(max_tokens=80, temperature=0.0)
    reqs = [Request(f"r{i}", prompt(tok, f"Report {i}: "), sp, seed=i, structure=JSON) for i in range(3)]
    fixed = run(tiny_model, engine, reqs, step)
    eager = run(tiny_model, engine, reqs)
    for r in reqs:
        assert fixed[r.request_id].token_ids == eager[r.request_id].token_ids
        valid(tok, fixed[r.request_id])


def test_a_retry_rebuilds_the_matcher_from_the_tokens_so_far(tiny_model, engine, tok):
    """A decode failover: the request is prefilled again over prompt + all but the last generated token and
    decodes on; its output is the uninterrupted one and still valid."""
    sp = SamplingParams(max_tokens=80, temperature=1.0)
    req = Request("r", prompt(tok), sp, seed=7, structure=JSON)
    whole = run(tiny_model, engine, [req])["r"].token_ids
    cut = len(whole) // 2
    pre = PrefillWorker(tiny_model, grammar=engine)
    pre.submit(Attempt.of(req).retry("r-2", tuple(whole[:cut]), solo=False))
    done = []
    while pre.has_work():
        done += pre.step()
    worker = DecodeWorker(tiny_model, TieredStore(tiny_model.cfg, TIER), step_config=EAGER_STEP, grammar=engine)
    worker.submit(decode_request(done[0]))
    rest = []
    while worker.has_work():
        rest += [ev.token.token_id for ev in worker.step()]
    assert list(whole[:cut]) + rest == list(whole)
    with pytest.raises(ValueError, match="rebuilt from its tokens"):  # the tokens must travel with it
        DecodeRequest(Attempt(req, "r-3"), done[0].first_token, num_generated=cut, layout=done[0].layout)


def test_a_grammar_that_ends_ends_its_request_and_states_leave_with_requests(tiny_model, engine, tok):
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)  # only the grammar can end it
    store = TieredStore(tiny_model.cfg, TIER)
    pre, dec = PrefillWorker(tiny_model, grammar=engine), DecodeWorker(tiny_model, store, step_config=EAGER_STEP, grammar=engine)
    reqs = [Request("a", prompt(tok, "Answer: "), sp, seed=0, structure=Structure("regex", "(yes|no)")),
            Request("b", prompt(tok, "Answer: "), SamplingParams(max_tokens=40, temperature=0.0), seed=0, structure=JSON)]
    for r in reqs:
        pre.submit(Attempt.of(r))
    while pre.has_work():
        for res in pre.step():
            dec.submit(decode_request(res))
    events = {}
    dec.step()
    assert sum(run.grammar is not None for run in dec.running.values()) == 2
    dec.abort("b")  # an abort drops its matcher with it
    assert [run.req.request_id for run in dec.running.values()] == ["a"]
    while dec.has_work():
        for ev in dec.step():
            events.setdefault(ev.request_id, []).append(ev)
    last = events["a"][-1]
    assert last.finish_reason == "stop" and len(events["a"]) < 39  # the grammar ended it, not max_tokens
    assert not dec.running
