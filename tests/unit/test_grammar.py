"""The grammar engine (model/grammar.py): every structure kind compiles over the built-in tokenizer and holds a
random walk through its masks to text that matches; compiled grammars are cached; a matcher rebuilt from the
tokens so far is the matcher advanced token by token; a structure that cannot compile names its field."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch

from api.reply import read_reply
from core.structure import Structure
from model.grammar import GrammarEngine, GrammarError, bitmask_words
from model.sampling import apply_token_bitmask, pack_token_bitmask
from model.tokenizer import load_tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "n", "ok"], "additionalProperties": False}
WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                           "required": ["zone"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return load_tokenizer(tiny_dir)


@pytest.fixture(scope="module")
def engine(tok):
    return GrammarEngine(tok, tok.vocab_size + 7)  # a model vocabulary wider than its tokenizer's


def allowed(mask: torch.Tensor, vocab: int) -> list[int]:
    row = mask[0].numpy().view("uint32")
    return [t for t in range(vocab) if (int(row[t >> 5]) >> (t & 31)) & 1]


def walk(engine: GrammarEngine, structure: Structure, seed: int, steps: int = 400, stop_bias: float = 0.6, start=()):
    """`start`, then tokens drawn at random among the ones the grammar allows until it takes the end of sequence."""
    rng = random.Random(seed)
    state = engine.state(structure, start)
    mask = torch.zeros((1, engine.words), dtype=torch.int32)
    out = list(start)
    for _ in range(steps):
        state.fill(mask, 0)
        ok = allowed(mask, engine.vocab_size)
        stops = [t for t in ok if t in engine.stop_ids]
        t = stops[0] if stops and rng.random() < stop_bias else rng.choice(ok)
        assert state.accept(t)
        if state.done:
            return out
        out.append(t)
    raise AssertionError(f"no end of sequence in {steps} tokens")


def text(tok, ids):
    return tok.decode(ids, skip_special=False)


def test_the_mask_never_allows_ids_past_the_tokenizer_or_its_role_markers(engine, tok):
    state = engine.state(Structure("regex", ".*"))
    mask = torch.zeros((1, engine.words), dtype=torch.int32)
    state.fill(mask, 0)
    ok = set(allowed(mask, engine.vocab_size))
    assert engine.words == bitmask_words(engine.vocab_size) == mask.shape[1]
    assert not ok & set(range(tok.vocab_size, engine.vocab_size))  # the padding ids of a wider embedding
    assert tok.token_id("<|user|>") not in ok and tok.token_id("<|bos|>") not in ok
    assert tok.token_id("<|eos|>") in ok  # `.*` may end here


@pytest.mark.parametrize("seed", range(3))
def test_json_schema_walks_parse_and_validate(engine, tok, seed):
    s = Structure("json_schema", json.dumps(SCHEMA))
    jsonschema.validate(json.loads(text(tok, walk(engine, s, seed))), SCHEMA)


def test_json_object_regex_choice_and_ebnf(engine, tok):
    assert isinstance(json.loads(text(tok, walk(engine, Structure("json_object"), 0))), dict)
    assert re.fullmatch(r"[a-c]{2}-\d{3}", text(tok, walk(engine, Structure("regex", r"[a-c]{2}-\d{3}"), 1)))
    picks = {text(tok, walk(engine, Structure("choice", json.dumps(["red", "green", "blue"])), s)) for s in range(6)}
    assert picks <= {"red", "green", "blue"} and picks
    ebnf = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9]'
    assert re.fullmatch(r"\([1-9](\+[1-9])*\)", text(tok, walk(engine, Structure("grammar", ebnf), 2)))


def test_after_reasoning_is_free_until_the_think_block_closes(engine, tok):
    s = Structure("json_schema", json.dumps(SCHEMA), after_reasoning=True)
    reasoning = tok.encode('let me see: {"x" </think>', add_special_tokens=False)  # JSON-ish text is reasoning here
    out = text(tok, walk(engine, s, 0, start=reasoning))
    head, _, answer = out.partition("</think>")
    assert head == 'let me see: {"x" '
    jsonschema.validate(json.loads(answer), SCHEMA)
    with pytest.raises(ValueError, match="does not fit"):  # without the reasoning block the same text is refused
        engine.state(Structure("json_schema", json.dumps(SCHEMA)), reasoning)


def call_text(tok, ids, tools):
    return read_reply(text(tok, ids), tools=frozenset(t["name"] for t in tools))


@pytest.mark.parametrize("fmt", ["json", "dsml"])
@pytest.mark.parametrize("seed", range(2))
def test_required_tool_calls_are_valid_calls_the_reply_parser_reads(engine, tok, fmt, seed):
    spec = {"format": fmt, "tools": [WEATHER, TIME], "name": None, "required": True, "parallel": True}
    ids = walk(engine, Structure("tool_call", json.dumps(spec)), seed, steps=800, stop_bias=0.9)
    reply = call_text(tok, ids, [WEATHER, TIME])
    assert reply.error is None and reply.calls, text(tok, ids)
    assert reply.content.strip() == ""
    schemas = {t["name"]: t["parameters"] for t in (WEATHER, TIME)}
    for call in reply.calls:
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


@pytest.mark.parametrize("fmt", ["json", "dsml"])
def test_a_named_tool_is_the_one_called_once_without_parallel_calls(engine, tok, fmt):
    spec = {"format": fmt, "tools": [WEATHER, TIME], "name": "get_time", "required": True, "parallel": False}
    ids = walk(engine, Structure("tool_call", json.dumps(spec)), 3, steps=800, stop_bias=0.9)
    reply = call_text(tok, ids, [WEATHER, TIME])
    assert [c.name for c in reply.calls] == ["get_time"] and json.loads(reply.calls[0].arguments)["zone"] in ("utc", "cet")


@pytest.mark.parametrize("fmt", ["json", "dsml"])
def test_auto_with_strict_tools_allows_text_and_holds_calls_to_their_schema(engine, tok, fmt):
    spec = {"format": fmt, "tools": [dict(WEATHER, strict=True)], "name": None, "required": False, "parallel": True}
    s = Structure("tool_call", json.dumps(spec))
    free = tok.encode("Sure, here it is.", add_special_tokens=False)
    assert not engine.state(s, free).done  # free text is allowed
    opener = "<tool_call>" if fmt == "json" else "<\uff5cDSML\uff5ctool_calls>\n"
    bad = ('{"name": "get_weather", "arguments": {"town"' if fmt == "json"
           else '<\uff5cDSML\uff5cinvoke name="get_weather">\n<\uff5cDSML\uff5cparameter name="town"')
    with pytest.raises(ValueError, match="does not fit"):
        engine.state(s, free + tok.encode(opener + bad, add_special_tokens=False))


def test_compiled_grammars_are_cached_by_what_they_ask(tok):
    engine = GrammarEngine(tok, tok.vocab_size, cache_size=2)
    a, b, c = (Structure("regex", p) for p in (r"\d+", r"[a-z]+", r"x"))
    first = engine.compile(a)
    assert engine.compile(Structure("regex", r"\d+")) is first and (engine.hits, engine.misses) == (1, 1)
    assert engine.compile(Structure("regex", r"\d+", after_reasoning=True)) is not first  # another grammar
    engine.compile(b)
    engine.compile(c)  # over the bound: the least recently used goes
    assert engine.stats()["cached"] == 2 and engine.compile(a) is not first


def test_a_matcher_rebuilt_from_the_tokens_so_far_is_the_advanced_one(engine, tok):
    s = Structure("json_schema", json.dumps(SCHEMA))
    ids = walk(engine, s, 5)
    advanced = engine.state(s)
    a, b = torch.zeros((1, engine.words), dtype=torch.int32), torch.zeros((1, engine.words), dtype=torch.int32)
    for i, t in enumerate(ids):
        rebuilt = engine.state(s, ids[:i])
        advanced.fill(a, 0)
        rebuilt.fill(b, 0)
        assert torch.equal(a, b), f"after {i} tokens"
        advanced.accept(t)


def test_the_mask_goes_through_the_samplers_bitmask_layout(engine):
    state = engine.state(Structure("choice", json.dumps(["A", "B"])))
    mask = torch.zeros((1, engine.words), dtype=torch.int32)
    state.fill(mask, 0)
    ours = pack_token_bitmask([allowed(mask, engine.vocab_size)], engine.vocab_size, "cpu")
    assert torch.equal(ours, mask)
    logits = apply_token_bitmask(torch.zeros((1, engine.vocab_size)), mask)
    assert torch.isfinite(logits).sum() == len(allowed(mask, engine.vocab_size)) >= 2


@pytest.mark.parametrize("structure, fault", [
    (Structure("json_schema", json.dumps({"type": "frob"})), "frob"),
    (Structure("regex", "(ab"), "parenthesis"),
    (Structure("grammar", 'root ::= "a" |'), "EBNF"),
    (Structure("tool_call", json.dumps({"format": "json", "tools": [WEATHER], "name": "nope", "required": True})), "no tool"),
])
def test_a_structure_that_cannot_compile_names_its_field(engine, structure, fault):
    with pytest.raises(GrammarError, match=fault) as e:
        engine.compile(structure, "response_format.json_schema.schema")
    assert e.value.param == "response_format.json_schema.schema" and e.value.status == 400
    assert "cannot compile" in str(e.value) and "/project/" not in str(e.value)


def test_an_engine_pickles_as_what_built_it(engine):
    """The gateway's app carries an engine to where Ray Serve runs it: the copy compiles and masks alike."""
    import pickle

    copy = pickle.loads(pickle.dumps(engine))
    s = Structure("regex", "[ab]+")
    assert copy.vocab_size == engine.vocab_size and copy.stop_ids == engine.stop_ids
    masks = torch.zeros((2, engine.words), dtype=torch.int32)
    engine.state(s).fill(masks, 0)
    copy.state(s).fill(masks, 1)
    assert torch.equal(masks[0], masks[1]) and masks[0].any()
    assert copy.stats()["misses"] == 1
