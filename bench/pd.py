"""PD split on Ray against the same workers in one process, on the same prompts (prints one JSON object).

    python -m bench.pd [--requests 16] [--prompt-len 512] [--output-len 64] [--repeats 3]

Reports time to first token (mean/median/p99), output tokens/s and end-to-end time for N concurrent
requests, PD split (1 prefill + 1 decode actor on an embedded local Ray) next to one process running
both workers, and the handoff bytes and time per request (from the packed layout to the decode actor's
acknowledgement, as the prefill actor measures it). The setups take turns for `--repeats` rounds;
each ratio is the median over the rounds of that round's ratio.

The one-process run is made twice, with its thread count set rather than inherited from the shell:
- with the threads one actor gets (`decode_num_cpus`, 1): the same workers as in the split, so the ratio
  shows what the split's plumbing costs (the headline ratio);
- with every core: one process then uses both cores for whichever phase runs, while the split keeps one
  core per role, so on a 2-core machine this ratio also carries the static split of the cores.

Decode steps are counted on both sides: in one process a prefill step holds decode back, so decode runs
fewer, fuller steps; in the split the decode actor starts on the first requests while the rest are still
in prefill, and runs more steps for the same tokens (each costs about the same on the CPU, whatever its
rows). CPU-seconds per process come with each round.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import time

from bench.common import emit, environment, progress
from bench.procs import cpu_by_role, cpu_seconds
from bench.serve import latency_stats
from core.configs import EAGER_STEP, ClusterConfig, PrefillConfig, ServeConfig, TierConfig
from core.request import Request
from core.types import SamplingParams


def _summary(ttft: list[float], total_s: float, tokens: int) -> dict:
    return {**latency_stats("ttft", ttft, (50.0, 99.0)), "wall_s": round(total_s, 3),
            "output_tokens": tokens, "output_tokens_per_s": round(tokens / total_s, 1)}


def requests(n: int, prompt_len: int, output_len: int) -> list[Request]:
    return [Request(f"b{i}", tuple((31 * i + 7 * j) % 250 + 6 for j in range(prompt_len)),
                            SamplingParams(max_tokens=output_len, ignore_eos=True)) for i in range(n)]


class InProcess:
    """The same workers in this process (`InProcessEngine`), run with a set number of threads."""

    def __init__(self, tier: TierConfig, prefill: PrefillConfig, threads: int) -> None:
        from cluster.inprocess import InProcessEngine
        from model.builtin import ensure_builtin
        from model.loader import load_model

        self.threads = threads
        self.engine = InProcessEngine(load_model(ensure_builtin()), tier, prefill, step=EAGER_STEP)

    def run(self, reqs: list[Request]) -> dict:
        import torch

        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            first: dict[str, float] = {}
            t0 = time.perf_counter()

            def on_event(ev) -> None:
                first.setdefault(ev.request_id, time.perf_counter() - t0)

            c0, s0 = cpu_seconds(os.getpid()), self.engine.decode.steps
            done = self.engine.generate(reqs, on_event=on_event)
            out = _summary(list(first.values()), time.perf_counter() - t0, sum(len(c.events) for c in done.values()))
            return out | {"cpu_s": round(cpu_seconds(os.getpid()) - c0, 3), "decode_steps": self.engine.decode.steps - s0}
        finally:
            torch.set_num_threads(before)


async def pd_run(svc, reqs: list[Request]) -> dict:
    first: dict[str, float] = {}
    t0 = time.perf_counter()

    async def one(r):
        n = 0
        async for _ in svc.generate(r):
            first.setdefault(r.request_id, time.perf_counter() - t0)
            n += 1
        return n

    svc.frontend.handoffs.clear()
    decode = svc.actors.decode[0]
    steps = (await decode.stats.remote()).steps
    before = cpu_by_role(os.getpid())
    counts = await asyncio.gather(*(one(r) for r in reqs))
    out = _summary(list(first.values()), time.perf_counter() - t0, sum(counts))
    after = cpu_by_role(os.getpid())
    # this process holds the frontend (the gateway's part); the actors and Ray's daemons are its children
    out["cpu_s"] = {k: round(after.get(k, 0.0) - before.get(k, 0.0), 3) for k in sorted(after)}
    out["decode_steps"] = (await decode.stats.remote()).steps - steps
    sizes = [b for b, _ in svc.frontend.handoffs]
    times = [s for _, s in svc.frontend.handoffs]
    out.update(handoff_bytes_per_request_mean=round(statistics.mean(sizes)), handoff_bytes_total=sum(sizes),
               **latency_stats("handoff", times, (50.0, 99.0)))
    return out


def _named(reqs: list[Request], tag: str) -> list[Request]:
    return [dataclasses.replace(r, request_id=f"{r.request_id}-{tag}") for r in reqs]


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def compare(reqs: list[Request], tier: TierConfig, prefill: PrefillConfig, repeats: int) -> dict:
    """Interleaved rounds: one process with an actor's threads, one process with every core, the PD split."""
    import ray

    from cluster.service import Service

    actor_threads = max(1, int(ClusterConfig().decode_num_cpus))  # what each actor of the split gets
    setups = {"in_process": InProcess(tier, prefill, actor_threads),
              "in_process_every_core": InProcess(tier, prefill, os.cpu_count() or 1)}
    cfg = ServeConfig(model="tiny", tier=tier, prefill=prefill, step=EAGER_STEP, cluster=ClusterConfig(placement="any"))
    svc = Service(cfg, prefix="bench")
    rounds: list[dict] = []

    async def go():
        await svc.start()
        await svc.complete(requests(1, 16, 4)[0])  # warm both actors
        for name, setup in setups.items():
            setup.run(_named(reqs[:2], f"warm-{name}"))
        for rep in range(repeats):  # interleaved, so drift on the machine hits every setup alike
            progress(f"round {rep + 1} of {repeats}")
            row = {name: setup.run(_named(reqs, f"{name}-{rep}")) for name, setup in setups.items()}
            row["pd_split"] = await pd_run(svc, _named(reqs, f"pd-{rep}"))
            rounds.append(row)
        await svc.stop(shutdown_ray=True)

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        asyncio.run(go())
    finally:
        for setup in setups.values():
            setup.engine.close()
        if ray.is_initialized():
            ray.shutdown()

    def ratios(key: str, base: str) -> list[float]:
        return [round(r["pd_split"][key] / r[base][key], 3) for r in rounds]

    tps = ratios("output_tokens_per_s", "in_process")
    every = ratios("output_tokens_per_s", "in_process_every_core")
    ttft = ratios("median_ttft_ms", "in_process")
    return {"in_process_threads": actor_threads, "rounds": rounds,
            "ratio_tokens_per_s_pd_over_in_process": _median(tps), "ratios_tokens_per_s_by_round": tps,
            "ratio_ttft_median_pd_over_in_process": _median(ttft),
            "ratio_tokens_per_s_pd_over_in_process_every_core": _median(every), "ratios_every_core_by_round": every,
            "handoff_ms_p50": _median([r["pd_split"]["p50_handoff_ms"] for r in rounds]),
            "handoff_ms_p99": _median([r["pd_split"]["p99_handoff_ms"] for r in rounds]),
            "handoff_bytes_per_request_mean": rounds[-1]["pd_split"]["handoff_bytes_per_request_mean"],
            "decode_steps_in_process_vs_pd": [rounds[-1]["in_process"]["decode_steps"], rounds[-1]["pd_split"]["decode_steps"]]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    tier = TierConfig(device_budget_bytes=64 * 2**20, host_pool_bytes=256 * 2**20)
    prefill = PrefillConfig(max_batch_tokens=2048)
    out = compare(requests(a.requests, a.prompt_len, a.output_len), tier, prefill, a.repeats)
    emit({"bench": "pd", "env": environment(), "requests": a.requests, "prompt_len": a.prompt_len,
          "output_len": a.output_len, "repeats": a.repeats, **out})


if __name__ == "__main__":
    main()
