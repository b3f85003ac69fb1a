"""Chaos: a seeded mixed load on `hisparse serve` while actors are SIGKILLed at seeded moments (one JSON object).

    python -m bench.chaos [--requests 300] [--kills 6] [--seed 0] [--soak 0] [--server-args '...']

The server runs as its own process (2 prefill + 2 decode actors, the built-in model); this process is the
client and the fault injector. The load mixes streaming and not, text and token-id prompts, n > 1, clients
that leave early, shared X-Request-Ids and invalid bodies; every sampled request is greedy or seeded, so
its output is fixed. The same load runs twice: undisturbed, then with kills; a completed request must
equal its undisturbed twin. Afterwards, once idle, nothing may be held anywhere (pages, host blocks,
layouts in a handoff, per-request table entries), and the decode actors' idle integrity checks must pass.

`--soak N` then sends N short requests and reports every actor's resident memory and every per-request
table before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import time

import httpx

from bench.common import emit, environment, progress
from bench.procs import descendants, role, rss_bytes
from bench.serving_path import _free_port, start_server, stop_server


def load(n: int, seed: int) -> list[dict]:
    """n requests: (kind, body, headers, leave_after) with kind in stream/plain/invalid."""
    rng = random.Random(seed)
    words = ["import", "def", "return", "class", "self", "value", "print", "for", "in", "range", "data", "list"]
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.06:
            body = rng.choice([{"prompt": "x", "max_tokens": -3}, {"prompt": [], "max_tokens": 3}, {"prompt": "x", "n": 99},
                               {"prompt": [5, 10**8]}, {"max_tokens": 4}, {"prompt": "x", "temperature": "hot"}])
            out.append({"kind": "invalid", "body": body, "headers": {}, "leave_after": None})
            continue
        prompt = (" ".join(rng.choice(words) for _ in range(rng.randint(3, 40))) if rng.random() < 0.5
                  else [rng.randint(6, 250) for _ in range(rng.randint(4, 200))])
        body = {"prompt": prompt, "max_tokens": rng.randint(4, 48), "ignore_eos": True}
        if rng.random() < 0.5:
            body.update(temperature=0)
        else:
            body.update(temperature=0.8, seed=rng.randint(0, 10**6))
        if rng.random() < 0.15:
            body["n"] = rng.randint(2, 3)
        stream = rng.random() < 0.6
        body["stream"] = stream
        headers = {"X-Request-Id": "shared-id"} if rng.random() < 0.2 else {}
        leave = rng.randint(1, 3) if stream and rng.random() < 0.1 else None
        out.append({"kind": "stream" if stream else "plain", "body": body, "headers": headers, "leave_after": leave})
    return out


async def _one(client: httpx.AsyncClient, url: str, req: dict, timeout_s: float) -> dict:
    """Send one request; returns {status, texts (per choice, complete requests only), left, hung, error}."""
    res = {"status": None, "texts": None, "left": False, "hung": False, "error": None}
    try:
        await asyncio.wait_for(_exchange(client, url, req, res), timeout_s)
    except asyncio.TimeoutError:
        res["hung"] = True
    except httpx.HTTPError as e:
        res["error"] = type(e).__name__
    return res


async def _exchange(client: httpx.AsyncClient, url: str, req: dict, res: dict) -> None:
    if not req["body"].get("stream"):
        r = await client.post(url + "/v1/completions", json=req["body"], headers=req["headers"])
        res["status"] = r.status_code
        if r.status_code == 200:
            res["texts"] = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
        return
    async with client.stream("POST", url + "/v1/completions", json=req["body"], headers=req["headers"]) as r:
        res["status"] = r.status_code
        texts: dict[int, str] = {}
        seen = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                res["error"] = ev["error"].get("type")
                res["status"] = f"stream:{ev['error'].get('type')}"
                return
            for c in ev.get("choices", []):
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            seen += 1
            if req["leave_after"] is not None and seen >= req["leave_after"]:
                res["left"] = True
                return
        if r.status_code == 200:
            res["texts"] = [texts.get(i, "") for i in range(len(texts))]


async def _run_load(url: str, reqs: list[dict], concurrency: int, timeout_s: float) -> list[dict]:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=concurrency + 8)) as client:
        async def one(req):
            async with gate:
                return await _one(client, url, req, timeout_s)

        return await asyncio.gather(*(one(r) for r in reqs))


def actor_pids(server_pid: int) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {"prefill": [], "decode": []}
    for pid in descendants(server_pid):
        r = role(pid)
        if r in out:
            out[r].append(pid)
    return out


async def _killer(server_pid: int, kills: int, span_s: float, seed: int, log: list) -> None:
    rng = random.Random(seed + 1)
    moments = sorted(rng.uniform(0.5, span_s) for _ in range(kills))
    t0 = time.monotonic()
    for at in moments:
        await asyncio.sleep(max(0.0, at - (time.monotonic() - t0)))
        pids = actor_pids(server_pid)
        kind = rng.choice(["prefill", "decode"])
        if not pids[kind]:
            continue
        pid = rng.choice(pids[kind])
        try:
            os.kill(pid, signal.SIGKILL)
            log.append({"at_s": round(time.monotonic() - t0, 2), "kind": kind, "pid": pid})
        except ProcessLookupError:
            pass


def metrics(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("hisparse_") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name] = out.get(name, 0.0) + float(value)
    return out


def held(m: dict[str, float]) -> dict[str, float]:
    """What is still held across the cluster, from /metrics (everything must be 0 when idle)."""
    keys = ("hisparse_requests_running", "hisparse_requests_waiting", "hisparse_kv_device_bytes_used",
            "hisparse_kv_host_bytes_used", "hisparse_prefill_held_layouts")
    out = {k.removeprefix("hisparse_"): next((v for n, v in m.items() if n.split("{")[0] == k), 0.0) for k in keys}
    for n, v in m.items():
        if n.startswith("hisparse_table_entries"):
            out[n.split('table="')[1].rstrip('"}')] = v
    return out


def wait_idle(url: str, timeout_s: float = 120.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        h = held(metrics(url))
        alive = metrics(url)
        up = all(v > 0 for n, v in alive.items() if n.split("{")[0] in ("hisparse_decode_actors_alive", "hisparse_prefill_actors_alive"))
        if (up and not any(h.values())) or time.monotonic() > deadline:
            return h
        time.sleep(1.0)


def run(requests: int, kills: int, seed: int, concurrency: int = 24, timeout_s: float = 180.0, soak: int = 0,
        server_args: tuple[str, ...] = ()) -> dict:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(["--num-prefill", "2", "--num-decode", "2", "--prefill-num-cpus", "0.5", "--decode-num-cpus", "0.5",
                           "--device-budget", "64MiB", "--max-restarts", "-1", "--max-request-retries", "3",
                           "--token-timeout-s", "60", "--max-batch-tokens", "1024", *server_args], port)
    try:
        reqs = load(requests, seed)
        progress(f"undisturbed run: {requests} requests")
        calm = asyncio.run(_run_load(url, reqs, concurrency, timeout_s))
        progress(f"the same load with {kills} SIGKILLs")
        log: list = []

        async def storm():
            span = max(5.0, requests * 0.05)
            killer = asyncio.ensure_future(_killer(server.pid, kills, span, seed, log))
            out = await _run_load(url, reqs, concurrency, timeout_s)
            await killer
            return out

        t0 = time.perf_counter()
        chaos = asyncio.run(storm())
        wall = time.perf_counter() - t0
        progress("waiting for the cluster to settle")
        after = wait_idle(url)
        m = metrics(url)
        soak_out = _soak(url, server.pid, soak, seed) if soak else None
    finally:
        stop_server(server)
    by_status: dict[str, int] = {}
    equal = differ = 0
    for twin, got in zip(calm, chaos):
        by_status[str(got["status"])] = by_status.get(str(got["status"]), 0) + 1
        if got["texts"] is not None and twin["texts"] is not None and not got["left"]:
            if got["texts"] == twin["texts"]:
                equal += 1
            else:
                differ += 1
    return {
        "requests": requests, "kills": log, "wall_s": round(wall, 1),
        "completed_equal_to_undisturbed": equal, "completed_different": differ,
        "left_early": sum(r["left"] for r in chaos), "invalid_sent": sum(r["kind"] == "invalid" for r in reqs),
        "by_status": dict(sorted(by_status.items())), "hung": sum(r["hung"] for r in chaos),
        "undisturbed_by_status": _count(calm), "held_after": after,
        "integrity_checks": m.get('hisparse_integrity_checks{model="tiny"}'),
        "integrity_errors": m.get('hisparse_integrity_errors{model="tiny"}'),
        "retries": {k: v for k, v in m.items() if k.startswith("hisparse_request_retries")},
        "soak": soak_out,
    }


def _count(results: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in results:
        out[str(r["status"])] = out.get(str(r["status"]), 0) + 1
    return dict(sorted(out.items()))


def _soak(url: str, server_pid: int, n: int, seed: int) -> dict:
    def rss() -> dict[str, int]:
        return {f"{role(p)}-{p}": rss_bytes(p) for p in descendants(server_pid) if role(p) in ("prefill", "decode", "gateway")}

    rng = random.Random(seed + 2)
    reqs = [{"kind": "plain", "body": {"prompt": [rng.randint(6, 250) for _ in range(16)], "max_tokens": 4,
                                       "ignore_eos": True, "temperature": 0}, "headers": {}, "leave_after": None}
            for _ in range(n)]
    warm = reqs[: min(200, n)]
    asyncio.run(_run_load(url, warm, 16, 120.0))  # allocators and caches reach their working size first
    wait_idle(url)
    before, tables_before = rss(), held(metrics(url))
    progress(f"soak: {n} short requests")
    out = asyncio.run(_run_load(url, reqs, 16, 120.0))
    tables_after = wait_idle(url)
    after = rss()
    return {"requests": n, "ok": sum(r["status"] == 200 for r in out),
            "rss_before_mib": {k: round(v / 2**20, 1) for k, v in before.items()},
            "rss_after_mib": {k: round(v / 2**20, 1) for k, v in after.items()},
            "rss_growth_mib": {k: round((after.get(k, 0) - v) / 2**20, 1) for k, v in before.items()},
            "tables_before": tables_before, "tables_after": tables_after}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--kills", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=24)
    ap.add_argument("--soak", type=int, default=0, help="then this many short requests, with memory before/after")
    ap.add_argument("--server-args", default="", metavar="ARGS",
                    help="more `hisparse serve` flags, after the bench's own (which they override), e.g. "
                         "'--num-decode 1 --decode-layout dp2+ep2' for replicas")
    a = ap.parse_args(argv)
    extra = tuple(a.server_args.split())
    emit({"bench": "chaos", "env": environment(), "server_args": list(extra),
          **run(a.requests, a.kills, a.seed, a.concurrency, soak=a.soak, server_args=extra)})


if __name__ == "__main__":
    main()
