"""Online serving benchmark (`hisparse bench serve`) for any OpenAI-compatible server.

Sends `num_prompts` streaming requests, either arriving as a Poisson process at `request_rate` (inf: all
at once) or kept at `max_concurrency` in flight (or both), and measures per request: time to first
token (TTFT), the gaps between tokens (ITL), time per output token after the first (TPOT) and the
end-to-end latency (E2EL). The result is one JSON-ready dict; the numbers are measurements of one run on
whatever machine ran it and are never asserted on.

Token counting: usage from the final chunk (`stream_options.include_usage`) is the truth when the server
sends it; otherwise each content chunk counts as one token (or as many as its `token_ids`/logprobs list
holds). When a chunk carries several tokens, the gap before it is split evenly among them, so every
successful request has exactly `output_tokens - 1` ITL values.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from types import MappingProxyType

import httpx
import numpy as np

ENDPOINT_PATHS = MappingProxyType({"completions": "/v1/completions", "chat": "/v1/chat/completions"})
# Words for chat prompts: plain ASCII so "about I characters" is also about I bytes.
_WORDS = (
    "the", "cache", "token", "sparse", "model", "layer", "host", "device", "buffer", "entry", "slot", "batch",
    "prefill", "decode", "attention", "window", "router", "request", "stream", "server", "latency", "memory",
    "vector", "index", "query", "key", "value", "block", "page", "pool", "ring", "state", "serve", "bench",
)


class ServeBenchError(RuntimeError):
    """The benchmark cannot start (server unreachable, no model name, bad settings)."""


@dataclass(frozen=True)
class ServeBenchConfig:
    """Everything one serving-benchmark run needs."""

    base_url: str = "http://127.0.0.1:8000"
    """Server root; the /v1/... paths are appended."""
    num_prompts: int = 100
    """Requests to send."""
    input_len: int = 128
    """Prompt length: exact token ids for `completions`, about this many characters for `chat`."""
    output_len: int = 128
    """max_tokens of every request (with ignore_eos, so each should produce exactly this many)."""
    request_rate: float = math.inf
    """Mean arrivals per second of a Poisson process; inf sends every request at once."""
    max_concurrency: int | None = None
    """Most requests in flight at once; None: no limit beyond the arrival process."""
    model: str | None = None
    """Model name sent with each request; None: the first id listed by GET /v1/models."""
    endpoint: str = "completions"
    """`completions` (token-id prompts) or `chat` (text prompts)."""
    seed: int = 0
    """Seed of the prompts and the arrival times."""
    vocab_range: tuple[int, int] = (10, 250)
    """Token ids of `completions` prompts are drawn uniformly from lo..hi (both included)."""
    timeout_s: float = 600.0
    """Give up on a request after this many seconds without data."""
    percentiles: tuple[float, ...] = (50.0, 99.0)
    """Percentiles reported for every latency (50 and 99 are always included)."""
    extra_body: dict | None = None
    """Extra fields merged into every request body (e.g. {"temperature": 0.7}); a null value removes a field this
    bench sends itself (e.g. {"ignore_eos": null} for a server that refuses fields it does not know)."""
    progress: bool = True
    """Show a tqdm progress bar on stderr."""
    require_done: bool = True
    """A stream must end with `data: [DONE]` (OpenAI's contract, which this server keeps); off, a stream whose last
    chunk carries a finish_reason also counts as complete (transformers serve ends there)."""

    def __post_init__(self) -> None:
        if self.num_prompts < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("num_prompts, input_len and output_len must be at least 1")
        if not self.request_rate > 0:
            raise ValueError("request_rate must be > 0 (inf for all at once)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        if self.endpoint not in ENDPOINT_PATHS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINT_PATHS)}, got {self.endpoint!r}")
        lo, hi = self.vocab_range
        if not 0 <= lo <= hi:
            raise ValueError(f"vocab_range must satisfy 0 <= lo <= hi, got {self.vocab_range}")
        if any(not 0 < p < 100 for p in self.percentiles):
            raise ValueError("percentiles must lie strictly between 0 and 100")

    def to_json(self) -> dict:
        d = asdict(self)
        d["request_rate"] = rate_to_json(self.request_rate)
        d["vocab_range"] = list(self.vocab_range)
        d["percentiles"] = list(self.percentiles)
        return d


@dataclass
class RequestResult:
    """What one request measured (times in seconds from its own send)."""

    index: int
    prompt_tokens: int | None = None
    success: bool = False
    error: str | None = None
    start_offset_s: float = 0.0
    """When it was sent, counted from the benchmark start."""
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    itls_s: list[float] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        if not self.success or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def rate_to_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def parse_rate(text: str) -> float:
    rate = float(text)
    if not rate > 0:
        raise ValueError(f"a request rate must be > 0 or inf, got {text!r}")
    return rate


# ---- workload --------------------------------------------------------------------------------------------


def build_prompts(cfg: ServeBenchConfig) -> list[list[int] | str]:
    """Token-id lists of exactly input_len for `completions`; texts of input_len characters for `chat`."""
    rng = np.random.default_rng(np.random.SeedSequence(cfg.seed).spawn(2)[0])
    if cfg.endpoint == "completions":
        lo, hi = cfg.vocab_range
        return [rng.integers(lo, hi + 1, size=cfg.input_len).tolist() for _ in range(cfg.num_prompts)]
    prompts: list[list[int] | str] = []
    for i in range(cfg.num_prompts):
        words = [f"{i}:"]
        length = len(words[0])
        while length < cfg.input_len:
            words.append(_WORDS[int(rng.integers(len(_WORDS)))])
            length += len(words[-1]) + 1
        prompts.append(" ".join(words)[: cfg.input_len])
    return prompts


def arrival_offsets(num: int, rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start: 0 for the first, then exponential gaps of mean 1/rate."""
    if math.isinf(rate):
        return [0.0] * num
    rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(2)[1])
    gaps = rng.exponential(1.0 / rate, size=num - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def request_body(cfg: ServeBenchConfig, model: str, prompt: list[int] | str) -> dict:
    body: dict = {
        "model": model,
        "max_tokens": cfg.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if cfg.endpoint == "completions":
        body["prompt"] = prompt
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
    for key, value in (cfg.extra_body or {}).items():
        if value is None:
            body.pop(key, None)
        else:
            body[key] = value
    return body


# ---- one streaming request ----------------------------------------------------------------------------------


def _sse_data(line: str) -> str | None:
    """The payload of an SSE `data:` line; None for blank lines, comments and other fields."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


def _chunk_content(chunk: dict) -> tuple[bool, int | None]:
    """(does this chunk carry generated tokens, how many when it says so)."""
    choices = chunk.get("choices") or []
    if not choices:
        return False, None
    choice = choices[0]
    if "delta" in choice:
        delta = choice.get("delta") or {}
        text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
    else:
        text = choice.get("text")
    count = None
    if isinstance(choice.get("token_ids"), list):
        count = len(choice["token_ids"])
    elif isinstance(choice.get("logprobs"), dict):
        lp = choice["logprobs"]
        listed = lp.get("tokens") if isinstance(lp.get("tokens"), list) else lp.get("content")
        count = len(listed) if isinstance(listed, list) else None
    return bool(text) or bool(count), count


def spread_tokens(chunk_counts: list[int | None], total: int) -> list[int]:
    """Tokens per content chunk summing to `total`: as the chunks said (unknown = 1) when that adds up,
    otherwise as even as possible."""
    guess = [1 if c is None else c for c in chunk_counts]
    if sum(guess) == total:
        return guess
    base, extra = divmod(total, len(chunk_counts))
    return [base + (1 if i < extra else 0) for i in range(len(chunk_counts))]


def token_gaps(chunk_times: list[float], chunk_tokens: list[int]) -> list[float]:
    """Inter-token latencies: tokens that share the first chunk get 0, later chunks split their gap evenly."""
    gaps: list[float] = []
    prev = None
    for t, n in zip(chunk_times, chunk_tokens):
        if n <= 0:
            continue
        if prev is None:
            gaps.extend([0.0] * (n - 1))
        else:
            gaps.extend([(t - prev) / n] * n)
        prev = t
    return gaps


async def send_request(client: httpx.AsyncClient, path: str, body: dict, result: RequestResult, bench_t0: float,
                       require_done: bool = True) -> None:
    """Stream one request and fill `result`; never raises for server or network trouble."""
    t0 = time.perf_counter()
    result.start_offset_s = t0 - bench_t0
    chunk_times: list[float] = []
    chunk_counts: list[int | None] = []
    usage: dict | None = None
    done = finished = False
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {text[:300]}"
                return
            async for line in resp.aiter_lines():
                data = _sse_data(line)
                if not data:
                    continue
                if data == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if chunk.get("error"):
                    result.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return
                has_tokens, count = _chunk_content(chunk)
                if has_tokens:
                    chunk_times.append(now)
                    chunk_counts.append(count)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                finished = finished or any(c.get("finish_reason") for c in chunk.get("choices") or ())
        end = time.perf_counter()
    except Exception as e:  # any transport or decoding failure is one failed request, not a failed benchmark
        result.error = f"{type(e).__name__}: {e}"
        return
    if not done and (require_done or not finished):
        result.error = "stream ended before [DONE]" if finished or require_done else "stream ended before a finish_reason"
        return
    if not chunk_times:
        result.error = "no tokens in the stream"
        return
    reported = (usage or {}).get("completion_tokens")
    total = reported if isinstance(reported, int) else sum(1 if c is None else c for c in chunk_counts)
    if isinstance((usage or {}).get("prompt_tokens"), int):
        result.prompt_tokens = usage["prompt_tokens"]
    result.success = True
    result.output_tokens = total
    result.ttft_s = chunk_times[0] - t0
    result.e2e_s = end - t0
    result.itls_s = token_gaps(chunk_times, spread_tokens(chunk_counts, total))


# ---- the run ---------------------------------------------------------------------------------------------


async def served_model(client: httpx.AsyncClient) -> str:
    """The first model id the server lists."""
    try:
        resp = await client.get("/v1/models")
    except httpx.HTTPError as e:
        raise ServeBenchError(f"cannot reach {client.base_url}: {type(e).__name__}: {e}") from None
    try:
        return resp.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ServeBenchError(f"GET /v1/models answered {resp.status_code} without a model id; pass --model") from None


def _client(cfg: ServeBenchConfig, transport: httpx.AsyncBaseTransport | None) -> httpx.AsyncClient:
    # The pool must not queue requests itself, or its waiting would count as server latency.
    limits = httpx.Limits(max_connections=cfg.max_concurrency, max_keepalive_connections=cfg.max_concurrency)
    timeout = httpx.Timeout(cfg.timeout_s, connect=min(30.0, cfg.timeout_s))
    return httpx.AsyncClient(base_url=cfg.base_url, transport=transport, limits=limits, timeout=timeout)


def _utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


async def _run(cfg: ServeBenchConfig, client: httpx.AsyncClient, model: str) -> dict:
    from tqdm import tqdm

    prompts = build_prompts(cfg)
    offsets = arrival_offsets(cfg.num_prompts, cfg.request_rate, cfg.seed)
    known_len = cfg.input_len if cfg.endpoint == "completions" else None
    results = [RequestResult(index=i, prompt_tokens=known_len) for i in range(cfg.num_prompts)]
    gate = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    path = ENDPOINT_PATHS[cfg.endpoint]
    in_flight = [0, 0]  # now, peak
    desc = f"rate={rate_to_json(cfg.request_rate)} conc={cfg.max_concurrency or 'inf'}"
    bar = tqdm(total=cfg.num_prompts, desc=desc, file=sys.stderr, disable=not cfg.progress, leave=False)

    async def one(i: int) -> None:
        delay = t0 + offsets[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if gate is not None:
            await gate.acquire()
        in_flight[0] += 1
        in_flight[1] = max(in_flight[1], in_flight[0])
        try:
            await send_request(client, path, request_body(cfg, model, prompts[i]), results[i], t0, cfg.require_done)
        finally:
            in_flight[0] -= 1
            if gate is not None:
                gate.release()
            bar.update(1)

    started_at = _utc_now()
    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(one(i) for i in range(cfg.num_prompts)))
    finally:
        bar.close()
    duration_s = time.perf_counter() - t0
    result = summarize(results, duration_s, cfg.percentiles)
    head = {"benchmark": "serve", "model": model, "endpoint": cfg.endpoint, "base_url": cfg.base_url,
            "request_rate": rate_to_json(cfg.request_rate), "max_concurrency": cfg.max_concurrency,
            "num_prompts": cfg.num_prompts, "input_len": cfg.input_len, "output_len": cfg.output_len,
            "started_at": started_at, "finished_at": _utc_now(), "peak_concurrency": in_flight[1]}
    return {**head, **result, "config": cfg.to_json()}


async def serve_bench(cfg: ServeBenchConfig, transport: httpx.AsyncBaseTransport | None = None) -> dict:
    """One benchmark run, for callers already inside an event loop."""
    async with _client(cfg, transport) as client:
        model = cfg.model or await served_model(client)
        return await _run(cfg, client, model)


async def serve_sweep(cfg: ServeBenchConfig, rates: list[float], transport: httpx.AsyncBaseTransport | None = None) -> dict:
    """The same workload at each request rate in turn."""
    started_at = _utc_now()
    runs = []
    async with _client(cfg, transport) as client:
        model = cfg.model or await served_model(client)
        for rate in rates:
            runs.append(await _run(replace(cfg, request_rate=rate), client, model))
    return {"benchmark": "serve_sweep", "model": model, "rates": [rate_to_json(r) for r in rates],
            "started_at": started_at, "finished_at": _utc_now(), "config": cfg.to_json(), "runs": runs}


def run_serve_bench(cfg: ServeBenchConfig, transport: httpx.AsyncBaseTransport | None = None) -> dict:
    """One benchmark run; `transport` (e.g. httpx.ASGITransport(app)) serves an in-process app."""
    return asyncio.run(serve_bench(cfg, transport))


def run_serve_sweep(cfg: ServeBenchConfig, rates: list[float], transport: httpx.AsyncBaseTransport | None = None) -> dict:
    return asyncio.run(serve_sweep(cfg, rates, transport))


# ---- metrics -------------------------------------------------------------------------------------------


def _pct_key(p: float) -> str:
    return f"p{p:g}".replace(".", "_")


def latency_stats(name: str, values_s: list[float], percentiles: tuple[float, ...]) -> dict:
    """mean/median/std/percentiles of `values_s` in milliseconds, as `{stat}_{name}_ms` keys (None when empty)."""
    wanted = sorted(set(percentiles) | {50.0, 99.0})
    keys = ["mean", "median", "std", *(_pct_key(p) for p in wanted)]
    if not values_s:
        return {f"{k}_{name}_ms": None for k in keys}
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    vals = [ms.mean(), np.median(ms), ms.std(), *np.percentile(ms, wanted)]
    return {f"{k}_{name}_ms": round(float(v), 4) for k, v in zip(keys, vals)}


def _per_s(count: int, duration_s: float) -> float | None:
    return round(count / duration_s, 4) if duration_s > 0 else None


def summarize(results: list[RequestResult], duration_s: float, percentiles: tuple[float, ...] = (50.0, 99.0)) -> dict:
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    d: dict = {
        "duration_s": round(duration_s, 6),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        # per second of the whole run: requests, output tokens, input + output tokens
        "request_throughput": _per_s(len(ok), duration_s),
        "output_throughput": _per_s(out_tokens, duration_s),
        "total_token_throughput": _per_s(in_tokens + out_tokens, duration_s),
    }
    d.update(latency_stats("ttft", [r.ttft_s for r in ok], percentiles))
    d.update(latency_stats("tpot", [r.tpot_s for r in ok if r.tpot_s is not None], percentiles))
    d.update(latency_stats("itl", [g for r in ok for g in r.itls_s], percentiles))
    d.update(latency_stats("e2el", [r.e2e_s for r in ok], percentiles))

    def r6(x: float | None) -> float | None:
        return None if x is None else round(x, 6)

    # Per-request arrays, index-aligned with the prompts; None where a request failed.
    d["input_lens"] = [r.prompt_tokens for r in results]
    d["output_lens"] = [r.output_tokens if r.success else None for r in results]
    d["ttfts_s"] = [r6(r.ttft_s) for r in results]
    d["e2els_s"] = [r6(r.e2e_s) for r in results]
    d["start_offsets_s"] = [r6(r.start_offset_s) for r in results]
    d["itls_s"] = [[r6(g) for g in r.itls_s] for r in results]
    d["errors"] = [r.error for r in results]
    return d


# ---- plots ---------------------------------------------------------------------------------------------

_LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency"))


def matplotlib_missing() -> str | None:
    """Why plotting is impossible here, or None when it is possible."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "plotting needs matplotlib (pip install matplotlib)"
    return None


def plot_cdfs(result: dict, path: str) -> None:
    """Empirical CDFs of TTFT, TPOT, ITL and E2E latency of one run, as a PNG."""
    from matplotlib.figure import Figure

    ok = [i for i, e in enumerate(result["errors"]) if e is None]
    series = {
        "ttft": [result["ttfts_s"][i] for i in ok],
        "tpot": [(result["e2els_s"][i] - result["ttfts_s"][i]) / (result["output_lens"][i] - 1)
                 for i in ok if result["output_lens"][i] > 1],
        "itl": [g for i in ok for g in result["itls_s"][i]],
        "e2el": [result["e2els_s"][i] for i in ok],
    }
    fig = Figure(figsize=(10, 7), layout="constrained")
    for ax, (key, label) in zip(fig.subplots(2, 2).flat, _LATENCIES):
        ms = np.sort(np.asarray(series[key], dtype=np.float64) * 1000.0)
        if ms.size:
            ax.step(ms, np.arange(1, ms.size + 1) / ms.size, where="post")
            for p, style in ((50, ":"), (99, "--")):
                ax.axvline(np.percentile(ms, p), color="grey", linestyle=style, label=f"p{p}")
            ax.legend(loc="lower right")
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{result['model']} {result['endpoint']}: rate={result['request_rate']} "
                 f"conc={result['max_concurrency'] or 'inf'}, {result['completed']} ok / {result['failed']} failed")
    fig.savefig(path, dpi=100)


def plot_sweep(sweep: dict, path: str) -> None:
    """p50/p99 of TTFT, TPOT and E2E latency, and achieved throughput, against offered request rate."""
    from matplotlib.figure import Figure

    runs = sweep["runs"]
    xs = np.arange(len(runs))
    labels = [r["request_rate"] if r["request_rate"] == "inf" else f"{r['request_rate']:g}" for r in runs]
    fig = Figure(figsize=(11, 8), layout="constrained")
    axes = fig.subplots(2, 2).flat
    for ax, (key, label) in zip(axes, (_LATENCIES[0], _LATENCIES[1], _LATENCIES[3])):
        for pct, marker in (("p50", "o"), ("p99", "s")):
            ys = [np.nan if r[f"{pct}_{key}_ms"] is None else r[f"{pct}_{key}_ms"] for r in runs]
            ax.plot(xs, ys, marker=marker, label=pct)
        ax.set_ylabel(f"{label} (ms)")
    ax = axes[3]
    ax.plot(xs, [r["request_throughput"] or 0.0 for r in runs], marker="o", label="achieved req/s")
    offered = [np.nan if r["request_rate"] == "inf" else r["request_rate"] for r in runs]
    ax.plot(xs, offered, linestyle="--", color="grey", label="offered req/s")
    ax.set_ylabel("requests / s")
    tok = ax.twinx()
    tok.plot(xs, [r["output_throughput"] or 0.0 for r in runs], marker="^", color="tab:green", label="output tok/s")
    tok.set_ylabel("output tokens / s")
    tok.legend(loc="lower right")
    for ax in fig.axes:
        ax.set_xticks(xs, labels)
        ax.set_xlabel("offered load (requests / s)")
        ax.grid(alpha=0.3)
        if ax is not tok:
            ax.legend(loc="upper left")
    fig.suptitle(f"{sweep['model']}: latency and throughput against offered load")
    fig.savefig(path, dpi=100)
