"""The serving path's ceiling: `hisparse serve` with stand-in model steps, B streams, one JSON object.

    python -m bench.serving_path [--streams 256] [--step-ms 20] [--prefill-ms 5] [--output-len 250] [--api-workers 1]

The decode step is replaced by a sleep of S ms that releases the GIL and yields one token per running
request, prefill by a real layout after P ms (see `model.stub`); everything else is real: the frontend,
reservations, the handoff over Ray, the per-step output messages, the gateway, SSE, uvicorn. The server
runs as its own process (the README's command with benchmark flags) and this process is the client.

Reported: served tokens/s over the window in which all B streams run, divided by the ideal B / S (one
token per stream per step); the whole-run rate beside it; and CPU-seconds per token of each process kind
(gateway, decode actor, prefill actor, Ray's daemons, this client), read from /proc around the run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

from bench.common import emit, environment, progress
from bench.procs import cpu_by_role, cpu_seconds, free_port, launch, stop
from bench.sse_client import run_streams, window_rate

_free_port = free_port  # the name chaos, longctx_http and prefix import


def start_server(args: list[str], port: int, timeout_s: float = 300) -> subprocess.Popen:
    """`hisparse serve --port PORT ARGS`, healthy."""
    cmd = [sys.executable, "-m", "hisparse.cli", "serve", "--port", str(port), *args]
    return launch(cmd, f"http://127.0.0.1:{port}", timeout_s)[0]


stop_server = stop


def run(streams: int, step_ms: float, prefill_ms: float, output_len: int, api_workers: int, prompt_len: int) -> dict:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(["--stub-step-ms", str(step_ms), "--stub-prefill-ms", str(prefill_ms), "--max-running", str(streams),
                           "--device-budget", "2GiB", "--host-pool-bytes", "256MiB", "--max-concurrent-requests", str(4 * streams),
                           "--api-workers", str(api_workers), "--max-batch-tokens", "8192"], port)
    try:
        body = {"prompt": list(range(6, 6 + prompt_len)), "max_tokens": output_len, "stream": True, "ignore_eos": True,
                "temperature": 0, "stream_options": {"continuous_usage_stats": True}}
        progress("warm-up")
        asyncio.run(run_streams(url, [dict(body, max_tokens=8)] * 8, 8))
        before, me0 = cpu_by_role(server.pid), cpu_seconds(os.getpid())
        progress(f"{streams} streams x {output_len} tokens, step {step_ms} ms")
        t0 = time.perf_counter()
        results = asyncio.run(run_streams(url, [body] * streams, streams))
        wall = time.perf_counter() - t0
        after, me1 = cpu_by_role(server.pid), cpu_seconds(os.getpid())
    finally:
        stop_server(server)
    rates = window_rate(results)
    tokens = rates["tokens"]
    ideal = streams / (step_ms / 1000)
    cpu = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    cpu["client"] = me1 - me0
    errors = [r.error for r in results if r.error]
    return {
        "streams": streams, "step_ms": step_ms, "prefill_ms": prefill_ms, "output_len": output_len, "api_workers": api_workers,
        "ideal_tokens_per_s": ideal,
        "served_tokens_per_s": round(rates["window_tokens_per_s"] or 0.0, 1),
        "ratio_served_over_ideal": round((rates["window_tokens_per_s"] or 0.0) / ideal, 3),
        "run_tokens_per_s": round(rates["run_tokens_per_s"] or 0.0, 1), "window_s": round(rates["window_s"], 2),
        "tokens": tokens, "expected_tokens": streams * output_len, "wall_s": round(wall, 2), "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "cpu_us_per_token": {k: round(1e6 * v / max(tokens, 1), 2) for k, v in sorted(cpu.items())},
        "cpu_cores_busy": {k: round(v / wall, 3) for k, v in sorted(cpu.items())},
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument("--prefill-ms", type=float, default=5.0)
    ap.add_argument("--output-len", type=int, default=250)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--api-workers", type=int, default=1)
    a = ap.parse_args(argv)
    emit({"bench": "serving_path", "env": environment(),
          **run(a.streams, a.step_ms, a.prefill_ms, a.output_len, a.api_workers, a.prompt_len)})


if __name__ == "__main__":
    main()
