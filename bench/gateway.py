"""The gateway's own cost: the same load through HTTP and straight into the frontend (one JSON object).

    python -m bench.gateway [--num-prompts 48] [--max-concurrency 16] [--input-len 128] [--output-len 32] [--repeats 5]

One service (embedded Ray, 1 prefill + 1 decode actor, the built-in model) serves both runs. The HTTP run
goes through uvicorn + FastAPI + SSE with the load client in a process of its own (`bench.sse_client`), so
client CPU never shares this interpreter; the direct run feeds the same prompts to the frontend on the
server's own event loop. Runs alternate `--repeats` times; each figure is the median over the pairs of
that pair's figure (the tokens/s ratio, and the time to first token HTTP adds in ms at p50 and p99), with
every pair's value beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np

from bench.common import emit, environment, progress
from core.configs import EAGER_STEP, ClusterConfig, PrefillConfig, ServeConfig, ServerConfig, TierConfig
from core.request import Request
from core.types import SamplingParams


def prompts(n: int, length: int) -> list[list[int]]:
    return [[(31 * i + 7 * j) % 250 + 6 for j in range(length)] for i in range(n)]


def _stats(ttfts_s: list[float], tokens: int, wall: float) -> dict:
    ms = np.asarray(ttfts_s) * 1000
    return {"tokens_per_s": round(tokens / wall, 1), "tokens": tokens, "wall_s": round(wall, 3),
            "ttft_p50_ms": round(float(np.percentile(ms, 50)), 2), "ttft_p99_ms": round(float(np.percentile(ms, 99)), 2)}


async def direct(service, ps: list[list[int]], output_len: int, concurrency: int) -> dict:
    gate = asyncio.Semaphore(concurrency)
    ttfts, counts = [], []
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        async with gate:
            start = time.perf_counter()
            req = Request(f"direct-{i}-{time.monotonic_ns()}", tuple(ps[i]),
                                  SamplingParams(max_tokens=output_len, ignore_eos=True))
            n = 0
            async for out in service.outputs(req, seed=i):
                if n == 0 and out.events:
                    ttfts.append(time.perf_counter() - start)
                n += len(out.events)
            counts.append(n)

    await asyncio.gather(*(one(i) for i in range(len(ps))))
    return _stats(ttfts, sum(counts), time.perf_counter() - t0)


def http(url: str, ps: list[list[int]], output_len: int, concurrency: int) -> dict:
    bodies = [{"prompt": p, "max_tokens": output_len, "ignore_eos": True, "stream": True, "temperature": 0,
               "stream_options": {"continuous_usage_stats": True}} for p in ps]
    spec = json.dumps({"url": url, "bodies": bodies, "concurrency": concurrency})
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "bench.sse_client"], input=spec, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    res = json.loads(out.stdout)["results"]
    errors = [r["error"] for r in res if r["error"]]
    if errors:
        raise RuntimeError(f"{len(errors)} HTTP requests failed, first: {errors[0]}")
    ttfts = [r["chunk_times"][0] - r["start"] for r in res]
    # the client's own start-up is not the server's time: measure from its first request to its last token
    span = max(r["chunk_times"][-1] for r in res) - min(r["start"] for r in res)
    return _stats(ttfts, sum(sum(r["chunk_tokens"]) for r in res), span) | {"client_process_wall_s": round(wall, 3)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--max-concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    import ray

    from api.server import BackgroundServer
    from cluster.service import Service

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = ServeConfig(model="tiny", step=EAGER_STEP, tier=TierConfig(device_budget_bytes=64 * 2**20, host_pool_bytes=256 * 2**20),
                      prefill=PrefillConfig(), cluster=ClusterConfig(placement="any"), server=ServerConfig(port=port))
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
    server = BackgroundServer(Service(cfg), cfg, port)
    try:
        url = server.start()
        ps = prompts(a.num_prompts, a.input_len)
        progress("warm-up")
        http(url, ps[:4], 4, 4)
        server.run(direct(server.service, ps[:4], 4, 4))
        rows = []
        for rep in range(a.repeats):  # alternate, so drift on the machine hits both alike
            progress(f"HTTP run {rep + 1}")
            h = http(url, ps, a.output_len, a.max_concurrency)
            progress(f"direct run {rep + 1}")
            d = server.run(direct(server.service, ps, a.output_len, a.max_concurrency))
            rows.append({"http": h, "direct": d})
        ratio = [round(r["http"]["tokens_per_s"] / r["direct"]["tokens_per_s"], 3) for r in rows]
        p50 = [round(r["http"]["ttft_p50_ms"] - r["direct"]["ttft_p50_ms"], 2) for r in rows]
        p99 = [round(r["http"]["ttft_p99_ms"] - r["direct"]["ttft_p99_ms"], 2) for r in rows]
        emit({"bench": "gateway", "env": environment(), "num_prompts": a.num_prompts, "max_concurrency": a.max_concurrency,
              "input_len": a.input_len, "output_len": a.output_len, "repeats": a.repeats, "runs": rows,
              "ratio_tokens_per_s_http_over_direct": round(float(np.median(ratio)), 3), "ratios_by_pair": ratio,
              "ttft_added_by_http_p50_ms": round(float(np.median(p50)), 2), "ttft_added_p50_by_pair": p50,
              "ttft_added_by_http_p99_ms": round(float(np.median(p99)), 2), "ttft_added_p99_by_pair": p99})
    finally:
        server.stop()
        ray.shutdown()


if __name__ == "__main__":
    main()
