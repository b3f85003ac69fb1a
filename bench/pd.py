"""PD split on Ray against the same workers in one process, on the same prompts (prints one JSON object).

    python -m bench.pd [--requests 16] [--prompt-len 512] [--output-len 64]

Reports time to first token (mean/median/p99), output tokens/s and end-to-end time for N concurrent
requests, PD split (1 prefill + 1 decode actor on an embedded local Ray) next to one process running
both workers, and the handoff bytes and time per request (from the packed layout to the decode actor's
acknowledgement, as the prefill actor measures it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

from bench.common import emit, environment, progress
from bench.serve import latency_stats
from core.roles import ClusterConfig, PrefillConfig, ServeConfig, TierConfig
from core.types import GenerateRequest, SamplingParams


def _summary(ttft: list[float], total_s: float, tokens: int) -> dict:
    return {**latency_stats("ttft", ttft, (50.0, 99.0)), "wall_s": round(total_s, 3),
            "output_tokens": tokens, "output_tokens_per_s": round(tokens / total_s, 1)}


def requests(n: int, prompt_len: int, output_len: int) -> list[GenerateRequest]:
    return [GenerateRequest(f"b{i}", tuple((31 * i + 7 * j) % 250 + 6 for j in range(prompt_len)),
                            SamplingParams(max_tokens=output_len, ignore_eos=True)) for i in range(n)]


def in_process(reqs: list[GenerateRequest], tier: TierConfig, prefill: PrefillConfig) -> dict:
    from cluster.inprocess import InProcessEngine
    from model.builtin import ensure_builtin
    from model.loader import load_model

    engine = InProcessEngine(load_model(ensure_builtin()), tier, prefill)
    first: dict[str, float] = {}
    t0 = time.perf_counter()

    def on_event(ev) -> None:
        first.setdefault(ev.request_id, time.perf_counter() - t0)

    done = engine.generate(reqs, on_event=on_event)
    total = time.perf_counter() - t0
    engine.close()
    return _summary(list(first.values()), total, sum(len(c.events) for c in done.values()))


def pd_split(reqs: list[GenerateRequest], tier: TierConfig, prefill: PrefillConfig) -> dict:
    import ray

    from cluster.service import Service

    cfg = ServeConfig(model="tiny", tier=tier, prefill=prefill, cluster=ClusterConfig(placement="any"))
    svc = Service(cfg, prefix="bench")

    async def go():
        await svc.start()
        await svc.complete(requests(1, 16, 4)[0])  # warm both actors
        first: dict[str, float] = {}
        t0 = time.perf_counter()

        async def one(r):
            n = 0
            async for _ in svc.generate(r, seed=0):
                first.setdefault(r.request_id, time.perf_counter() - t0)
                n += 1
            return n

        svc.frontend.handoffs.clear()
        counts = await asyncio.gather(*(one(r) for r in reqs))
        total = time.perf_counter() - t0
        out = _summary(list(first.values()), total, sum(counts))
        sizes = [b for b, _ in svc.frontend.handoffs]
        times = [s for _, s in svc.frontend.handoffs]
        out.update(handoff_bytes_per_request_mean=round(statistics.mean(sizes)), handoff_bytes_total=sum(sizes),
                   **latency_stats("handoff", times, (50.0, 99.0)))
        await svc.stop(shutdown_ray=True)
        return out

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        return asyncio.run(go())
    finally:
        if ray.is_initialized():
            ray.shutdown()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    a = ap.parse_args(argv)
    tier = TierConfig(device_budget_bytes=64 * 2**20, host_pool_bytes=256 * 2**20)
    prefill = PrefillConfig(max_batch_tokens=2048)
    reqs = requests(a.requests, a.prompt_len, a.output_len)
    progress("in one process")
    one = in_process(reqs, tier, prefill)
    progress("PD split on Ray")
    pd = pd_split(reqs, tier, prefill)
    emit({"bench": "pd", "env": environment(), "requests": a.requests, "prompt_len": a.prompt_len, "output_len": a.output_len,
          "in_process": one, "pd_split": pd,
          "ratio_tokens_per_s_pd_over_in_process": round(pd["output_tokens_per_s"] / one["output_tokens_per_s"], 3),
          "ratio_ttft_median_pd_over_in_process": round(pd["median_ttft_ms"] / one["median_ttft_ms"], 3)})


if __name__ == "__main__":
    main()
