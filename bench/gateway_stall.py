"""How long the gateway stops answering while it handles a huge text prompt (one JSON object).

    python -m bench.gateway_stall [--fits-mb 2] [--refused-mb 8] [--context 65536]

The gateway runs under uvicorn as `hisparse serve` runs it (`api.server.uvicorn_config`), in front of a
scripted cluster (every request gets two tokens at once, no Ray) and with the built-in model's tokenizer.
Two prompts, each sent alone while a prober in a process of its own polls /health every 100 ms:

- `fits`: `--fits-mb` of text under the built-in model's 1M-token context: it has to be tokenized;
- `refused`: `--refused-mb` of text to a model of `--context` tokens: it cannot fit at the tokenizer's
  densest, so it can be refused by its byte length.

For each: the answer's status and seconds, and the worst and median /health latency during it. A loop that
tokenizes with the GIL held shows the tokenizing time as the worst latency; one that stays free, a few
tens of milliseconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import subprocess
import sys
import threading
import time

import httpx
import uvicorn

from bench.common import emit, environment, progress

PROBE = """
import json, sys, threading, time
import httpx
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
latencies, failures = [], []
with httpx.Client(timeout=120) as c:
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            if c.get(sys.argv[1] + "/health").status_code != 200:
                failures.append("not 200")
        except httpx.HTTPError as e:
            failures.append(repr(e))
        latencies.append(time.perf_counter() - t0)
        if len(latencies) == 1:
            print("polling", flush=True)
        stop.wait(0.1)
print(json.dumps({"latencies": latencies, "failures": failures}))
"""


class HealthProbe:
    """Polls /health every 100 ms from a process of its own: a server that holds the GIL stalls every thread
    of its process, a prober's included, so only another process sees the stall. `worst_s` is the slowest
    answer; the latencies and failures are read when the block ends."""

    def __init__(self, url: str) -> None:
        self.url, self.latencies, self.failures = url, [], []

    def __enter__(self) -> HealthProbe:
        self._proc = subprocess.Popen([sys.executable, "-c", PROBE, self.url], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
        if self._proc.stdout.readline().strip() != "polling":  # it polls before anything starts
            raise RuntimeError("the /health prober did not start")
        return self

    def __exit__(self, *exc) -> None:
        out, _ = self._proc.communicate("", timeout=300)  # EOF on its stdin: it stops and reports
        report = json.loads(out)
        self.latencies, self.failures = report["latencies"], report["failures"]

    @property
    def worst_s(self) -> float:
        return max(self.latencies)


class _TwoTokens:
    """The cluster's side, scripted: every request is answered with two tokens at once."""

    def __init__(self) -> None:
        self.ids = iter(range(10**9))

    def ready(self) -> bool:
        return True

    def new_request_id(self) -> str:
        return f"stall-{next(self.ids)}"

    def check_admissible(self, req) -> None:
        pass

    def stats(self) -> dict:
        return {}

    async def generate(self, req, seed=None):
        from cluster.frontend import Output
        from core.types import SampledToken, TokenEvent

        yield Output([TokenEvent(req.request_id, 0, SampledToken(40)), TokenEvent(req.request_id, 1, SampledToken(41), "length")])


class _Service:
    def __init__(self, context: int | None) -> None:
        from model.builtin import SHIPPED
        from model.config import load_config
        from model.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(SHIPPED)
        self.model_cfg = load_config(SHIPPED, name="tiny")
        if context is not None:
            self.model_cfg = dataclasses.replace(self.model_cfg, max_position_embeddings=context)
        self.model_name = "tiny"
        self.frontend = _TwoTokens()

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


def text_of(mb: float, seed: int = 0) -> str:
    """About `mb` MB of prose-like ASCII (a few dozen words, space-separated)."""
    rng = random.Random(seed)
    words = "the serving gateway tokenizes prompts while streams decode sparse attention over a long context".split()
    out, size = [], 0
    while size < mb * 2**20:
        w = rng.choice(words)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


def measure(text: str, context: int | None) -> dict:
    from api.app import build_app
    from api.server import uvicorn_config
    from model.parallel import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = uvicorn.Server(uvicorn_config(build_app(_Service(context)), "127.0.0.1", port, log_level="warning",
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        with HealthProbe(url) as probe, httpx.Client(timeout=600) as c:
            t0 = time.perf_counter()
            r = c.post(url + "/v1/completions", json={"prompt": text, "max_tokens": 2})
            answer_s = time.perf_counter() - t0
            time.sleep(0.3)
    finally:
        server.should_exit = True
        thread.join(timeout=60)
    return {"bytes": len(text.encode()), "context": context, "status": r.status_code,
            "param": r.json()["error"]["param"] if r.status_code != 200 else None, "answer_s": round(answer_s, 3),
            "health_worst_s": round(probe.worst_s, 3), "health_median_s": round(statistics.median(probe.latencies), 4),
            "health_polls": len(probe.latencies), "health_failures": len(probe.failures)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fits-mb", type=float, default=2.0)
    ap.add_argument("--refused-mb", type=float, default=8.0)
    ap.add_argument("--context", type=int, default=65536, help="the `refused` case's model context, in tokens")
    args = ap.parse_args(argv)
    progress(f"fits: {args.fits_mb} MB against the built-in model's context")
    fits = measure(text_of(args.fits_mb), None)
    progress(f"refused: {args.refused_mb} MB against a {args.context}-token context")
    refused = measure(text_of(args.refused_mb), args.context)
    emit({"bench": "gateway_stall", "fits": fits, "refused": refused, "env": environment()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
