"""What agents need from the HTTP API, without Ray: V4's chat encoding (a model directory's Python encoder),
the built-in chat template's tools and thinking, tool calls read out of the reply (DSML and the built-in
format, streamed and not), the chat controls, the sampling controls wired into `SamplingParams`, the output
constraint record, and no request field ever ignored in silence.

The cluster is a scripted frontend that answers with a given text and records the requests it was sent, so
a test sees both what the client got and what the workers would have been asked.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import sys

import httpx
import pytest
from test_gateway import FakeService, FrontendBasics, _events

from api.app import build_app
from cluster.frontend import Output
from core.configs import ServerConfig
from core.types import PromptLogprob, SampledToken, TokenEvent
from model.builtin import SHIPPED
from model.grammar import GrammarEngine
from model.tokenizer import load_tokenizer

D = "\uff5cDSML\uff5c"
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "today's weather",
                                                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
SEARCH_TOOL = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
USER = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(SHIPPED)


class TextFrontend(FrontendBasics):
    """Answers every request with the tokens of a text (`answer(request) -> text`, or one text for all), then
    end of sequence (finish `stop`), `batch` tokens per output; records the requests it is sent. `top`: the
    top logprobs each token carries when asked (default: the token itself)."""

    def __init__(self, tok, answer, batch: int = 1, top=None) -> None:
        self.tok, self.answer, self.batch, self.top = tok, answer, batch, top
        self.requests = []

    def prompt_text(self, i: int = -1) -> str:
        return self.tok.decode(list(self.requests[i].prompt_token_ids), skip_special=False)

    async def generate(self, req, seed=None):
        self.requests.append(req)
        sp = req.sampling
        text = self.answer(req) if callable(self.answer) else self.answer
        ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.token_id("<|eos|>")]
        toks = ids[: sp.max_tokens]
        reason = "stop" if len(toks) == len(ids) else "length"
        scores = None
        if sp.prompt_logprobs is not None:  # the prompt's scores come with the first output, as prefill sends them
            scores = [PromptLogprob(t, None if i == 0 else -1.0, () if i == 0 else ((t, -1.0),))
                      for i, t in enumerate(req.prompt_token_ids)]
        for a in range(0, len(toks), self.batch):
            yield Output([TokenEvent(req.request_id, a + i, self._sampled(t, sp), reason if a + i == len(toks) - 1 else None)
                          for i, t in enumerate(toks[a : a + self.batch])], scores if a == 0 else None)

    def _sampled(self, t: int, sp) -> SampledToken:
        if sp.logprobs is None:
            return SampledToken(t)
        return SampledToken(t, -0.25, self.top if self.top is not None else ((t, -0.25),))


def _service(frontend, tokenizer=None, structured: bool = False) -> FakeService:
    s = FakeService(frontend)
    if tokenizer is not None:
        s.tokenizer = tokenizer
    if structured:
        s.grammar = grammar_engine(s.tokenizer)
    return s


_ENGINES = {}


def grammar_engine(tokenizer) -> GrammarEngine:
    """One engine per tokenizer for the module (building one reads the whole vocabulary)."""
    if id(tokenizer) not in _ENGINES:
        _ENGINES[id(tokenizer)] = (tokenizer, GrammarEngine(tokenizer, tokenizer.vocab_size))
    return _ENGINES[id(tokenizer)][1]


def run(service, fn):
    async def go():
        app = build_app(service, ServerConfig())
        async with app.router.lifespan_context(app), httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                                                       base_url="http://gw") as client:
            return await fn(client)

    return asyncio.run(go())


def post_all(service, *requests):
    """POST each (path, body) in order; the responses."""
    async def go(client):
        return [await client.post(path, json=body) for path, body in requests]

    return run(service, go)


def chat(service, **body):
    return post_all(service, ("/v1/chat/completions", {"messages": USER, "max_tokens": 400, **body}))[0]


def streamed(r) -> list[dict]:
    evs = _events(r.text)
    assert evs[-1] == "[DONE]"
    return [e["choices"][0] for e in evs[:-1] if e.get("choices")]


def joined(choices: list[dict]) -> dict:
    """A stream's deltas put together as a client does: reasoning, content, calls (by index), the last finish."""
    out = {"reasoning_content": "", "content": "", "calls": {}, "finish_reason": None, "tool_call_error": None}
    for c in choices:
        d = c["delta"]
        out["reasoning_content"] += d.get("reasoning_content") or ""
        out["content"] += d.get("content") or ""
        for tc in d.get("tool_calls") or ():
            call = out["calls"].setdefault(tc["index"], {"name": None, "arguments": "", "first": None})
            if "id" in tc:
                assert call["name"] is None and tc["type"] == "function"
                call["name"], call["first"] = tc["function"]["name"], tc["function"]["arguments"]
            else:
                assert call["name"] is not None  # the name comes first
            call["arguments"] += tc["function"]["arguments"]
        out["finish_reason"] = c["finish_reason"] or out["finish_reason"]
        out["tool_call_error"] = c.get("tool_call_error") or out["tool_call_error"]
    return out


def builtin_call(name: str, args: dict) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


# V4's chat encoding: a Python encoder in the model directory ------------------------------------------

ENCODER = '''
"""A test's stand-in for DeepSeek's encoding_dsv4.py: the same signature, a format simple to read back."""
import json
from pathlib import Path

with open(Path(__file__).with_name("loads.txt"), "a") as f:
    f.write("loaded\\n")
DSML = "\\uff5cDSML\\uff5c"


def encode_messages(messages, thinking_mode, context=None, drop_thinking=True, add_default_bos_token=True,
                    reasoning_effort=None):
    if thinking_mode not in ("chat", "thinking"):
        raise ValueError("thinking_mode must be chat or thinking")
    out = "<|bos|>" if add_default_bos_token else ""
    if thinking_mode == "thinking":
        out += f"[effort={reasoning_effort}]"
    for m in messages:
        role = m["role"]
        if role == "system":
            out += "[S]" + m["content"]
            if m.get("tools"):
                out += "[TOOLS]" + ",".join(t["function"]["name"] for t in m["tools"])
        elif role == "user":
            out += "[U]" + m["content"]
        elif role == "tool":
            out += f"[R {m.get('tool_call_id')}]" + m["content"]
        else:
            out += "[A]"
            if thinking_mode == "thinking" and m.get("reasoning_content"):
                out += m["reasoning_content"] + "</think>"
            out += m["content"]
            for c in m.get("tool_calls") or []:
                args = json.loads(c["function"]["arguments"])
                out += f'<{DSML}invoke name="{c["function"]["name"]}">' + json.dumps(args, sort_keys=True) + f"</{DSML}invoke>"
            out += "<|eos|>"
    if messages[-1]["role"] != "assistant":
        out += "[A]" + ("<think>" if thinking_mode == "thinking" else "</think>")
    return out
'''


def _model_dir(tmp_path, name: str, source: str):
    d = tmp_path / name
    shutil.copytree(SHIPPED, d, ignore=shutil.ignore_patterns("*.safetensors"))
    (d / "encoding").mkdir()
    (d / "encoding" / "encoding_dsv4.py" if "dsv4" in name else d / "encoding" / "encoding_dsv32.py").write_text(source)
    return d


@pytest.fixture
def v4(tmp_path):
    """A copy of the built-in model with a V4-style encoder; its tokenizer (loaded once, here)."""
    path_before = list(sys.path)
    d = _model_dir(tmp_path, "v4-dsv4", ENCODER)
    tok = load_tokenizer(d)
    assert sys.path == path_before  # the encoder was loaded from its path, not by putting its directory on sys.path
    return d, tok


def test_a_model_directory_encoder_renders_chats_with_tools_history_thinking_and_effort(v4, tok):
    d, v4tok = v4
    assert v4tok.encoder is not None and v4tok.tool_call_format == "dsml"
    assert "encoding_dsv4" not in sys.modules and "encoding" not in sys.modules
    fe = TextFrontend(tok, "Hello!")
    service = _service(fe, v4tok)
    history = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "need the tool",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    rs = post_all(service,
                  ("/v1/chat/completions", {"messages": history[:2], "max_tokens": 8}),
                  ("/v1/chat/completions", {"messages": history, "max_tokens": 8, "tools": [WEATHER_TOOL],
                                            "chat_template_kwargs": {"thinking": True}, "reasoning_effort": "high"}),
                  ("/v1/chat/completions", {"messages": history[1:2], "max_tokens": 8, "chat_template_kwargs": {"enable_thinking": True}}),
                  ("/tokenize", {"messages": history[:2]}))
    assert [r.status_code for r in rs] == [200] * 4, [r.text for r in rs]
    assert fe.prompt_text(0) == "<|bos|>[S]be brief[U]weather?[A]</think>"
    assert fe.prompt_text(1) == ("<|bos|>[effort=high][S]be brief[TOOLS]get_weather[U]weather?[A]need the tool</think>"
                                 f'<{D}invoke name="get_weather">{{"city": "Paris"}}</{D}invoke><|eos|>[R call_1]sunny[A]<think>')
    assert fe.prompt_text(2) == "<|bos|>[effort=None][U]weather?[A]<think>"
    assert rs[3].json()["tokens"] == list(fe.requests[0].prompt_token_ids)  # /tokenize renders as the chat does
    assert (d / "encoding" / "loads.txt").read_text() == "loaded\n"  # executed once, when the tokenizer loaded


def test_v4_reasoning_comes_back_apart_from_the_content(v4, tok):
    _, v4tok = v4
    thinking = {"chat_template_kwargs": {"thinking": True}}
    for batch in (1, 3):
        fe = TextFrontend(tok, "the user greets me </thin no</think>Hello!", batch=batch)
        r, s, hidden = post_all(_service(fe, v4tok),
                                ("/v1/chat/completions", {"messages": USER, "max_tokens": 100, **thinking}),
                                ("/v1/chat/completions", {"messages": USER, "max_tokens": 100, "stream": True, **thinking}),
                                ("/v1/chat/completions", {"messages": USER, "max_tokens": 100, "include_reasoning": False, **thinking}))
        msg = r.json()["choices"][0]["message"]
        assert msg["reasoning_content"] == "the user greets me </thin no" and msg["content"] == "Hello!"
        got = joined(streamed(s))
        assert got["reasoning_content"] == msg["reasoning_content"] and got["content"] == "Hello!"
        assert hidden.json()["choices"][0]["message"] == {"role": "assistant", "content": "Hello!"}


def test_v4_dsml_calls_become_openai_tool_calls(v4, tok):
    _, v4tok = v4
    text = ("Checking.\n\n" + f"<{D}tool_calls>\n<{D}invoke name=\"get_weather\">\n"
            f"<{D}parameter name=\"city\" string=\"true\">Zürich</{D}parameter>\n"
            f"<{D}parameter name=\"days\" string=\"false\">2</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>")
    fe = TextFrontend(tok, text, batch=2)
    r, s = post_all(_service(fe, v4tok), ("/v1/chat/completions", {"messages": USER, "tools": [WEATHER_TOOL], "max_tokens": 300}),
                    ("/v1/chat/completions", {"messages": USER, "tools": [WEATHER_TOOL], "max_tokens": 300, "stream": True}))
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Zürich", "days": 2}
    got = joined(streamed(s))
    assert got["finish_reason"] == "tool_calls" and got["content"] == "Checking."
    assert got["calls"][0]["name"] == "get_weather" and got["calls"][0]["arguments"] == call["function"]["arguments"]
    assert "[TOOLS]get_weather" in fe.prompt_text(0)


V32_ENCODER = '''
def encode_messages(messages, thinking_mode, context=None, drop_thinking=True, add_default_bos_token=True):
    return "".join("[" + m["role"] + "]" + m["content"] for m in messages) + "[A]"
'''


def test_what_an_encoder_cannot_take_is_refused_naming_the_field(v4, tok, tmp_path):
    _, v4tok = v4
    v32tok = load_tokenizer(_model_dir(tmp_path, "v32-dsv32", V32_ENCODER))
    fe = TextFrontend(tok, "x")
    rs = post_all(_service(fe, v4tok),
                  ("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {"temperature_of_mood": 1}}),
                  ("/v1/chat/completions", {"messages": USER, "reasoning_effort": "high", "chat_template_kwargs": {"thinking": False}}),
                  ("/v1/chat/completions", {"messages": USER, "add_generation_prompt": False}),
                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "name": "ann"}]}),
                  ("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {"thinking_mode": "dreaming"}}))
    assert [(r.status_code, r.json()["error"]["param"]) for r in rs] == [
        (400, "chat_template_kwargs"), (400, "reasoning_effort"), (400, "add_generation_prompt"), (400, "messages[0].name"),
        (400, "messages")]  # the encoder's own refusal: thinking_mode must be chat or thinking
    assert "thinking_mode" in rs[4].json()["error"]["message"]
    r = post_all(_service(fe, v32tok), ("/v1/chat/completions", {"messages": USER, "reasoning_effort": "high"}))[0]
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
    assert not fe.requests  # nothing reached the workers


# the built-in model's chat template -------------------------------------------------------------------


def test_the_builtin_template_renders_tools_calls_results_reasoning_and_thinking(tok):
    fe = TextFrontend(tok, "ok")
    history = USER + [
        {"role": "assistant", "content": "let me look", "reasoning_content": "they want weather",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    plain, tools, turn, thinking = post_all(
        _service(fe),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 4}),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 4, "tools": [WEATHER_TOOL]}),
        ("/v1/chat/completions", {"messages": history, "max_tokens": 4, "tools": [WEATHER_TOOL]}),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 4, "chat_template_kwargs": {"thinking": True},
                                  "reasoning_effort": "low"}))
    assert plain.status_code == tools.status_code == turn.status_code == thinking.status_code == 200
    assert tools.json()["usage"]["prompt_tokens"] > plain.json()["usage"]["prompt_tokens"]  # the tools are in the prompt
    assert json.dumps(WEATHER_TOOL["function"]) in fe.prompt_text(1)
    assert fe.prompt_text(2).endswith('<|assistant|><think>they want weather</think>let me look<tool_call>{"name": "get_weather", '
                                      '"arguments": {"city": "Paris"}}</tool_call>\n<|user|><tool_result>sunny</tool_result>\n'
                                      "<|assistant|>")
    assert fe.prompt_text(3) == "<|system|>Reasoning effort: low\n<|user|>weather in Paris?\n<|assistant|><think>"


def test_builtin_replies_give_reasoning_content_and_tool_calls_streamed_or_not(tok):
    text = ("plan: look it up</think>On it. " + builtin_call("get_weather", {"city": "Paris"}) + "\n"
            + builtin_call("search", {"q": "umbrella ✓"}))
    body = {"messages": USER, "tools": [WEATHER_TOOL, SEARCH_TOOL], "chat_template_kwargs": {"enable_thinking": True}, "max_tokens": 400}
    for batch in (1, 4, 64):
        fe = TextFrontend(tok, text, batch=batch)
        r, s = post_all(_service(fe), ("/v1/chat/completions", body), ("/v1/chat/completions", {**body, "stream": True}))
        choice = r.json()["choices"][0]
        msg = choice["message"]
        assert choice["finish_reason"] == "tool_calls"
        assert msg["reasoning_content"] == "plan: look it up" and msg["content"] == "On it."
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]]
        assert calls == [("get_weather", {"city": "Paris"}), ("search", {"q": "umbrella ✓"})]
        assert len({c["id"] for c in msg["tool_calls"]}) == 2
        got = joined(streamed(s))
        assert (got["reasoning_content"], got["content"], got["finish_reason"]) == ("plan: look it up", "On it.", "tool_calls")
        assert [(c["name"], c["arguments"]) for c in got["calls"].values()] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]]
        if batch == 1:  # token by token, the name's delta comes before any argument (in one batch they share a delta)
            assert all(c["first"] == "" for c in got["calls"].values())


def test_tool_choice_none_allowed_tools_and_parallel_tool_calls(tok):
    two = builtin_call("get_weather", {"city": "Oslo"}) + builtin_call("search", {"q": "x"})
    fe = TextFrontend(tok, two)
    allowed = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [{"type": "function", "function": {"name": "search"}}]}}
    none, single, only_search = post_all(
        _service(fe),
        ("/v1/chat/completions", {"messages": USER, "tools": [WEATHER_TOOL, SEARCH_TOOL], "tool_choice": "none", "max_tokens": 400}),
        ("/v1/chat/completions", {"messages": USER, "tools": [WEATHER_TOOL, SEARCH_TOOL], "parallel_tool_calls": False, "max_tokens": 400}),
        ("/v1/chat/completions", {"messages": USER, "tools": [WEATHER_TOOL, SEARCH_TOOL], "tool_choice": allowed, "max_tokens": 400}))
    assert none.json()["choices"][0]["message"] == {"role": "assistant", "content": two}  # rendered, but never read as calls
    assert none.json()["choices"][0]["finish_reason"] == "stop"
    assert json.dumps(SEARCH_TOOL["function"]) in fe.prompt_text(0)
    assert [c["function"]["name"] for c in single.json()["choices"][0]["message"]["tool_calls"]] == ["get_weather"]
    blocked = only_search.json()["choices"][0]
    assert "tool_calls" not in blocked["message"] and blocked["finish_reason"] == "stop"
    assert blocked["tool_call_error"]["index"] == 0 and "get_weather" in blocked["tool_call_error"]["message"]
    assert json.dumps(WEATHER_TOOL["function"]) in fe.prompt_text(2)  # every tool is still in the prompt


def test_malformed_or_cut_off_calls_are_reported_and_never_passed_on(tok):
    bad = "Sure. <tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": }}</tool_call>"
    for text, max_tokens, reason in ((bad, 400, "stop"), (builtin_call("get_weather", {"city": "Paris, France"}), 20, "length")):
        fe = TextFrontend(tok, text)
        body = {"messages": USER, "tools": [WEATHER_TOOL], "max_tokens": max_tokens}
        r, s = post_all(_service(fe), ("/v1/chat/completions", body), ("/v1/chat/completions", {**body, "stream": True}))
        choice = r.json()["choices"][0]
        assert "tool_calls" not in choice["message"] and choice["finish_reason"] == reason
        err = choice["tool_call_error"]
        assert err["index"] == 0 and err["text"].startswith("<tool_call>") and err["message"]
        got = joined(streamed(s))
        assert got["tool_call_error"] == err and got["finish_reason"] == reason
        assert "</tool_call>" not in (choice["message"]["content"] or "")


def test_tool_choice_required_or_named_asks_for_constrained_decoding(tok):
    fe = TextFrontend(tok, builtin_call("get_weather", {"city": "Rome"}))
    named = {"type": "function", "function": {"name": "get_weather"}}
    bodies = [{"tool_choice": "required"}, {"tool_choice": named},
              {"tools": [{"type": "function", "function": {**WEATHER_TOOL["function"], "strict": True}}]}]
    off = post_all(_service(fe), *[("/v1/chat/completions", {"messages": USER, "tools": [WEATHER_TOOL], **b}) for b in bodies])
    for r, param in zip(off, ("tool_choice", "tool_choice", "tool_choice")):
        assert r.status_code == 400 and r.json()["error"]["param"] == param
        assert "structured outputs are not enabled" in r.json()["error"]["message"]
    assert not fe.requests
    on = post_all(_service(fe, structured=True), *[("/v1/chat/completions", {"messages": USER, "tools": [WEATHER_TOOL], **b})
                                                   for b in bodies])
    assert [r.status_code for r in on] == [200, 200, 200]
    specs = [json.loads(req.structure.spec) for req in fe.requests]
    assert [req.structure.kind for req in fe.requests] == ["tool_call"] * 3
    assert [(s["name"], s["required"], s["format"]) for s in specs] == [(None, True, "json"), ("get_weather", True, "json"),
                                                                        (None, False, "json")]
    assert specs[0]["tools"] == [WEATHER_TOOL["function"]]
    wrong = post_all(_service(fe), ("/v1/chat/completions", {"messages": USER, "tool_choice": "auto"}),
                     ("/v1/chat/completions", {"messages": USER, "tools": [WEATHER_TOOL], "tool_choice": {"type": "function",
                                                                                                   "function": {"name": "nope"}}}),
                     ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "custom", "custom": {"name": "x"}}]}))
    assert [r.json()["error"]["param"] for r in wrong] == ["tool_choice", "tool_choice.function.name", "tools[0].type"]


# chat controls --------------------------------------------------------------------------------------------


def test_continue_final_message_and_add_generation_prompt(tok):
    fe = TextFrontend(tok, " there was")
    partial = USER + [{"role": "assistant", "content": "Once upon a time,"}]
    cont, closed, both, no_final = post_all(
        _service(fe),
        ("/v1/chat/completions", {"messages": partial, "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 5}),
        ("/v1/chat/completions", {"messages": USER, "add_generation_prompt": False, "max_tokens": 5}),
        ("/v1/chat/completions", {"messages": partial, "continue_final_message": True}),
        ("/v1/chat/completions", {"messages": USER, "continue_final_message": True, "add_generation_prompt": False}))
    assert cont.status_code == closed.status_code == 200
    assert fe.prompt_text(0) == "<|user|>weather in Paris?\n<|assistant|>Once upon a time,"  # the message is left open
    assert fe.prompt_text(1) == "<|user|>weather in Paris?\n"  # no assistant opening
    for r in (both, no_final):
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_a_request_can_bring_its_own_template_and_template_arguments(tok):
    fe = TextFrontend(tok, "x")
    own = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}{{ flavour }}"
    ok, unread, no_tools, broken = post_all(
        _service(fe),
        ("/v1/chat/completions", {"messages": USER, "chat_template": own, "chat_template_kwargs": {"flavour": "!"}, "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {"flavour": "!"}}),
        ("/v1/chat/completions", {"messages": USER, "chat_template": own, "tools": [WEATHER_TOOL]}),
        ("/v1/chat/completions", {"messages": USER, "chat_template": "{% for %}"}))
    assert ok.status_code == 200 and fe.prompt_text(0) == "[weather in Paris?]!"
    assert [(r.status_code, r.json()["error"]["param"]) for r in (unread, no_tools, broken)] == [
        (400, "chat_template_kwargs"), (400, "tools"), (400, "chat_template")]


# sampling controls ---------------------------------------------------------------------------------------


def test_sampling_controls_reach_the_sampling_params(tok):
    fe = TextFrontend(tok, "hello")
    body = {"logit_bias": {"40": -100, "41": 5.5}, "presence_penalty": 0.5, "frequency_penalty": -0.25, "repetition_penalty": 1.3,
            "min_p": 0.1, "min_tokens": 2, "stop_token_ids": [9, 10], "bad_words": ["hello", "big world"],
            "allowed_token_ids": [40, 41, 42], "top_k": -1, "seed": 5, "temperature": 0.7, "top_p": 0.9, "max_tokens": 3}
    r, c = post_all(_service(fe), ("/v1/chat/completions", {"messages": USER, **body}), ("/v1/completions", {"prompt": "x", **body}))
    assert r.status_code == 200 and c.status_code == 200, (r.text, c.text)
    for req in fe.requests:
        sp = req.sampling
        assert dict(sp.logit_bias) == {40: -100.0, 41: 5.5}
        assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, sp.min_p, sp.min_tokens) == (0.5, -0.25, 1.3, 0.1, 2)
        assert sp.stop_token_ids == (9, 10) and sp.allowed_token_ids == (40, 41, 42)
        assert (sp.top_k, sp.seed, sp.temperature, sp.top_p, sp.max_tokens) == (0, 5, 0.7, 0.9, 3)
        words = set(sp.bad_words_token_ids)
        for w in ("hello", " hello", "big world", " big world"):
            assert tuple(tok.encode(w, add_special_tokens=False)) in words  # as written, and as a word inside a sentence


def test_sampling_values_are_refused_by_their_own_name(tok, monkeypatch):
    import api.gateway

    fe = TextFrontend(tok, "x")
    cases = [("/v1/completions", {"prompt": "x", "logit_bias": {"5": 500}}, "logit_bias"),
             ("/v1/completions", {"prompt": "x", "logit_bias": {"five": 1}}, "logit_bias"),
             ("/v1/completions", {"prompt": "x", "logit_bias": {"999999": 1}}, "logit_bias"),
             ("/v1/completions", {"prompt": "x", "allowed_token_ids": [999999]}, "allowed_token_ids"),
             ("/v1/completions", {"prompt": "x", "frequency_penalty": 3}, "frequency_penalty"),
             ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
             ("/v1/completions", {"prompt": "x", "bad_words": [""]}, "bad_words"),
             ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
             ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens")]
    rs = post_all(_service(fe), *[(p, b) for p, b, _ in cases])
    assert [(r.status_code, r.json()["error"]["param"]) for r in rs] == [(400, param) for _, _, param in cases]
    # a control this build's sampler does not have is refused naming that control, whichever it is
    monkeypatch.setattr(api.gateway, "SAMPLER_FIELDS", api.gateway.SAMPLER_FIELDS - {"presence_penalty", "frequency_penalty"})
    rs = post_all(_service(fe), ("/v1/completions", {"prompt": "x", "frequency_penalty": 0.5}),
                  ("/v1/chat/completions", {"messages": USER, "presence_penalty": 0.5}),
                  ("/v1/completions", {"prompt": "x", "frequency_penalty": 0}))
    assert [(r.status_code, r.json().get("error", {}).get("param")) for r in rs] == [
        (400, "frequency_penalty"), (400, "presence_penalty"), (200, None)]
    assert "not supported" in rs[0].json()["error"]["message"]


def test_stop_strings_can_stay_in_the_output_and_wait_for_min_tokens(tok):
    fe = TextFrontend(tok, "abc STOP def STOP ghi")
    n_first = len(tok.encode("abc STOP", add_special_tokens=False))
    kept, cut, later = post_all(
        _service(fe),
        ("/v1/completions", {"prompt": "x", "stop": ["STOP"], "include_stop_str_in_output": True, "max_tokens": 50}),
        ("/v1/completions", {"prompt": "x", "stop": ["STOP"], "max_tokens": 50}),
        ("/v1/completions", {"prompt": "x", "stop": ["STOP"], "min_tokens": n_first + 1, "max_tokens": 50}))
    assert kept.json()["choices"][0]["text"] == "abc STOP" and kept.json()["choices"][0]["finish_reason"] == "stop"
    assert cut.json()["choices"][0]["text"] == "abc "
    assert later.json()["choices"][0]["text"] == "abc STOP def "  # the first STOP came before min_tokens


def test_completion_top_logprobs_hold_the_sampled_token_and_offsets_point_into_the_text(tok):
    other = tok.encode("z", add_special_tokens=False)[0]
    fe = TextFrontend(tok, "ok ünï", top=((other, -0.1),))  # the sampler's top 1 is another token
    prompt = "héllo wörld"
    r, s = post_all(_service(fe), ("/v1/completions", {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 30}),
                    ("/v1/completions", {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 30, "stream": True}))
    choice = r.json()["choices"][0]
    lp, text = choice["logprobs"], choice["text"]
    assert text == prompt + "ok ünï"
    n_prompt = len(tok.encode(prompt))
    for t, top in zip(lp["tokens"][n_prompt:], lp["top_logprobs"][n_prompt:]):
        assert t in top and top[t] == -0.25 and len(top) == 2
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and offsets[1] == 0  # the BOS is not in the text: the first character is at 0
    assert offsets == sorted(offsets) and offsets[n_prompt] == len(prompt)
    ids = tok.encode(prompt) + tok.encode("ok ünï", add_special_tokens=False)
    for off, i in zip(offsets, ids):
        piece = tok.decode([i])
        if piece and "\ufffd" not in piece:  # a whole character or more: it is in the text where its offset says
            assert text[off : off + len(piece)] == piece
    chunks = streamed(s)
    assert [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]] == offsets


# nothing silently ignored --------------------------------------------------------------------------------


def test_unknown_fields_anywhere_are_refused_naming_them(tok):
    fe = TextFrontend(tok, "x")
    call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{}", "extra": 1}}
    cases = [("/v1/chat/completions", {"messages": USER, "best_sampler": True}, "best_sampler"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "mood": "glad"}]}, "messages[0].mood"),
             ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "examples": []}}]},
              "tools[0].function.examples"),
             ("/v1/chat/completions", {"messages": USER + [{"role": "assistant", "content": "", "tool_calls": [call]}]},
              "messages[1].tool_calls[0].function.extra"),
             ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"include_usage": True, "when": 1}},
              "stream_options.when"),
             ("/v1/completions", {"prompt": "x", "use_beam_search": True}, "use_beam_search"),
             ("/tokenize", {"prompt": "x", "add_bos": True}, "add_bos"),
             ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options")]
    rs = post_all(_service(fe), *[(p, b) for p, b, _ in cases])
    assert [(r.status_code, r.json()["error"]["param"]) for r in rs] == [(400, param) for _, _, param in cases]
    assert not fe.requests


def _openai_fields(module_name: str) -> set[str]:
    import importlib

    base = importlib.import_module(module_name).CompletionCreateParamsBase
    return set(base.__required_keys__ | base.__optional_keys__) | {"stream"}


TOOLS = [WEATHER_TOOL, SEARCH_TOOL]
REPLY = "Sure: " + builtin_call("get_weather", {"city": "Paris"}) + builtin_call("search", {"q": "x"}) + " STOP and more text here"


def _sp(field, value):
    return lambda r, reqs: all(getattr(q.sampling, field) == value for q in reqs)


def _choice(r):
    return r.json()["choices"][0]


ACCEPT = "accepted"
CHAT_FIELDS = {
    # field: (value, other fields it needs, what honouring it looks like — or a status when refused / accepted)
    "model": ("tiny", {}, lambda r, reqs: r.json()["model"] == "tiny"),
    "audio": ({"voice": "alloy", "format": "wav"}, {}, 400),
    "frequency_penalty": (0.5, {}, _sp("frequency_penalty", 0.5)),
    "function_call": ("auto", {}, 400),
    "functions": ([{"name": "f"}], {}, 400),
    "logit_bias": ({"50": -100}, {}, lambda r, reqs: all(dict(q.sampling.logit_bias) == {50: -100.0} for q in reqs)),
    "logprobs": (True, {}, lambda r, reqs: _choice(r)["logprobs"]["content"]),
    "max_completion_tokens": (3, {}, lambda r, reqs: r.json()["usage"]["completion_tokens"] == 3),
    "max_tokens": (4, {}, lambda r, reqs: r.json()["usage"]["completion_tokens"] == 4),
    "metadata": ({"k": "v"}, {}, ACCEPT),
    "modalities": (["text", "audio"], {}, 400),
    "moderation": ({"model": "omni-moderation-latest"}, {}, 400),
    "n": (2, {}, lambda r, reqs: len(r.json()["choices"]) == 2),
    "parallel_tool_calls": (False, {"tools": TOOLS}, lambda r, reqs: len(_choice(r)["message"]["tool_calls"]) == 1),
    "prediction": ({"type": "content", "content": "Sure"}, {}, ACCEPT),
    "presence_penalty": (0.5, {}, _sp("presence_penalty", 0.5)),
    "prompt_cache_key": ("k1", {}, ACCEPT),
    "prompt_cache_options": ({"mode": "implicit"}, {}, ACCEPT),
    "prompt_cache_retention": ("24h", {}, ACCEPT),
    "reasoning_effort": ("high", {}, lambda r, reqs: "Reasoning effort: high" in r.prompt),
    "response_format": ({"type": "json_object"}, {}, 400),
    "safety_identifier": ("user-1", {}, ACCEPT),
    "seed": (7, {}, _sp("seed", 7)),
    "service_tier": ("flex", {}, 400),
    "stop": ("STOP", {}, lambda r, reqs: _choice(r)["finish_reason"] == "stop" and "STOP" not in _choice(r)["message"]["content"]),
    "store": (True, {}, 400),
    "stream": (True, {}, lambda r, reqs: r.headers["content-type"].startswith("text/event-stream")),
    "stream_options": ({"include_usage": True}, {"stream": True}, lambda r, reqs: _events(r.text)[-2]["usage"]["completion_tokens"] > 0),
    "temperature": (0.5, {}, _sp("temperature", 0.5)),
    "tool_choice": ("required", {"tools": TOOLS}, 400),
    "tools": (TOOLS, {}, lambda r, reqs: [c["function"]["name"] for c in _choice(r)["message"]["tool_calls"]] == ["get_weather", "search"]),
    "top_logprobs": (2, {"logprobs": True}, _sp("logprobs", 2)),
    "top_p": (0.5, {}, _sp("top_p", 0.5)),
    "user": ("user-1", {}, ACCEPT),
    "verbosity": ("low", {}, 400),
    "web_search_options": ({}, {}, 400),
}
COMPLETION_FIELDS = {
    "model": ("tiny", {}, lambda r, reqs: r.json()["model"] == "tiny"),
    "best_of": (3, {}, 400),
    "echo": (True, {}, lambda r, reqs: _choice(r)["text"].startswith("write")),
    "frequency_penalty": (0.5, {}, _sp("frequency_penalty", 0.5)),
    "logit_bias": ({"50": -100}, {}, lambda r, reqs: all(dict(q.sampling.logit_bias) == {50: -100.0} for q in reqs)),
    "logprobs": (2, {}, lambda r, reqs: _choice(r)["logprobs"]["top_logprobs"] and reqs[0].sampling.logprobs == 2),
    "max_tokens": (4, {}, lambda r, reqs: r.json()["usage"]["completion_tokens"] == 4),
    "n": (2, {}, lambda r, reqs: len(r.json()["choices"]) == 2),
    "presence_penalty": (0.5, {}, _sp("presence_penalty", 0.5)),
    "seed": (7, {}, _sp("seed", 7)),
    "stop": ("STOP", {}, lambda r, reqs: _choice(r)["finish_reason"] == "stop" and "STOP" not in _choice(r)["text"]),
    "stream": (True, {}, lambda r, reqs: r.headers["content-type"].startswith("text/event-stream")),
    "stream_options": ({"include_usage": True}, {"stream": True}, lambda r, reqs: _events(r.text)[-2]["usage"]["completion_tokens"] > 0),
    "suffix": ("!", {}, 400),
    "temperature": (0.5, {}, _sp("temperature", 0.5)),
    "top_p": (0.5, {}, _sp("top_p", 0.5)),
    "user": ("user-1", {}, ACCEPT),
}


@pytest.mark.parametrize(("route", "module", "table", "base"), [
    ("/v1/chat/completions", "openai.types.chat.completion_create_params", CHAT_FIELDS, {"messages": USER}),
    ("/v1/completions", "openai.types.completion_create_params", COMPLETION_FIELDS, {"prompt": "write", "max_tokens": 200}),
])
def test_every_openai_request_field_is_honoured_or_refused(tok, route, module, table, base):
    """Each field of the installed `openai` package's request schema, sent with a plausible value: a 200 that
    shows its effect, a 400 naming it, or (for the fields that cannot change the output: `api.chat.ACCEPTED`,
    with why) a 200. A field the table does not know fails the test: a new OpenAI field needs a decision."""
    pytest.importorskip("openai")
    from api.chat import ACCEPTED

    fields = _openai_fields(module) - {"messages", "prompt"}
    assert fields == set(table), sorted(fields ^ set(table))
    for name, (value, extra, expect) in sorted(table.items()):
        fe = TextFrontend(tok, REPLY)
        r = post_all(_service(fe), (route, {**base, **extra, name: value}))[0]
        r.prompt = fe.prompt_text(0) if fe.requests else ""
        if expect == 400:
            assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, r.text)
            assert not fe.requests
        elif expect == ACCEPT:
            assert name in ACCEPTED and r.status_code == 200, (name, r.text)
        else:
            assert r.status_code == 200, (name, r.text)
            assert expect(r, fe.requests), (name, r.text[:500])


# the output constraint record ----------------------------------------------------------------------------


def test_output_constraints_become_one_record_and_are_refused_without_a_grammar_engine(tok):
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    cases = [
        ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
         "response_format", ("json_schema", json.dumps(schema, separators=(",", ":"), sort_keys=True))),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format", ("json_object", "")),
        ("/v1/chat/completions", {"guided_json": json.dumps(schema)}, "guided_json",
         ("json_schema", json.dumps(schema, separators=(",", ":"), sort_keys=True))),
        ("/v1/completions", {"guided_regex": "[a-z]+"}, "guided_regex", ("regex", "[a-z]+")),
        ("/v1/completions", {"guided_choice": ["yes", "no"]}, "guided_choice", ("choice", '["yes", "no"]')),
        ("/v1/chat/completions", {"guided_grammar": 'root ::= "a"'}, "guided_grammar", ("grammar", 'root ::= "a"')),
        ("/v1/chat/completions", {"structured_outputs": {"regex": "\\d+"}}, "structured_outputs", ("regex", "\\d+")),
    ]

    def body(path, extra):
        return {"messages": USER, **extra} if "chat" in path else {"prompt": "x", **extra}

    fe = TextFrontend(tok, "x")
    off = post_all(_service(fe), *[(p, body(p, b)) for p, b, _, _ in cases])
    for r, (_, _, param, _) in zip(off, cases):
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert "structured outputs are not enabled" in r.json()["error"]["message"]
    assert not fe.requests
    on = post_all(_service(fe, structured=True), *[(p, body(p, b)) for p, b, _, _ in cases])
    assert [r.status_code for r in on] == [200] * len(cases)
    assert [(q.structure.kind, q.structure.spec) for q in fe.requests] == [want for _, _, _, want in cases]
    assert not any(q.structure.after_reasoning for q in fe.requests)
    fe.requests.clear()
    thinking, plain, two, bad = post_all(
        _service(fe, structured=True),
        ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "json_object"},
                                  "chat_template_kwargs": {"thinking": True}}),
        ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "text"}}),
        ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "json_object"}, "guided_regex": "a"}),
        ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}))
    assert thinking.status_code == 200 and fe.requests[0].structure.after_reasoning  # constrained after the reasoning only
    assert plain.status_code == 200 and fe.requests[1].structure is None
    assert two.status_code == 400 and two.json()["error"]["param"] == "guided_regex"
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format.json_schema"


def test_a_constraint_that_cannot_compile_is_a_400_naming_its_field_before_any_token(tok):
    fe = TextFrontend(tok, "x")
    strict_bad = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {"type": "frob"}}}
    bad = post_all(
        _service(fe, structured=True),
        ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "frob"}}}}}}),
        ("/v1/completions", {"prompt": "x", "guided_regex": "(ab"}),
        ("/v1/chat/completions", {"messages": USER, "structured_outputs": {"grammar": 'root ::= "a" |'}}),
        ("/v1/chat/completions", {"messages": USER, "tools": [strict_bad], "tool_choice": "required"}))
    params = ["response_format", "guided_regex", "structured_outputs", "tool_choice"]
    for r, param in zip(bad, params):
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert "cannot compile" in r.json()["error"]["message"]
    assert not fe.requests  # refused before anything was generated


# routes and the one prompt rule --------------------------------------------------------------------------


def test_model_retrieve_tokenizer_info_and_version(tok):
    async def go(client):
        return [await client.get(p) for p in ("/v1/models/tiny", "/v1/models/other", "/tokenizer_info", "/version")]

    card, missing, info, version = run(_service(TextFrontend(tok, "x")), go)
    assert card.status_code == 200 and card.json()["id"] == "tiny" and card.json()["object"] == "model"
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    body = info.json()  # what lm-eval's remote tokenizer reads
    assert body["eos_token"] == "<|eos|>" and body["bos_token"] == "<|bos|>" and body["tokenizer_class"]
    assert body["chat_template"] == tok.chat_template
    assert version.status_code == 200 and version.json()["version"]


def test_the_gateway_refuses_prompts_by_the_request_rule_itself(tok):
    """The gateway no longer restates the prompt checks: its refusals are core's, named as the route names them."""
    from core.request import check_length, check_prompt
    from core.types import InvalidRequestError

    service = _service(TextFrontend(tok, "x"))
    context, vocab = service.model_cfg.max_position_embeddings, service.model_cfg.vocab_size
    with pytest.raises(InvalidRequestError) as long_:
        check_length(context + 1, 0, context)
    with pytest.raises(InvalidRequestError) as outside:
        check_prompt([5, vocab + 3], vocab)
    r_long, r_out, r_detok = post_all(service, ("/v1/completions", {"prompt": [5] * (context + 1), "max_tokens": 1}),
                                      ("/v1/completions", {"prompt": [5, vocab + 3], "max_tokens": 1}),
                                      ("/detokenize", {"tokens": [5, vocab + 3]}))
    assert r_long.json()["error"] == {**r_long.json()["error"], "message": str(long_.value), "param": "prompt"}
    assert r_out.json()["error"]["message"] == str(outside.value) and r_out.json()["error"]["param"] == "prompt"
    assert r_detok.json()["error"]["message"] == str(outside.value) and r_detok.json()["error"]["param"] == "tokens"


def test_reply_markers_survive_a_tokenizer_that_marks_them_special(tok):
    """A tokenizer may make `<think>` or the DSML marker special tokens: skipping special tokens would then
    erase them from the text before the reply is read. The chat's detokenizer keeps them (and only them)."""
    from api.reply import MARKERS

    special = load_tokenizer(SHIPPED)
    special.inner.add_special_tokens(["<think>", "</think>", D])
    ids = special.encode(f"<think>hm</think>ok <{D}tool_calls>", add_special_tokens=False) + [special.token_id("<|eos|>")]
    plain, kept = special.detokenizer(), special.detokenizer(True, MARKERS)
    assert "".join(plain.push(i) for i in ids) == "hmok <tool_calls>"
    assert "".join(kept.push(i) for i in ids) == f"<think>hm</think>ok <{D}tool_calls>"  # the end-of-sequence still skipped
    fe = TextFrontend(special, f"thinking</think>{builtin_call('get_weather', {'city': 'Oslo'})}")
    service = _service(fe, special)
    service.model_cfg = dataclasses.replace(service.model_cfg, vocab_size=special.vocab_size)  # a model that knows the new ids
    r = chat(service, tools=[WEATHER_TOOL], chat_template_kwargs={"thinking": True})
    msg = r.json()["choices"][0]["message"]
    assert msg["reasoning_content"] == "thinking" and msg["tool_calls"][0]["function"]["name"] == "get_weather"
