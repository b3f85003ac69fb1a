"""The gateway under a real uvicorn on 127.0.0.1, without Ray: what only a real server and real sockets
show. The event loop stays free under a huge prompt, a bad request leaves its keep-alive connection
usable, the header-read deadline closes a slowloris connection, and the access log never holds a key.

The cluster is the scripted frontend of test_gateway.py; the tokenizer is the built-in model's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from test_gateway import FakeService, ScriptedFrontend

from api.app import build_app
from api.server import uvicorn_config
from bench.gateway_stall import HealthProbe
from cluster.frontend import Output
from core.configs import ServerConfig
from core.types import SampledToken, TokenEvent
from model.builtin import SHIPPED
from model.parallel import free_port
from model.tokenizer import load_tokenizer

HEALTH_BOUND_S = 1.0
"""The worst /health latency allowed while a huge prompt is being handled (the requirement itself)."""


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(SHIPPED)


class PacedFrontend(ScriptedFrontend):
    """Every request streams its tokens one at a time, `gap_s` apart (a stream that lasts a while)."""

    def __init__(self, tokens: list[int], gap_s: float) -> None:
        super().__init__(tokens)
        self.gap_s = gap_s

    async def generate(self, req, seed=None):
        toks = self.tokens[: req.sampling.max_tokens]
        for i, t in enumerate(toks):
            await asyncio.sleep(self.gap_s)
            yield Output([TokenEvent(req.request_id, i, SampledToken(t), "length" if i == len(toks) - 1 else None)])


class Served:
    """The app under uvicorn on a background thread, as `hisparse serve` runs it (same config builder)."""

    def __init__(self, frontend, context: int | None = None, header_timeout_s: float = 10.0, http: str | None = None,
                 **server) -> None:
        service = FakeService(frontend)
        if context is not None:
            service.model_cfg = dataclasses.replace(service.model_cfg, max_position_embeddings=context)
        self.service = service
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn_config(build_app(service, ServerConfig(**server)), "127.0.0.1", self.port,
                                header_timeout_s=header_timeout_s, http=http, log_config=None, log_level="info",
                                lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Served:
        self.thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.05)
        raise TimeoutError("the gateway did not start")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def _stream(url: str, out: list) -> None:
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": [5], "max_tokens": 30, "stream": True},
                      timeout=60) as r:
        lines = [x for x in r.iter_lines() if x.startswith("data: ")]
    out.append((r.status_code, lines))


def _beside_two_streams(served: Served, send_big) -> tuple[list, HealthProbe, object]:
    """Run `send_big()` while two streams run and /health is polled; returns (streams, probe, big's result)."""
    streams: list = []
    with HealthProbe(served.url) as probe:
        threads = [threading.Thread(target=_stream, args=(served.url, streams)) for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.3)  # both streams are under way
        big = send_big()
        for t in threads:
            t.join(timeout=120)
        time.sleep(0.3)
    return streams, probe, big


def _assert_unharmed(streams: list, probe: HealthProbe, tok, tokens: list[int]) -> None:
    assert len(streams) == 2
    for status, lines in streams:
        assert status == 200 and lines[-1] == "data: [DONE]"
        chunks = [json.loads(x[6:]) for x in lines[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks) == tok.decode(tokens)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len(probe.latencies) >= 10 and not probe.failures, probe.failures[:3]
    assert probe.worst_s < HEALTH_BOUND_S, f"/health took {probe.worst_s:.2f} s at worst"


def test_an_8mb_prompt_that_cannot_fit_is_refused_before_tokenizing_and_the_loop_stays_free(tok):
    """8 MB of text cannot be 65,536 tokens at the tokenizer's densest: 400 at once, for completions, chat and
    /tokenize, while two streams run and /health keeps answering."""
    tokens = list(range(40, 70))
    text = "a" * (8 << 20)

    def send_big():
        with httpx.Client(timeout=120) as c:
            return [c.post(served.url + "/v1/completions", json={"prompt": text, "max_tokens": 4}),
                    c.post(served.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": text}]}),
                    c.post(served.url + "/tokenize", json={"prompt": text})]

    with Served(PacedFrontend(tokens, gap_s=0.05), context=65536) as served:
        streams, probe, big = _beside_two_streams(served, send_big)
    for r, param in zip(big, ("prompt", "messages", "prompt")):
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and "65536" in err["message"] and "bytes" in err["message"]
    _assert_unharmed(streams, probe, tok, tokens)


def test_a_long_prompt_that_fits_is_tokenized_off_the_loop(tok):
    """2 MB of text fits the built-in model's 1M-token context: it is tokenized (completions and chat), and the
    loop keeps serving /health and the streams while it is."""
    random.seed(3)
    words = "serving sparse attention gateway prompt tokens stream health latency model context decode".split()
    text = " ".join(random.choice(words) for _ in range(1 << 18)) + "."  # ~2 MB
    n = len(tok.encode(text, add_special_tokens=False))
    tokens = list(range(40, 70))

    def send_big():
        with httpx.Client(timeout=300) as c:
            return [c.post(served.url + "/v1/completions", json={"prompt": text, "max_tokens": 2}),
                    c.post(served.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": text}],
                                                                      "max_tokens": 2})]

    with Served(PacedFrontend(tokens, gap_s=0.1)) as served:
        streams, probe, big = _beside_two_streams(served, send_big)
    completion, chat = big
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["prompt_tokens"] == n + 1  # the BOS the tokenizer adds
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == n + 3  # <|user|>, the text, "\n", <|assistant|>
    _assert_unharmed(streams, probe, tok, tokens)


def _exchange(sock: socket.socket, method: str, path: str, body: bytes = b"") -> tuple[int, dict, bytes]:
    """One HTTP/1.1 request on an open connection; the response read to the end of its body."""
    head = f"{method} {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    sock.sendall(head.encode() + body)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection"
        buf += chunk
    raw_head, rest = buf.split(b"\r\n\r\n", 1)
    lines = raw_head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:])}
    size = int(headers.get("content-length", 0))
    while len(rest) < size:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection mid-body"
        rest += chunk
    return int(lines[0].split()[1]), headers, rest[:size]


def test_a_lone_surrogate_is_a_400_naming_the_field_and_the_connection_stays_usable():
    bad = [
        ("/v1/completions", b'{"prompt": "ab\\ud800cd", "max_tokens": 2}', "prompt"),
        ("/v1/completions", b'{"prompt": ["fine", "x\\udfffy"], "max_tokens": 2}', "prompt[1]"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "ab\\ud800cd"}]}', "messages[0].content"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
         "messages[0].content[0].text"),
        ("/v1/completions", b'{"prompt": "ok", "stop": ["\\ud800"], "max_tokens": 2}', "stop[0]"),
        ("/v1/completions", b'{"prompt": "ok", "model": "\\ud800", "max_tokens": 2}', "model"),
        ("/tokenize", b'{"prompt": "ab\\ud800cd"}', "prompt"),
    ]
    with Served(ScriptedFrontend([40, 41])) as served, socket.create_connection(("127.0.0.1", served.port), timeout=30) as s:
        for path, body, param in bad:
            status, headers, payload = _exchange(s, "POST", path, body)
            assert status == 400, (path, payload)
            err = json.loads(payload)["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
            assert err["param"] == param and "surrogate" in err["message"]
            assert headers.get("connection", "").lower() != "close"
        # a valid pair is one character, not a lone half: it is served, on the same connection
        status, _, payload = _exchange(s, "POST", "/v1/completions", b'{"prompt": "hi \\ud83d\\ude00", "max_tokens": 2}')
        assert status == 200, payload
        assert _exchange(s, "GET", "/health")[0] == 200


def _read_until_closed(sock: socket.socket, dribble: bytes, every_s: float, for_s: float) -> tuple[bytes, bool]:
    """Send `dribble` a byte at a time, `every_s` apart, for up to `for_s`; returns (what the server sent,
    whether it closed the connection meanwhile)."""
    sock.setblocking(False)
    got, t_end, i = b"", time.monotonic() + for_s, 0
    while time.monotonic() < t_end:
        try:
            chunk = sock.recv(4096)
            if not chunk:
                return got, True
            got += chunk
        except BlockingIOError:
            pass
        except (ConnectionResetError, BrokenPipeError):
            return got, True
        try:
            sock.send(dribble[i % len(dribble) : i % len(dribble) + 1])
        except (BrokenPipeError, ConnectionResetError):
            return got, True
        i += 1
        time.sleep(every_s)
    return got, False


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_headers_sent_byte_by_byte_are_cut_off_at_the_header_deadline(http):
    """A slowloris connection (headers a byte every 100 ms, forever) is answered 408 and closed once the
    deadline passes; so is a connection that sends nothing. A stream that outlasts the deadline is not cut,
    and its connection serves the next request."""
    pytest.importorskip(http)
    deadline_s = 1.0
    with Served(PacedFrontend(list(range(40, 60)), gap_s=0.1), header_timeout_s=deadline_s, http=http) as served:
        with socket.create_connection(("127.0.0.1", served.port)) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: gw\r\n")
            got, closed = _read_until_closed(s, b"X-Slow: abcdefghijklmnopqrstuvwxyz\r\n", 0.1, 8 * deadline_s)
        assert closed, "a connection dribbling its headers was still open after 8x the deadline"
        assert got.startswith(b"HTTP/1.1 408")
        with socket.create_connection(("127.0.0.1", served.port)) as s:
            got, closed = _silent(s, 8 * deadline_s)
        assert closed and got.startswith(b"HTTP/1.1 408")
        with socket.create_connection(("127.0.0.1", served.port), timeout=30) as s:
            body = b'{"prompt": [5], "max_tokens": 20}'  # 20 tokens 100 ms apart: twice the deadline
            status, _, payload = _exchange(s, "POST", "/v1/completions", body)
            assert status == 200 and json.loads(payload)["choices"][0]["finish_reason"] == "length"
            assert _exchange(s, "GET", "/health")[0] == 200


def _silent(sock: socket.socket, for_s: float) -> tuple[bytes, bool]:
    """Send nothing; returns (what the server sent, whether it closed) after up to `for_s`."""
    sock.settimeout(for_s)
    got = b""
    try:
        while True:
            chunk = sock.recv(4096)
            if not chunk:
                return got, True
            got += chunk
    except TimeoutError:
        return got, False


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_key_in_the_query_string_never_reaches_the_access_log():
    access = logging.getLogger("uvicorn.access")
    lines = _Lines()
    access.addHandler(lines)
    level = access.level
    access.setLevel(logging.INFO)
    try:
        with Served(ScriptedFrontend([40]), api_key="s3cret") as served:
            r = httpx.get(served.url + "/v1/models?api_key=s3cret&view=full")
            ok = httpx.get(served.url + "/v1/models?token=s3cret", headers={"Authorization": "Bearer s3cret"})
    finally:
        access.removeHandler(lines)
        access.setLevel(level)
    logged = [x for x in lines.lines if "/v1/models" in x]
    assert len(logged) == 2, lines.lines
    assert not any("s3cret" in x for x in lines.lines)
    assert "/v1/models?api_key=***&view=full" in logged[0] and "/v1/models?token=***" in logged[1]
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert "query string" in r.json()["error"]["message"]
    assert ok.status_code == 200
