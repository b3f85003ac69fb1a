"""A lean streaming load client: many concurrent SSE completions over raw asyncio sockets.

Benchmarks run it in a process of its own (`python -m bench.sse_client`, spec on stdin, one JSON object
on stdout), so the client's CPU never competes with the server's inside one interpreter. Per stream it
records when each chunk arrived and how many tokens it carried (from the running usage of
`stream_options.continuous_usage_stats`), which is what rates over a window need when the server merges
tokens of a client that lags into one chunk.

    echo '{"url": "http://127.0.0.1:8000", "bodies": [...], "concurrency": 256}' | python -m bench.sse_client
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlparse

import orjson


@dataclass
class StreamResult:
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    status: int = 0
    error: str | None = None
    usage_tokens: int | None = None

    @property
    def tokens(self) -> int:
        return sum(self.chunk_tokens)


def _tokens_in(event: dict, so_far: int) -> int:
    """Tokens a chunk carries: from the running usage when the server sends it (`continuous_usage_stats`),
    else from its logprobs list, else one per chunk with text."""
    if event.get("usage") and event.get("choices"):
        return event["usage"]["completion_tokens"] - so_far
    choices = event.get("choices") or []
    if not choices:
        return 0
    lp = choices[0].get("logprobs")
    if lp and lp.get("tokens") is not None:
        return len(lp["tokens"])
    return 1 if choices[0].get("text") else 0


async def stream_one(host: str, port: int, path: str, body: dict, headers: dict[str, str] | None = None) -> StreamResult:
    res = StreamResult(start=time.perf_counter())
    payload = orjson.dumps(body)
    head = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json",
            f"Content-Length: {len(payload)}", "Accept: text/event-stream", "Connection: close"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as e:
        res.error = f"connect: {e}"
        return res
    try:
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
        await writer.drain()
        status_and_headers = await reader.readuntil(b"\r\n\r\n")
        res.status = int(status_and_headers.split(b" ", 2)[1])
        chunked = b"transfer-encoding: chunked" in status_and_headers.lower()
        buf = b""
        while True:
            if chunked:
                size_line = await reader.readline()
                size = int(size_line.strip() or b"0", 16)
                if size == 0:
                    break
                data = await reader.readexactly(size + 2)
                buf += data[:-2]
            else:
                data = await reader.read(65536)
                if not data:
                    break
                buf += data
            now = time.perf_counter()
            while b"\n\n" in buf:
                raw, buf = buf.split(b"\n\n", 1)
                if not raw.startswith(b"data: "):
                    continue
                data = raw[6:]
                if data == b"[DONE]":
                    continue
                event = orjson.loads(data)
                if "error" in event:
                    res.error = event["error"].get("message", "error")
                    continue
                n = _tokens_in(event, res.tokens)
                if event.get("usage"):
                    res.usage_tokens = event["usage"]["completion_tokens"]
                if n:
                    res.chunk_times.append(now)
                    res.chunk_tokens.append(n)
        if res.status != 200 and res.error is None:
            res.error = f"HTTP {res.status}: {buf[:200]!r}"
    except (OSError, asyncio.IncompleteReadError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        writer.close()
    return res


async def run_streams(url: str, bodies: list[dict], concurrency: int, path: str = "/v1/completions",
                      headers: dict[str, str] | None = None) -> list[StreamResult]:
    u = urlparse(url)
    gate = asyncio.Semaphore(concurrency)

    async def one(body: dict) -> StreamResult:
        async with gate:
            return await stream_one(u.hostname, u.port or 80, path, body, headers)

    return await asyncio.gather(*(one(b) for b in bodies))


def window_rate(results: list[StreamResult]) -> dict:
    """Tokens per second while every stream was running: from the last stream's first token to the first
    stream's last token (ramp-up and drain excluded), with the whole-run rate beside it."""
    done = [r for r in results if r.chunk_times]
    if not done:
        return {"window_tokens_per_s": None, "run_tokens_per_s": None, "window_s": 0.0}
    lo = max(r.chunk_times[0] for r in done)
    hi = min(r.chunk_times[-1] for r in done)
    tokens = sum(n for r in done for t, n in zip(r.chunk_times, r.chunk_tokens) if lo < t <= hi)
    first = min(r.start for r in done)
    last = max(r.chunk_times[-1] for r in done)
    total = sum(r.tokens for r in done)
    return {"window_tokens_per_s": tokens / (hi - lo) if hi > lo else None, "window_s": max(0.0, hi - lo),
            "run_tokens_per_s": total / (last - first) if last > first else None, "tokens": total}


def main() -> None:
    spec = json.load(sys.stdin)
    t0 = time.perf_counter()
    results = asyncio.run(run_streams(spec["url"], spec["bodies"], spec.get("concurrency", len(spec["bodies"])),
                                      spec.get("path", "/v1/completions"), spec.get("headers")))
    out = {"results": [asdict(r) for r in results], "wall_s": time.perf_counter() - t0}
    sys.stdout.write(json.dumps(out))


if __name__ == "__main__":
    main()
