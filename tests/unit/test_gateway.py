"""The gateway without Ray: routes, admission, streaming assembly, API key, body limit, request ids.

The cluster is replaced by a scripted frontend (these tests are about the HTTP side); the app runs
in-process under httpx's ASGI transport.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math

import httpx
import pytest

from api.app import build_app
from cluster.frontend import Output
from core.configs import ServerConfig
from core.types import PromptLogprob, SampledToken, TokenEvent
from model.builtin import SHIPPED
from model.config import load_config
from model.tokenizer import load_tokenizer


class FrontendBasics:
    """What the gateway asks of a frontend besides `generate`: always ready, admits everything, numbered ids."""

    ids = None

    def ready(self) -> bool:
        return True

    def new_request_id(self) -> str:
        if self.ids is None:
            self.ids = iter(range(10**9))
        return f"req-{next(self.ids)}"

    def check_admissible(self, req) -> None:
        pass

    def stats(self) -> dict:
        return {}


class ScriptedFrontend(FrontendBasics):
    """Answers every request with the same tokens, in batches of `batch` per output."""

    def __init__(self, tokens: list[int], batch: int = 1, hold: asyncio.Event | None = None) -> None:
        self.tokens, self.batch, self.hold = tokens, batch, hold
        self.started, self.closed = 0, 0

    async def generate(self, req, seed=None):  # the seed is on the request where the frontend takes one argument
        self.started += 1
        try:
            sp = req.sampling
            toks = self.tokens[: sp.max_tokens]
            scores = None
            if sp.prompt_logprobs is not None:
                scores = [PromptLogprob(t, None if i == 0 else -1.0, () if i == 0 else ((t, -1.0),))
                          for i, t in enumerate(req.prompt_token_ids)]
            if not toks:
                yield Output([], scores)
                return
            first = TokenEvent(req.request_id, 0, _tok(toks[0], sp), "length" if len(toks) == 1 else None)
            yield Output([first], scores)
            for a in range(1, len(toks), self.batch):
                if self.hold is not None:
                    await self.hold.wait()
                chunk = toks[a : a + self.batch]
                yield Output([TokenEvent(req.request_id, a + i, _tok(t, sp), "length" if a + i == len(toks) - 1 else None)
                              for i, t in enumerate(chunk)])
        finally:
            self.closed += 1


def _tok(t: int, sp) -> SampledToken:
    return SampledToken(t, -0.5, ((t, -0.5),)) if sp.logprobs is not None else SampledToken(t)


class FakeService:
    def __init__(self, frontend, context: int | None = None) -> None:
        self.tokenizer = load_tokenizer(SHIPPED)
        self.model_cfg = load_config(SHIPPED, name="tiny")
        if context is not None:  # a model with a shorter context than the built-in one's 1M tokens
            self.model_cfg = dataclasses.replace(self.model_cfg, max_position_embeddings=context)
        self.model_name = "tiny"
        self.frontend = frontend

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


@pytest.fixture
def tok():
    return load_tokenizer(SHIPPED)


def _client(frontend, context: int | None = None, **server) -> httpx.AsyncClient:
    app = build_app(FakeService(frontend, context), ServerConfig(**server))
    return app, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")


async def _with_app(frontend, fn, context: int | None = None, **server):
    app, client = _client(frontend, context, **server)
    async with app.router.lifespan_context(app), client:
        return await fn(client)


def _events(text: str) -> list:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


def test_stream_interval_merges_tokens_but_never_delays_first_or_last(tok):
    ids = tok.encode("the quick brown fox jumps over the lazy dog again and again", add_special_tokens=False)[:10]

    async def go(client):
        r = await client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 10, "stream": True})
        return _events(r.text)

    evs = asyncio.run(_with_app(ScriptedFrontend(ids), go, stream_interval=4))
    chunks = [e for e in evs if e != "[DONE]"]
    sizes = [len(tok.encode(c["choices"][0]["text"], add_special_tokens=False)) for c in chunks]
    assert "".join(c["choices"][0]["text"] for c in chunks) == tok.decode(ids)
    assert len(chunks) == 4  # first token alone, then 4 + 4, and the last 1 at once with the finish
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and sum(sizes) >= 9


def test_batches_from_a_lagging_client_become_one_chunk_each(tok):
    ids = tok.encode("abcdefghijklmnop", add_special_tokens=False)

    async def go(client):
        r = await client.post("/v1/completions", json={"prompt": [5], "max_tokens": len(ids), "stream": True, "logprobs": 0})
        return _events(r.text)

    evs = asyncio.run(_with_app(ScriptedFrontend(ids, batch=5), go))
    chunks = [e["choices"][0] for e in evs if e != "[DONE]"]
    assert len(chunks) == 1 + -(-(len(ids) - 1) // 5)
    assert sum(len(c["logprobs"]["tokens"]) for c in chunks) == len(ids)


def test_echo_with_logprobs_scores_the_prompt_and_max_tokens_zero_scores_only():
    async def go(client):
        a = (await client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 0, "echo": True, "logprobs": 1})).json()
        b = (await client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2, "echo": True, "logprobs": 1})).json()
        c = _events((await client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2, "echo": True,
                                                                "logprobs": 1, "stream": True})).text)
        d = await client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 0})
        return a, b, c, d

    a, b, c, d = asyncio.run(_with_app(ScriptedFrontend([40, 41]), go))
    lp = a["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [None, -1.0, -1.0] and lp["top_logprobs"][0] is None and a["usage"]["completion_tokens"] == 0
    assert a["choices"][0]["finish_reason"] == "length"
    assert b["choices"][0]["logprobs"]["token_logprobs"] == [None, -1.0, -1.0, -0.5, -0.5]
    opening = c[0]["choices"][0]
    assert opening["logprobs"]["token_logprobs"] == [None, -1.0, -1.0]  # the echoed prompt comes with its scores
    assert d.status_code == 400 and d.json()["error"]["param"] == "max_tokens"  # 0 only with echo


def test_a_prompt_is_in_the_answer_only_when_echoed(tok):
    async def go(client):
        out = []
        for prompt in ("hello there", tok.encode("hello there")):
            for echo in (False, True):
                r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "echo": echo})
                out.append((echo, r.json()["choices"][0]["text"]))
        return out

    made = tok.decode([40, 41])
    for echo, text in asyncio.run(_with_app(ScriptedFrontend([40, 41]), go)):
        assert text == (tok.decode(tok.encode("hello there")) + made if echo else made)


def test_admission_is_decided_before_a_stream_starts():
    hold = asyncio.Event()
    fe = ScriptedFrontend(list(range(50, 60)), hold=hold)

    async def go(client):
        async def stream():
            async with client.stream("POST", "/v1/completions", json={"prompt": [5], "max_tokens": 10, "stream": True}) as r:
                return r.status_code, [x async for x in r.aiter_lines() if x]

        first = asyncio.ensure_future(stream())
        while fe.started == 0:
            await asyncio.sleep(0.01)
        over = await client.post("/v1/completions", json={"prompt": [5], "max_tokens": 2})
        hold.set()
        done = await first
        after = await client.post("/v1/completions", json={"prompt": [5], "max_tokens": 2})
        return over, done, after

    over, done, after = asyncio.run(_with_app(fe, go, max_concurrent_requests=1))
    assert over.status_code == 429 and over.json()["error"]["type"] == "rate_limit_error" and over.headers["retry-after"]
    assert done[0] == 200 and done[1][-1] == "data: [DONE]"
    assert after.status_code == 200  # the finished stream gave its slot back


def test_fan_out_is_capped_and_bad_input_is_never_a_500():
    bodies = [
        {"prompt": [[5]] * 9, "n": 8},  # 72 sequences > 64
        {"prompt": "x", "stop": ["a"] * 20},
        {"prompt": [5], "logprobs": -1},
        {"prompt": [5], "seed": "x"},
        {"prompt": [5], "n": 10**9},
        {"prompt": [[]]},
        {"prompt": [5], "max_tokens": -4},
        {"messages": [{"role": "user", "content": [{"type": "image", "url": "x"}]}]},
        {"prompt": [5], "top_k": -7},
        {"prompt": [5], "stream_options": {"include_usage": "sometimes"}},
    ]

    async def go(client):
        out = []
        for b in bodies:
            path = "/v1/chat/completions" if "messages" in b else "/v1/completions"
            out.append(await client.post(path, json=b))
        out.append(await client.post("/v1/completions", content=b"\xff\xfe", headers={"content-type": "application/json"}))
        return out

    rs = asyncio.run(_with_app(ScriptedFrontend([7]), go))
    assert rs[0].status_code == 400 and "at most 64" in rs[0].json()["error"]["message"]
    for r in rs:
        assert 400 <= r.status_code < 500, (r.status_code, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_api_key_guards_v1_but_not_probes():
    async def go(client):
        return [
            await client.get("/v1/models"),
            await client.get("/v1/models", headers={"Authorization": "Bearer wrong"}),
            await client.get("/v1/models", headers={"Authorization": "Bearer s3cret"}),
            await client.post("/tokenize", json={"prompt": "x"}),
            await client.get("/health"),
            await client.get("/metrics"),
        ]

    no, wrong, ok, tokenize, health, metrics = asyncio.run(_with_app(ScriptedFrontend([7]), go, api_key="s3cret"))
    for r in (no, wrong, tokenize):
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert r.headers["www-authenticate"] == "Bearer"
        assert "s3cret" not in r.text
    assert ok.status_code == 200 and health.status_code == 200 and metrics.status_code == 200


def test_token_ids_are_integers_never_booleans():
    """JSON true/false would pass as ids 1/0 (Python bools are ints): a 400 naming the field; ids written as
    strings or floats are type errors (422), as every other mistyped field is."""
    async def go(client):
        return [
            await client.post("/v1/completions", json={"prompt": [True, 2], "max_tokens": 2}),
            await client.post("/v1/completions", json={"prompt": [[5], [6, False]], "max_tokens": 2}),
            await client.post("/detokenize", json={"tokens": [40, True]}),
            await client.post("/v1/completions", json={"prompt": ["1", 2], "max_tokens": 2}),
            await client.post("/v1/completions", json={"prompt": [5.0], "max_tokens": 2}),
            await client.post("/v1/completions", json={"prompt": [0, 2], "max_tokens": 2}),
        ]

    flat, nested, detok, strings, floats, ok = asyncio.run(_with_app(ScriptedFrontend([7]), go))
    for r, param, where in ((flat, "prompt", "prompt[0]"), (nested, "prompt", "prompt[1][1]"), (detok, "tokens", "tokens[1]")):
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and where in err["message"] and err["type"] == "invalid_request_error"
    assert strings.status_code == 422 and floats.status_code == 422
    assert ok.status_code == 200  # 0 is an id like any other


def test_a_prompt_longer_than_the_context_is_refused_naming_the_prompt(tok):
    """Ids: by their count, before any id is read. Text: by its bytes when it cannot fit even at the tokenizer's
    densest, otherwise by its tokens; chat: the same, naming `messages`."""
    from api.prompts import densest_bytes_per_token

    densest = densest_bytes_per_token(json.loads(tok.inner.to_str()))
    context = 1000
    over = "é" * (context // 2 + 10)  # few bytes, but every byte is a token of its own
    assert len(over.encode()) <= densest * context  # the byte bound cannot refuse it: its tokens must be counted
    assert len(tok.encode(over, add_special_tokens=False)) > context

    async def go(client):
        return [
            await client.post("/v1/completions", json={"prompt": [5] * (context + 1), "max_tokens": 1}),
            await client.post("/v1/completions", json={"prompt": "a" * (densest * context + 1), "max_tokens": 1}),
            await client.post("/v1/completions", json={"prompt": over, "max_tokens": 1}),
            await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": over}]}),
            await client.post("/tokenize", json={"prompt": "a" * (densest * context + 1)}),
            await client.post("/tokenize", json={"prompt": over}),
            await client.post("/v1/completions", json={"prompt": [5] * (context - 1), "max_tokens": 1}),
        ]

    ids, by_bytes, by_tokens, chat, tok_bytes, tok_count, fits = asyncio.run(_with_app(ScriptedFrontend([7]), go, context=context))
    for r, param in ((ids, "prompt"), (by_bytes, "prompt"), (by_tokens, "prompt"), (chat, "messages"), (tok_bytes, "prompt")):
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and (f"context is {context} tokens" in err["message"]  # by bytes
                                          or f"context of {context} tokens" in err["message"])  # core's length rule
    assert "bytes" in by_bytes.json()["error"]["message"] and "bytes" in tok_bytes.json()["error"]["message"]
    assert tok_count.status_code == 200 and tok_count.json()["count"] > context  # counting is what /tokenize is for
    assert fits.status_code == 200


def test_the_densest_bytes_per_token_bound_holds_and_is_claimed_only_where_provable(tok):
    from api.prompts import densest_bytes_per_token

    spec = json.loads(tok.inner.to_str())
    densest = densest_bytes_per_token(spec)
    assert densest == max(len(a) + len(b) for a, b in spec["model"]["merges"])  # the built-in vocabulary's longest merge
    # the texts that come closest: runs of the densest token, special tokens back to back, one byte repeated
    longest = max(("".join(p) for p in spec["model"]["merges"]), key=len)
    dense = tok.decode([tok.inner.token_to_id(longest)], skip_special=False)
    assert len(dense.encode()) == densest
    for text in (dense * 500, "<|assistant|><|user|>" * 300, "a" * 5000, "ünï✓ " * 700):
        n = len(tok.encode(text, add_special_tokens=False))
        assert n >= math.ceil(len(text.encode()) / densest), text[:20]

    def without(change) -> int | None:
        s = json.loads(json.dumps(spec))
        change(s)
        return densest_bytes_per_token(s)

    assert without(lambda s: s.update(normalizer={"type": "Sequence", "normalizers": []})) == densest
    assert without(lambda s: s.update(normalizer={"type": "NFC"})) is None  # composing can shrink text
    assert without(lambda s: s["added_tokens"][0].update(lstrip=True)) is None  # swallows any run of spaces
    assert without(lambda s: s.update(pre_tokenizer={"type": "Sequence", "pretokenizers": [
        {"type": "WhitespaceSplit"}, spec["pre_tokenizer"]]})) is None  # drops the spaces
    assert without(lambda s: s.update(pre_tokenizer={"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"String": "x"}, "behavior": "Removed", "invert": False}, spec["pre_tokenizer"]]})) is None
    assert without(lambda s: s["model"]["vocab"].pop("Ġ")) is None  # a byte the vocabulary cannot write is dropped
    assert without(lambda s: s.update(truncation={"max_length": 8, "strategy": "LongestFirst", "stride": 0,
                                                  "direction": "Right"})) is None
    assert without(lambda s: s["model"].update(ignore_merges=True)) == max(
        [max(map(len, spec["model"]["vocab"]))] + [len(a["content"].encode()) for a in spec["added_tokens"]])


def test_body_limit_and_request_id_cleaning():
    async def go(client):
        big = await client.post("/v1/completions", content=b'{"prompt": "' + b"a" * 3000 + b'"}',
                                headers={"content-type": "application/json"})

        async def chunks():
            yield b'{"prompt": "'
            for _ in range(10):
                yield b"a" * 500
            yield b'"}'

        streamed = await client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        tagged = await client.get("/v1/models", headers={"X-Request-Id": "abc 123<script>" + "x" * 500})
        kept = await client.get("/v1/models", headers={"X-Request-Id": "client-42"})
        return big, streamed, tagged, kept

    big, streamed, tagged, kept = asyncio.run(_with_app(ScriptedFrontend([7]), go, max_body_bytes=2048))
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    assert streamed.status_code == 413
    rid = tagged.headers["x-request-id"]
    assert len(rid) <= 128 and rid.startswith("abc123script") and "<" not in rid and " " not in rid
    assert kept.headers["x-request-id"] == "client-42"


def test_tokenize_and_detokenize_in_vllm_shape(tok):
    async def go(client):
        t = (await client.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True})).json()
        t2 = (await client.post("/tokenize", json={"prompt": "hello world", "add_special_tokens": False})).json()
        c = (await client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})).json()
        d = (await client.post("/detokenize", json={"tokens": t2["tokens"]})).json()
        bad = await client.post("/detokenize", json={"tokens": [10**7]})
        return t, t2, c, d, bad

    t, t2, c, d, bad = asyncio.run(_with_app(ScriptedFrontend([7]), go))
    assert t["tokens"] == tok.encode("hello world") and t["count"] == len(t["tokens"]) and t["max_model_len"] > 0
    assert len(t["token_strs"]) == t["count"] and t2["tokens"] == t["tokens"][1:] and t2["token_strs"] is None
    assert c["tokens"] == tok.encode_chat([{"role": "user", "content": "hi"}])
    assert d == {"prompt": "hello world"}
    assert bad.status_code == 400


def test_streaming_text_never_re_decodes_the_whole_output(tok, monkeypatch):
    """Incremental detokenization is O(1) per token: the whole-list decode is never called while streaming."""
    ids = tok.encode("def f(x):\n    return x * 2  # ünï ✓", add_special_tokens=False)
    calls = []
    real_decode = tok.decode
    monkeypatch.setattr(type(tok), "decode", lambda self, i, skip_special=True: calls.append(len(i)) or real_decode(i, skip_special))

    async def go(client):
        r = await client.post("/v1/completions", json={"prompt": [5], "max_tokens": len(ids), "stream": True})
        return _events(r.text)

    evs = asyncio.run(_with_app(ScriptedFrontend(ids), go))
    assert "".join(e["choices"][0]["text"] for e in evs if e != "[DONE]") == real_decode(ids)
    assert all(n <= 1 for n in calls)  # at most the prompt echo / single tokens, never a growing list


class StallingFrontend(ScriptedFrontend):
    """Sends the first token, then the stream goes silent past its deadline."""

    async def generate(self, req, seed=None):  # the seed is on the request where the frontend takes one argument
        from core.types import DeadlineExceeded

        yield Output([TokenEvent(req.request_id, 0, SampledToken(40))])
        raise DeadlineExceeded("no token for 60 s (--token-timeout-s)")


def test_a_silent_stream_ends_with_an_error_event_not_a_hang():
    async def go(client):
        s = await client.post("/v1/completions", json={"prompt": [5], "max_tokens": 9, "stream": True})
        n = await client.post("/v1/completions", json={"prompt": [5], "max_tokens": 9})
        return _events(s.text), n

    evs, n = asyncio.run(_with_app(StallingFrontend([]), go))
    assert evs[-1] == "[DONE]" and evs[-2]["error"]["type"] == "timeout" and "--token-timeout-s" in evs[-2]["error"]["message"]
    assert n.status_code == 504 and n.json()["error"]["type"] == "timeout"


def test_collector_delivers_in_order_and_merges_what_is_pending():
    from cluster.outputs import Collector
    from core.types import DeadlineExceeded

    def ev(i, reason=None):
        return TokenEvent("req", i, SampledToken(100 + i), reason)

    async def go():
        c = Collector("key.0", "req", 0)
        c.put([ev(2), ev(3)])  # decode's tokens can arrive before prefill's first one is handed over
        with pytest.raises(DeadlineExceeded):
            await c.take(0.05)
        c.delivered(1)
        c.put([ev(1), ev(2)])  # a duplicate of 2 is dropped
        got = await c.take(1.0)
        c.put([ev(4, "length")])
        return got, await c.take(1.0)

    got, last = asyncio.run(go())
    assert [e.index for e in got] == [1, 2, 3] and all(e.request_id == "req" for e in got)
    assert [(e.index, e.finish_reason) for e in last] == [(4, "length")]
