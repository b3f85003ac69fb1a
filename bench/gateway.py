"""The gateway's own overhead: the same load through HTTP and straight into the router (one JSON object).

    python -m bench.gateway [--num-prompts 48] [--max-concurrency 16] [--input-len 128] [--output-len 32]

Both runs use one in-process service (embedded Ray, 1 prefill + 1 decode actor, the built-in model),
the same token-id prompts and the same concurrency; the HTTP run goes through uvicorn + FastAPI + SSE
with the streaming client of `hisparse bench serve`, the direct run calls the router on the server's
own event loop. The ratios compare the two, measured side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import time

from bench.common import emit, environment, progress
from bench.serve import RequestResult, ServeBenchConfig, build_prompts, run_serve_bench, summarize
from core.roles import ClusterConfig, PrefillConfig, ServeConfig, ServerConfig, TierConfig
from core.types import GenerateRequest, SamplingParams


async def direct(service, cfg: ServeBenchConfig) -> dict:
    prompts = build_prompts(cfg)
    results = [RequestResult(index=i, prompt_tokens=cfg.input_len) for i in range(cfg.num_prompts)]
    gate = asyncio.Semaphore(cfg.max_concurrency or cfg.num_prompts)
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        async with gate:
            res = results[i]
            start = time.perf_counter()
            res.start_offset_s = start - t0
            last = None
            req = GenerateRequest(f"direct-{i}", tuple(prompts[i]), SamplingParams(max_tokens=cfg.output_len, ignore_eos=True))
            async for _ in service.generate(req, seed=i):
                now = time.perf_counter()
                if last is None:
                    res.ttft_s = now - start
                else:
                    res.itls_s.append(now - last)
                last = now
                res.output_tokens += 1
            res.e2e_s = time.perf_counter() - start
            res.success = True

    await asyncio.gather(*(one(i) for i in range(cfg.num_prompts)))
    return summarize(results, time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--max-concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    a = ap.parse_args(argv)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    from api.server import BackgroundServer
    from cluster.service import Service

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = ServeConfig(model="tiny", tier=TierConfig(device_budget_bytes=64 * 2**20, host_pool_bytes=256 * 2**20),
                      prefill=PrefillConfig(), cluster=ClusterConfig(placement="any"), server=ServerConfig(port=port))
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
    server = BackgroundServer(Service(cfg), cfg, port)
    try:
        url = server.start()
        bench = ServeBenchConfig(base_url=url, num_prompts=a.num_prompts, input_len=a.input_len, output_len=a.output_len,
                                 max_concurrency=a.max_concurrency, seed=0, progress=False)
        progress("warm-up")
        run_serve_bench(ServeBenchConfig(base_url=url, num_prompts=4, input_len=16, output_len=4, progress=False))
        rows = []
        for rep in range(2):  # alternate, so drift on the machine hits both alike
            progress(f"HTTP run {rep + 1}")
            http = run_serve_bench(bench)
            progress(f"direct run {rep + 1}")
            dr = server.run(direct(server.service, bench))
            rows.append((http, dr))
        keys = ("output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "median_e2el_ms")

        def pick(d: dict) -> dict:
            return {k: d[k] for k in keys} | {"completed": d["completed"], "failed": d["failed"]}

        http, dr = rows[-1]
        out = {"bench": "gateway", "env": environment(), "num_prompts": a.num_prompts, "max_concurrency": a.max_concurrency,
               "input_len": a.input_len, "output_len": a.output_len, "http": pick(http), "direct": pick(dr),
               "ratio_throughput_http_over_direct": round(http["output_throughput"] / dr["output_throughput"], 3),
               "ratio_median_ttft_http_over_direct": round(http["median_ttft_ms"] / dr["median_ttft_ms"], 3),
               "ratio_median_e2e_http_over_direct": round(http["median_e2el_ms"] / dr["median_e2el_ms"], 3),
               "first_repeat": {"http": pick(rows[0][0]), "direct": pick(rows[0][1])}}
        emit(out)
    finally:
        server.stop()
        ray.shutdown()


if __name__ == "__main__":
    main()
