"""The OpenAI-compatible API over real HTTP: httpx and the official `openai` client against a real server."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import ray
from serving_helpers import EAGER, openai_client, start_gateway, stop_gateway, tiny_gateway_config

from cluster.inprocess import InProcessEngine
from core.configs import TierConfig
from core.request import Request
from core.types import SamplingParams

pytestmark = pytest.mark.ray
TIER = TierConfig(offload=True, hot_buffer_slots=16, device_budget_bytes=5 * 2**20, host_pool_bytes=64 * 2**20, max_running=64)


@pytest.fixture(scope="module")
def gw(tiny_dir):
    g = start_gateway(tiny_gateway_config(TIER, 64), tiny_dir)
    yield g
    stop_gateway(g)


@pytest.fixture(scope="module")
def oai(gw):
    return openai_client(gw)


def _post(gw, path, body, **kw):
    return httpx.post(gw.url + path, json=body, timeout=120, **kw)


def _sse(text: str) -> list:
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _plain(tiny_model, prompt_ids, max_tokens, **sp):
    eng = InProcessEngine(tiny_model, TIER, step=EAGER)
    done = eng.generate([Request("ref", tuple(prompt_ids), SamplingParams(max_tokens=max_tokens, **sp))])["ref"]
    eng.close()
    return done


def test_health_models_request_id(gw):
    r = httpx.get(gw.url + "/health", headers={"X-Request-Id": "abc-123"})
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert r.headers["x-request-id"] == "abc-123"
    assert httpx.get(gw.url + "/health").headers["x-request-id"]
    m = httpx.get(gw.url + "/v1/models").json()
    assert m["object"] == "list" and m["data"][0]["id"] == "tiny"


def test_greedy_completion_equals_generate(gw, tiny_model):
    ids = [0, 78, 107, 108, 38, 115, 103, 111, 116, 46, 47, 64]
    r = _post(gw, "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 24, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    ref = _plain(tiny_model, ids, 24, ignore_eos=True)
    assert body["choices"][0]["text"] == gw.service.tokenizer.decode(ref.token_ids)
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 24, "total_tokens": len(ids) + 24}
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["finish_reason"] == "length"


def test_openai_client_completion_stream_and_text_prompt(oai, gw, tiny_model):
    text = "def main():\n    return"
    full = oai.completions.create(model="tiny", prompt=text, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    chunks = list(oai.completions.create(model="tiny", prompt=text, max_tokens=12, temperature=0, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    ids = gw.service.tokenizer.encode(text)
    assert full.choices[0].text == gw.service.tokenizer.decode(_plain(tiny_model, ids, 12, ignore_eos=True).token_ids)


def test_chat_completion_and_stream(oai):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    r = oai.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 10
    stream = list(oai.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0, stream=True,
                                              extra_body={"ignore_eos": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == r.choices[0].message.content
    assert stream[-1].choices[0].finish_reason == "length"


def test_stop_string_is_cut_and_not_returned(gw):
    base = {"prompt": [5, 9, 77, 78, 79, 80], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    text = _post(gw, "/v1/completions", base).json()["choices"][0]["text"]
    stop = text[5:7]
    cut = text.find(stop)
    r = _post(gw, "/v1/completions", {**base, "stop": [stop, "never-appears"]}).json()
    assert r["choices"][0]["text"] == text[:cut]
    assert r["choices"][0]["finish_reason"] == "stop"
    s = _sse(_post(gw, "/v1/completions", {**base, "stop": stop, "stream": True}).text)
    assert "".join(c["choices"][0]["text"] for c in s[:-1]) == text[:cut]
    assert s[-2]["choices"][0]["finish_reason"] == "stop" and s[-1] == "[DONE]"


def test_n_choices_seed_logprobs_echo(gw):
    body = {"prompt": ["ab", "cde"], "max_tokens": 6, "temperature": 1.0, "seed": 11, "n": 3, "logprobs": 3,
            "echo": True, "ignore_eos": True}
    r = _post(gw, "/v1/completions", body).json()
    assert [c["index"] for c in r["choices"]] == list(range(6))
    assert all(c["text"].startswith("ab") for c in r["choices"][:3])
    texts = [c["text"] for c in r["choices"][:3]]
    assert len(set(texts)) > 1  # different seeds per choice
    tok = gw.service.tokenizer
    for c in r["choices"]:
        lp = c["logprobs"]  # echo + logprobs: the prompt's tokens first (the very first has no logprob), then the 6 generated
        n_prompt = len(tok.encode("ab" if c["index"] < 3 else "cde"))
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n_prompt + 6
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and lp["text_offset"][0] == 0
        assert all(v <= 0 for v in lp["token_logprobs"][1:]) and all(len(t) <= 4 for t in lp["top_logprobs"][1:])
        # the top 3 and the token at that place, when it is not among them
        assert all(t in top for t, top in zip(lp["tokens"][1:], lp["top_logprobs"][1:]))
    again = _post(gw, "/v1/completions", body).json()
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in r["choices"]]  # seeded: reproducible
    assert all(c["text"].startswith("cde") for c in r["choices"][3:])
    expected_prompt = len(tok.encode("ab")) + len(tok.encode("cde"))  # once per prompt, not per choice
    assert r["usage"]["prompt_tokens"] == expected_prompt and r["usage"]["completion_tokens"] == 36
    ids = _post(gw, "/v1/completions", {"prompt": [[6, 7, 8], [9, 10]], "max_tokens": 2, "n": 2}).json()
    assert len(ids["choices"]) == 4 and ids["usage"]["prompt_tokens"] == 5


def test_chat_logprobs(oai):
    r = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4, logprobs=True,
                                    top_logprobs=2, temperature=0, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
        ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
        ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"prompt": [], "max_tokens": 3}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 200000}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "presence_penalty": 5.0}, 400, "presence_penalty"),
        ("/v1/completions", {"prompt": "x", "frequency_penalty": 5.0}, 400, "frequency_penalty"),
        ("/v1/completions", {"prompt": "x", "beam_width": 4}, 400, "beam_width"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}}, 400,
         "response_format.json_schema"),
        ("/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "model"),
        ("/v1/completions", {"prompt": None}, 422, None),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 422, None),
        ("/v1/completions", {"max_tokens": 3}, 422, None),
        ("/v1/chat/completions", {"messages": []}, 422, None),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 422, None),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ],
)
def test_errors_are_openai_shaped(gw, path, body, status, param):
    r = _post(gw, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param:
        assert err["param"] == param


def test_malformed_json_and_unknown_route(gw):
    r = httpx.post(gw.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and "error" in r.json()
    r = httpx.get(gw.url + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert httpx.get(gw.url + "/health").status_code == 200  # still serving


def test_request_larger_than_budget_is_400_before_work(gw):
    r = _post(gw, "/v1/completions", {"prompt": [5, 6], "max_tokens": 130000})  # ~5.5 MB of KV > the 5 MiB budget
    assert r.status_code == 400 and "lower max_tokens" in r.json()["error"]["message"]


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_disconnect_mid_stream_frees_both_tiers(gw):
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", gw.url + "/v1/completions",
                      json={"prompt": [7] * 300, "max_tokens": 3000, "stream": True, "ignore_eos": True}) as r:
            n = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    n += 1
                if n == 5:
                    break  # leave the with-block: the connection closes mid-stream
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = httpx.get(gw.url + "/metrics").text
        if _metric(m, "hisparse_requests_running") == 0 and _metric(m, "hisparse_kv_device_bytes_used") == 0 \
                and _metric(m, "hisparse_kv_host_bytes_used") == 0:
            break
        time.sleep(0.3)
    else:
        raise AssertionError("memory was not returned after the client left:\n" + m)
    for d in gw.service.actors.decode:
        assert ray.get(d.check_integrity.remote())
        assert ray.get(d.stats.remote()).running == 0


def test_metrics_exposes_latencies_and_tier(gw):
    _post(gw, "/v1/completions", {"prompt": [8] * 200, "max_tokens": 20, "ignore_eos": True})
    time.sleep(1.2)  # the stats in the actors' reports refresh once a second
    m = httpx.get(gw.url + "/metrics").text
    for name in ("hisparse_time_to_first_token_seconds_count", "hisparse_inter_token_latency_seconds_count",
                 "hisparse_e2e_request_latency_seconds_count", "hisparse_requests_waiting", "hisparse_kv_device_bytes_capacity",
                 "hisparse_kv_host_bytes_capacity", "hisparse_hot_buffer_hits_total", "hisparse_hot_buffer_misses_total",
                 "hisparse_hot_buffer_h2d_bytes_total", "hisparse_handoff_bytes_total"):
        assert name in m, name
    assert 'model="tiny"' in m
    assert _metric(m, "hisparse_hot_buffer_misses_total") > 0
    assert _metric(m, "hisparse_handoff_bytes_total") > 0


def test_fifty_concurrent_streams(gw):
    async def one(client, i):
        body = {"prompt": [6 + i % 200] * (10 + i), "max_tokens": 16, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}, "temperature": 0.7, "seed": i}
        async with client.stream("POST", gw.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = [json.loads(line[6:]) for line in [ln async for ln in r.aiter_lines()]
                      if line.startswith("data: ") and line != "data: [DONE]"]
        return events

    async def main():
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=60)) as client:
            return await asyncio.gather(*(one(client, i) for i in range(50)))

    results = asyncio.run(main())
    assert len(results) == 50
    for events in results:
        assert events[-1]["usage"]["completion_tokens"] == 16
        finals = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
        assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"


def test_requests_sharing_a_client_request_id_stay_apart(gw, tiny_model):
    """The client's X-Request-Id is echoed and logged only: 8 streams sharing one, beside 2 others, each get
    their own tokens, equal to running alone."""
    prompts = [[6 + (5 * i + 3 * j) % 240 for j in range(20 + 3 * i)] for i in range(10)]
    headers = ["same-id"] * 8 + ["other-1", "other-2"]

    async def one(client, i):
        body = {"prompt": prompts[i], "max_tokens": 12, "temperature": 0, "stream": True, "ignore_eos": True, "logprobs": 0}
        async with client.stream("POST", gw.url + "/v1/completions", json=body, headers={"X-Request-Id": headers[i]}) as r:
            assert r.headers["x-request-id"] == headers[i]
            chunks = [json.loads(line[6:]) for line in [ln async for ln in r.aiter_lines()]
                      if line.startswith("data: ") and line != "data: [DONE]"]
        return [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]

    async def main():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(10)))

    got = asyncio.run(main())
    tok = gw.service.tokenizer
    for i, toks in enumerate(got):
        ref = _plain(tiny_model, prompts[i], 12, ignore_eos=True)
        assert toks == [tok.decode([t], skip_special=False) for t in ref.token_ids], i


def test_loglikelihood_request_scores_the_prompt_like_the_model(gw, tiny_model):
    """What lm-eval's multiple-choice tasks send: echo + logprobs + max_tokens 1 (and 0: scoring only)."""
    import torch

    text = "import os\nimport sys\n"
    ids = gw.service.tokenizer.encode(text)
    with torch.no_grad():
        full, _ = tiny_model.prefill(ids)
    ref = torch.log_softmax(full.float(), dim=-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).tolist()
    for max_tokens in (1, 0):
        r = _post(gw, "/v1/completions", {"prompt": text, "max_tokens": max_tokens, "echo": True, "logprobs": 1,
                                          "temperature": 0})
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        scores = lp["token_logprobs"][1 : len(ids)]
        assert max(abs(a - b) for a, b in zip(scores, ref)) <= 1e-3
        assert len(lp["tokens"]) == len(ids) + max_tokens
        assert r.json()["choices"][0]["text"].startswith(text)


def test_tokenize_counts_what_transformers_counts(gw):
    from transformers import AutoTokenizer

    from model.builtin import SHIPPED

    hf = AutoTokenizer.from_pretrained(str(SHIPPED))
    text = "def count(xs):\n    return len(xs)  # ✓"
    r = _post(gw, "/tokenize", {"prompt": text}).json()
    assert r["tokens"] == hf(text).input_ids and r["count"] == len(hf(text).input_ids)
    assert _post(gw, "/detokenize", {"tokens": r["tokens"]}).json()["prompt"] == text


def test_non_streaming_client_that_leaves_is_aborted(gw):
    import socket

    body = json.dumps({"prompt": [9] * 40, "max_tokens": 5000, "ignore_eos": True}).encode()
    host, port = gw.url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
              + str(len(body)).encode() + b"\r\n\r\n" + body)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _metric(httpx.get(gw.url + "/metrics").text, "hisparse_requests_running") == 0:
        time.sleep(0.2)
    s.close()  # gone before the answer
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        st = [ray.get(d.stats.remote()) for d in gw.service.actors.decode]
        if all(x.running == 0 and x.device_bytes_used == 0 for x in st):
            break
        time.sleep(0.3)
    else:
        raise AssertionError(f"the request kept decoding after its client left: {st}")


def test_agent_controls_with_the_real_model(oai, gw, tiny_model):
    """What the real model can show of the agent surface: tools and thinking are in the prompt it is given, a
    final message is continued, the model can be retrieved, the tokenizer described; a greedy token biased
    by -100 is not drawn again (or logit_bias is refused by name where the sampler lacks it)."""
    openai = pytest.importorskip("openai")
    msgs = [{"role": "user", "content": "what is the weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
                                                                                     "properties": {"city": {"type": "string"}}}}}]
    common = {"model": "tiny", "max_tokens": 4, "temperature": 0}
    plain = oai.chat.completions.create(messages=msgs, **common)
    with_tools = oai.chat.completions.create(messages=msgs, tools=tools, tool_choice="auto", **common)
    thinking = oai.chat.completions.create(messages=msgs, extra_body={"chat_template_kwargs": {"thinking": True}}, **common)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens
    assert thinking.usage.prompt_tokens > plain.usage.prompt_tokens
    tok = gw.service.tokenizer
    partial = msgs + [{"role": "assistant", "content": "It is"}]
    cont = oai.chat.completions.create(messages=partial, extra_body={"continue_final_message": True, "add_generation_prompt": False},
                                       **common)
    assert cont.usage.prompt_tokens == len(tok.encode("<|user|>what is the weather in Paris?\n<|assistant|>It is",
                                                      add_special_tokens=False))
    assert oai.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-9")
    info = httpx.get(gw.url + "/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    assert httpx.get(gw.url + "/version").json()["version"]
    ids = [0, 78, 107, 108, 38, 115, 103]
    first = _plain(tiny_model, ids, 1, ignore_eos=True).token_ids[0]  # the greedy token
    biased = _post(gw, "/v1/completions", {"prompt": ids, "max_tokens": 1, "temperature": 0, "ignore_eos": True, "logprobs": 0,
                                           "logit_bias": {str(first): -100}})
    if biased.status_code == 400:
        assert biased.json()["error"]["param"] == "logit_bias"
    else:
        assert biased.json()["choices"][0]["logprobs"]["tokens"][0] != tok.decode([first], skip_special=False)
