"""`hisparse bench serve` against a fake OpenAI-compatible streaming server under a real uvicorn.

The fake server streams exactly `max_tokens` tokens with a small delay between chunks, so token counts are
known exactly; nothing here asserts on how long anything took.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import socket
import threading
import time

import httpx
import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from bench.serve import (
    ServeBenchConfig,
    arrival_offsets,
    build_prompts,
    request_body,
    run_serve_bench,
    serve_bench,
    spread_tokens,
    token_gaps,
)
from hisparse import bench_cmd

MODEL = "fake-model"
TOKEN_DELAY_S = 0.002


def make_app(*, tokens_per_chunk: int = 1, fail_every: int = 0, send_usage: bool = True, token_ids: bool = False,
             send_done: bool = True) -> FastAPI:
    """A streaming server: every `fail_every`-th request answers 500; chunks carry `tokens_per_chunk` tokens
    (listed in a vLLM-style `token_ids` field of the choice when `token_ids`); without `send_done` a stream ends
    on its finish_reason chunk (as transformers serve's do)."""
    app = FastAPI()
    counter = itertools.count(1)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    async def handle(request: Request, chat: bool):
        body = await request.json()
        if fail_every and next(counter) % fail_every == 0:
            return JSONResponse({"error": {"message": "injected failure", "type": "server_error"}}, status_code=500)
        assert body["stream"] is True and body["ignore_eos"] is True
        if chat:
            prompt_tokens = len(body["messages"][0]["content"].split())
        else:
            prompt = body["prompt"]
            prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        num_tokens = body["max_tokens"]
        want_usage = send_usage and (body.get("stream_options") or {}).get("include_usage")
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, finish: str | None, n: int = 0) -> str:
            if chat:
                choice = {"index": 0, "delta": {"content": text} if text is not None else {"role": "assistant", "content": ""},
                          "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish}
            if token_ids and n:
                choice["token_ids"] = list(range(n))
            return "data: " + json.dumps({"id": "x", "object": kind, "model": MODEL, "choices": [choice]}) + "\n\n"

        async def events():
            if chat:
                yield chunk(None, None)
            sent = 0
            while sent < num_tokens:
                await asyncio.sleep(TOKEN_DELAY_S)
                n = min(tokens_per_chunk, num_tokens - sent)
                sent += n
                yield chunk("".join(f" t{sent - n + k}" for k in range(n)), "length" if sent == num_tokens else None, n)
            if want_usage:
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": num_tokens,
                         "total_tokens": prompt_tokens + num_tokens}
                yield "data: " + json.dumps({"id": "x", "object": kind, "model": MODEL, "choices": [], "usage": usage}) + "\n\n"
            if send_done:
                yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


class LiveServer:
    """uvicorn on 127.0.0.1 in a background thread, on a socket bound before it starts (no port race)."""

    def __init__(self, app: FastAPI):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
        assert not self.thread.is_alive(), "uvicorn did not stop"


@pytest.fixture(scope="module")
def server():
    with LiveServer(make_app()) as s:
        yield s


def _bench_cli(argv: list[str], capsys) -> tuple[int, dict]:
    parser = argparse.ArgumentParser(prog="hisparse")
    bench_cmd.add_parser(parser.add_subparsers(dest="command", required=True))
    rc = bench_cmd.run(parser.parse_args(argv))
    return rc, json.loads(capsys.readouterr().out)


def _check_run(res: dict, num: int, output_len: int, input_len: int | None) -> None:
    assert res["completed"] == num and res["failed"] == 0
    assert res["total_output_tokens"] == num * output_len
    assert res["output_lens"] == [output_len] * num
    if input_len is not None:
        assert res["input_lens"] == [input_len] * num
        assert res["total_input_tokens"] == num * input_len
    assert all(len(itls) == output_len - 1 for itls in res["itls_s"])
    assert all(e is None for e in res["errors"])
    raw = {"ttft": res["ttfts_s"], "e2el": res["e2els_s"], "itl": [g for gaps in res["itls_s"] for g in gaps]}
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert 0 <= res[f"p50_{name}_ms"] <= res[f"p99_{name}_ms"]
        assert res[f"median_{name}_ms"] == res[f"p50_{name}_ms"]
        if name in raw:  # the summary is the statistics of the per-request figures it also reports
            ms = np.asarray(raw[name], dtype=np.float64) * 1000
            assert res[f"mean_{name}_ms"] == pytest.approx(ms.mean(), abs=0.01)
            assert res[f"std_{name}_ms"] == pytest.approx(ms.std(), abs=0.01)
    assert all(0 < t <= e for t, e in zip(res["ttfts_s"], res["e2els_s"]))
    assert res["duration_s"] > 0 and res["request_throughput"] > 0 and res["output_throughput"] > 0
    assert res["total_token_throughput"] >= res["output_throughput"]


def test_max_concurrency_run_through_the_cli(server, tmp_path, capsys):
    result_file, plot = tmp_path / "out.json", tmp_path / "cdf.png"
    rc, res = _bench_cli(["bench", "serve", "--url", server.url, "--num-prompts", "20", "--max-concurrency", "4",
                          "--input-len", "12", "--output-len", "6", "--seed", "3", "--result-file", str(result_file),
                          "--plot", str(plot)], capsys)
    assert rc == 0
    _check_run(res, num=20, output_len=6, input_len=12)
    assert res["model"] == MODEL  # asked the server, since --model was not given
    assert res["max_concurrency"] == 4 and 1 <= res["peak_concurrency"] <= 4
    assert res["request_rate"] == "inf" and res["args"]["num_prompts"] == 20
    assert json.loads(result_file.read_text()) == res
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_request_rate_run(server):
    cfg = ServeBenchConfig(base_url=server.url, num_prompts=20, input_len=8, output_len=5, request_rate=200.0,
                           model=MODEL, seed=1, progress=False)
    res = run_serve_bench(cfg)
    _check_run(res, num=20, output_len=5, input_len=8)
    assert res["request_rate"] == 200.0 and res["max_concurrency"] is None
    assert max(res["start_offsets_s"]) > 0  # sent on a Poisson schedule, not all at t=0
    assert res["config"]["request_rate"] == 200.0


@pytest.mark.parametrize("endpoint, token_ids, per_chunk", [
    ("chat", False, [3, 2, 2]),  # the chunks do not say: 7 tokens over 3 chunks, spread as evenly as possible
    ("completions", True, [3, 3, 1]),  # the chunks list their token ids: taken as they are
])
def test_multi_token_chunks_split_their_gaps(endpoint, token_ids, per_chunk):
    with LiveServer(make_app(tokens_per_chunk=3, token_ids=token_ids)) as s:
        cfg = ServeBenchConfig(base_url=s.url, endpoint=endpoint, num_prompts=6, input_len=40, output_len=7,
                               max_concurrency=3, progress=False)
        res = run_serve_bench(cfg)
    _check_run(res, num=6, output_len=7, input_len=None if endpoint == "chat" else 40)
    assert all(n and n > 0 for n in res["input_lens"])  # from usage (the chat server counts words)
    first, second, third = per_chunk
    for itls in res["itls_s"]:
        # tokens sharing the first chunk arrived with it (gap 0); each later chunk's gap is split evenly
        assert itls[: first - 1] == [0.0] * (first - 1)
        assert len(set(itls[first - 1: first - 1 + second])) == 1
        assert len(set(itls[first - 1 + second:])) == 1 and len(itls[first - 1 + second:]) == third


def test_without_usage_tokens_are_counted_from_chunks():
    with LiveServer(make_app(send_usage=False)) as s:
        res = run_serve_bench(ServeBenchConfig(base_url=s.url, num_prompts=4, input_len=5, output_len=4,
                                               max_concurrency=2, progress=False))
    _check_run(res, num=4, output_len=4, input_len=5)


def test_failing_requests_are_counted_and_the_run_finishes(tmp_path, capsys):
    with LiveServer(make_app(fail_every=4)) as s:
        rc, res = _bench_cli(["bench", "serve", "--url", s.url, "--num-prompts", "20", "--max-concurrency", "4",
                              "--input-len", "4", "--output-len", "3", "--no-progress"], capsys)
    assert rc == 0  # some got through; failures are a measurement
    assert res["failed"] == 5 and res["completed"] == 15
    errors = [e for e in res["errors"] if e is not None]
    assert len(errors) == 5 and all(e.startswith("HTTP 500") for e in errors)
    assert res["total_output_tokens"] == 15 * 3
    assert sum(n is None for n in res["output_lens"]) == 5
    assert res["p50_ttft_ms"] <= res["p99_ttft_ms"]


def test_unreachable_server_fails_every_request_without_raising():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()  # nothing listens there now
    res = run_serve_bench(ServeBenchConfig(base_url=url, model=MODEL, num_prompts=3, input_len=2, output_len=2,
                                           progress=False, timeout_s=5))
    assert res["completed"] == 0 and res["failed"] == 3
    assert res["mean_ttft_ms"] is None and res["request_throughput"] == 0


def test_sweep_with_plot(server, tmp_path, capsys):
    plot = tmp_path / "sweep.png"
    rc, res = _bench_cli(["bench", "serve", "--url", server.url, "--model", MODEL, "--num-prompts", "8",
                          "--input-len", "6", "--output-len", "4", "--sweep-rates", "100,inf", "--no-progress",
                          "--percentiles", "90", "--plot", str(plot)], capsys)
    assert rc == 0
    assert res["benchmark"] == "serve_sweep" and res["rates"] == [100.0, "inf"]
    assert [r["request_rate"] for r in res["runs"]] == [100.0, "inf"]
    for run in res["runs"]:
        _check_run(run, num=8, output_len=4, input_len=6)
        assert run["p50_e2el_ms"] <= run["p90_e2el_ms"] <= run["p99_e2el_ms"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_streams_without_done_fail_unless_told_and_then_count():
    def run(require_done: bool) -> dict:
        cfg = ServeBenchConfig(base_url="http://in-process", endpoint="chat", num_prompts=3, input_len=3, output_len=4,
                               max_concurrency=3, progress=False, require_done=require_done)
        return asyncio.run(serve_bench(cfg, transport=httpx.ASGITransport(app=make_app(send_done=False))))

    strict = run(True)
    assert strict["completed"] == 0 and strict["failed"] == 3
    lenient = run(False)
    assert lenient["completed"] == 3 and lenient["total_output_tokens"] == 12


def test_in_process_app_through_an_asgi_transport():
    cfg = ServeBenchConfig(base_url="http://in-process", num_prompts=5, input_len=3, output_len=3,
                           max_concurrency=5, progress=False)
    res = asyncio.run(serve_bench(cfg, transport=httpx.ASGITransport(app=make_app())))
    _check_run(res, num=5, output_len=3, input_len=3)


def test_workload_is_exact_and_seeded():
    cfg = ServeBenchConfig(num_prompts=50, input_len=17, vocab_range=(10, 250), seed=7)
    prompts = build_prompts(cfg)
    assert prompts == build_prompts(cfg) and prompts != build_prompts(ServeBenchConfig(num_prompts=50, input_len=17, seed=8))
    assert all(len(p) == 17 and all(10 <= t <= 250 for t in p) for p in prompts)
    texts = build_prompts(ServeBenchConfig(num_prompts=5, input_len=60, endpoint="chat"))
    assert all(isinstance(t, str) and len(t) == 60 for t in texts) and len(set(texts)) == 5

    offsets = arrival_offsets(4000, rate=20.0, seed=0)
    assert offsets[0] == 0.0 and offsets == sorted(offsets) and offsets == arrival_offsets(4000, 20.0, 0)
    assert abs(offsets[-1] / 3999 - 1 / 20.0) < 0.1 / 20.0  # mean gap ~ 1/rate (a computed schedule, not a timing)
    assert arrival_offsets(3, rate=float("inf"), seed=0) == [0.0, 0.0, 0.0]


def test_token_spreading_and_gaps():
    assert spread_tokens([None, None, None], 3) == [1, 1, 1]
    assert spread_tokens([2, None], 3) == [2, 1]
    assert spread_tokens([None, None], 5) == [3, 2]
    gaps = token_gaps([1.0, 2.0, 2.5], [2, 2, 1])
    assert gaps == [0.0, 0.5, 0.5, 0.5]
    assert len(gaps) == 5 - 1


@pytest.mark.parametrize("bad", [dict(num_prompts=0), dict(request_rate=0.0), dict(max_concurrency=0),
                                 dict(endpoint="embeddings"), dict(vocab_range=(5, 2)), dict(percentiles=(100.0,))])
def test_config_rejects_nonsense(bad):
    with pytest.raises(ValueError):
        ServeBenchConfig(**bad)


def test_extra_body_adds_overrides_and_removes_fields():
    """The peer comparison needs a body without ignore_eos (transformers serve refuses unknown fields): a null
    removes a field the bench sends, anything else is merged."""
    cfg = ServeBenchConfig(endpoint="chat", output_len=7,
                           extra_body={"ignore_eos": None, "temperature": 0.5, "max_tokens": 9, "absent": None})
    body = request_body(cfg, "m", "hello")
    assert "ignore_eos" not in body and "absent" not in body
    assert body["temperature"] == 0.5 and body["max_tokens"] == 9 and body["messages"][0]["content"] == "hello"
    assert request_body(ServeBenchConfig(endpoint="chat"), "m", "x")["ignore_eos"] is True
