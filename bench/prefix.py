"""Multi-turn chat through HTTP with the prefix cache off, on, on again after a restart, and on with the decode side
keeping finished prompts' pages (one JSON object).

    python -m bench.prefix [--system-len 8192] [--conversations 16] [--turns 6] [--concurrency 4]

Each conversation starts with the same system prompt (`--system-len` tokens), then `--turns` turns; turn t's
prompt is the system prompt, every earlier (user, assistant) pair, and the new user message, so each prompt
extends the previous one of its conversation. The assistant tokens placed in later prompts are fixed
stand-ins of the answer's length (the API returns text, not ids; what matters to the cache is that the next
prompt extends the previous one). Conversations run `--concurrency` at a time, their turns in order.

The server is `hisparse serve` in a process of its own (built-in model, one prefill and one decode actor);
this process is the client. Three runs on one workload:
- `cold`: `--prefix-cache off`;
- `warm`: `--prefix-cache on` with a disk tier in a fresh directory (written through);
- `warm_from_disk`: the server restarted on the same directory, the same workload again: every hit now
  comes from files read back (checked, then kept in memory);
- `kept`: as `warm` (a fresh directory) with `--retain-bytes`: the decode actor keeps each finished prompt's
  pages, so the next turn's handoff carries only the pages after them (`cachetier.retention`).
Per run: TTFT p50/p99 (all requests, and first turns vs later turns), prompt tokens computed / sent (from
/metrics), output and prompt throughput, layout bytes handed from prefill to decode per turn (all turns; first turns always send
the whole layout), and the cache's numbers: hit rate, bytes per cached token per
tier, state bytes kept by the state policy vs a snapshot at every page.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from urllib.parse import urlparse

import httpx
import numpy as np

from bench.common import emit, environment, progress
from bench.serving_path import _free_port, start_server, stop_server
from bench.sse_client import stream_one


def workload(system_len: int, conversations: int, turns: int, user_len: int, answer_len: int,
             vocab: int = 4000) -> list[list[list[int]]]:
    """prompts[c][t]: conversation c's prompt at turn t."""
    rng = np.random.default_rng(0)
    system = rng.integers(6, vocab, system_len).tolist()
    out = []
    for _ in range(conversations):
        history, prompts = list(system), []
        for _ in range(turns):
            user = rng.integers(6, vocab, user_len).tolist()
            prompts.append(history + user)
            history = history + user + rng.integers(6, vocab, answer_len).tolist()
        out.append(prompts)
    return out


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key.replace('model="tiny",', "").replace('{model="tiny"}', "")] = float(value)
    return out


def _pcts(xs: list[float]) -> dict:
    ms = np.asarray(xs) * 1000
    if not len(ms):
        return {}
    return {"p50_ms": round(float(np.percentile(ms, 50)), 1), "p99_ms": round(float(np.percentile(ms, 99)), 1),
            "n": len(ms)}


async def chat(url: str, prompts: list[list[list[int]]], answer_len: int, concurrency: int) -> dict:
    u = urlparse(url)
    gate = asyncio.Semaphore(concurrency)
    ttft: dict[int, list[float]] = {}
    tokens = [0]

    async def conversation(turns: list[list[int]]) -> None:
        async with gate:
            for t, prompt in enumerate(turns):
                body = {"prompt": prompt, "max_tokens": answer_len, "temperature": 0, "ignore_eos": True, "stream": True,
                        "stream_options": {"continuous_usage_stats": True}}
                r = await stream_one(u.hostname, u.port, "/v1/completions", body)
                if r.error:
                    raise RuntimeError(r.error)
                ttft.setdefault(t, []).append(r.chunk_times[0] - r.start)
                tokens[0] += r.tokens

    t0 = time.perf_counter()
    await asyncio.gather(*(conversation(c) for c in prompts))
    wall = time.perf_counter() - t0
    sent = sum(len(p) for c in prompts for p in c)
    everything = [x for xs in ttft.values() for x in xs]
    later = [x for t, xs in ttft.items() if t > 0 for x in xs]
    return {"wall_s": round(wall, 2), "ttft": _pcts(everything), "ttft_first_turn": _pcts(ttft[0]),
            "ttft_later_turns": _pcts(later), "output_tokens_per_s": round(tokens[0] / wall, 1),
            "prompt_tokens_per_s": round(sent / wall, 1), "prompt_tokens_sent": sent}


def _delta(after: dict, before: dict, key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def run(args: list[str], prompts, a, label: str) -> dict:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    progress(f"{label}: starting the server")
    server = start_server(["--max-batch-tokens", str(a.max_batch_tokens), "--device-budget", "1GiB", *args], port)
    try:
        before = metrics(url)
        progress(f"{label}: {len(prompts)} conversations x {len(prompts[0])} turns")
        out = asyncio.run(chat(url, prompts, a.answer_len, a.concurrency))
        time.sleep(2.5)  # the actors' counters reach the gateway once a second
        after = metrics(url)
    finally:
        stop_server(server)
    computed = _delta(after, before, "hisparse_prefill_computed_tokens_total")
    turns = len(prompts) * len(prompts[0])
    handoff = _delta(after, before, "hisparse_handoff_bytes_total")
    out["handoff_bytes_per_turn"] = round(handoff / turns)
    out["kept_reused_pages"] = int(_delta(after, before, "hisparse_kept_reused_pages_total"))
    out["prompt_tokens_computed"] = int(computed)
    out["computed_over_sent"] = round(computed / out["prompt_tokens_sent"], 4)
    if "hisparse_prefix_cache_pages" in after:
        out["cache"] = cache_numbers(after, before)
    return out


def cache_numbers(m: dict, before: dict) -> dict:
    page = m.get("hisparse_prefix_cache_page_tokens", 0)
    b = {(tier, part): m.get(f'hisparse_prefix_cache_bytes{{part="{part}",tier="{tier}"}}', 0.0)
         for tier in ("host", "disk") for part in ("classical", "state")}
    out = {"hit_tokens": int(_delta(m, before, "hisparse_prefix_cache_hit_tokens_total")),
           "lookup_tokens": int(_delta(m, before, "hisparse_prefix_cache_prompt_tokens_total")),
           "pages": int(m["hisparse_prefix_cache_pages"]), "page_tokens": int(page),
           "state_snapshots": int(m["hisparse_prefix_cache_state_snapshots"]),
           "evictions": int(_delta(m, before, "hisparse_prefix_cache_evictions_total")),
           "disk_reads": int(_delta(m, before, 'hisparse_prefix_cache_disk_ops_total{op="read"}')),
           "disk_writes": int(_delta(m, before, 'hisparse_prefix_cache_disk_ops_total{op="write"}')),
           "disk_errors": int(_delta(m, before, "hisparse_prefix_cache_disk_errors_total"))}
    out["hit_rate"] = round(out["hit_tokens"] / out["lookup_tokens"], 4) if out["lookup_tokens"] else 0.0
    for tier in ("host", "disk"):
        pages = m.get(f'hisparse_prefix_cache_tier_pages{{tier="{tier}"}}', 0.0)
        total = b[(tier, "classical")] + b[(tier, "state")]
        out[f"{tier}_bytes"] = {"classical": int(b[(tier, "classical")]), "state": int(b[(tier, "state")])}
        out[f"{tier}_bytes_per_cached_token"] = round(total / (pages * page), 1) if pages and page else None
        out[f"{tier}_classical_bytes_per_cached_token"] = (round(b[(tier, "classical")] / (pages * page), 1)
                                                          if pages and page else None)
    # tensor bytes of the state snapshots kept (in any tier) against a snapshot at every cached page
    every = m.get("hisparse_prefix_cache_state_bytes_every_page", 0.0)
    kept = every * out["state_snapshots"] / out["pages"] if out["pages"] else 0.0
    out["state_policy"] = {"state_bytes_kept": int(kept), "state_bytes_snapshot_every_page": int(every),
                           "kept_over_every_page": round(kept / every, 4) if every else None}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--system-len", type=int, default=8192, help="shared system prompt tokens (default 8192)")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--user-len", type=int, default=64, help="tokens of each user message")
    ap.add_argument("--answer-len", type=int, default=16, help="tokens generated per turn (and placed in the next prompt)")
    ap.add_argument("--concurrency", type=int, default=4, help="conversations in flight at once")
    ap.add_argument("--max-batch-tokens", type=int, default=2048)
    ap.add_argument("--host-bytes", default="1GiB", help="--prefix-cache-host-bytes of the cached runs")
    ap.add_argument("--disk-bytes", default="8GiB", help="--prefix-cache-disk-bytes of the cached runs")
    ap.add_argument("--state-policy", choices=["last", "every"], default="last")
    ap.add_argument("--page-tokens", type=int, default=None, help="--prefix-cache-page-tokens (default: the KV block size)")
    ap.add_argument("--retain-bytes", default="1GiB", help="--retain-bytes of the `kept` run")
    a = ap.parse_args(argv)
    prompts = workload(a.system_len, a.conversations, a.turns, a.user_len, a.answer_len)
    directory = tempfile.mkdtemp(prefix="hisparse-prefix-bench-")
    kept_dir = tempfile.mkdtemp(prefix="hisparse-prefix-bench-kept-")
    def cache_args(where: str) -> list[str]:
        out = ["--prefix-cache", "on", "--prefix-cache-host-bytes", a.host_bytes, "--prefix-cache-disk-bytes", a.disk_bytes,
               "--prefix-cache-dir", where, "--prefix-cache-state-policy", a.state_policy]
        return out + (["--prefix-cache-page-tokens", str(a.page_tokens)] if a.page_tokens else [])

    cache = cache_args(directory)
    try:
        cold = run(["--prefix-cache", "off"], prompts, a, "cold")
        warm = run(cache, prompts, a, "warm")
        disk = run(cache, prompts, a, "warm_from_disk")
        kept = run([*cache_args(kept_dir), "--retain-bytes", a.retain_bytes], prompts, a, "kept")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        shutil.rmtree(kept_dir, ignore_errors=True)

    def over(num, den, digits=3):
        return round(num / den, digits) if den else None

    def ratio(run_, key, part="p50_ms", base=cold):
        return over(run_[key].get(part), base[key].get(part))

    emit({"bench": "prefix", "env": environment(), "system_len": a.system_len, "conversations": a.conversations,
          "turns": a.turns, "user_len": a.user_len, "answer_len": a.answer_len, "concurrency": a.concurrency,
          "state_policy": a.state_policy, "page_tokens": a.page_tokens, "retain_bytes": a.retain_bytes, "cold": cold,
          "warm": warm, "warm_from_disk": disk, "kept": kept,
          "handoff_bytes_per_turn": {"warm": warm["handoff_bytes_per_turn"], "kept": kept["handoff_bytes_per_turn"],
                                     "kept_over_warm": over(kept["handoff_bytes_per_turn"], warm["handoff_bytes_per_turn"], 4)},
          "ttft_p50_later_turns_kept_over_warm": ratio(kept, "ttft_later_turns", base=warm),
          "ttft_p50_warm_over_cold": ratio(warm, "ttft"), "ttft_p99_warm_over_cold": ratio(warm, "ttft", "p99_ms"),
          "ttft_p50_later_turns_warm_over_cold": ratio(warm, "ttft_later_turns"),
          "ttft_p50_disk_over_cold": ratio(disk, "ttft"),
          "ttft_p50_later_turns_disk_over_cold": ratio(disk, "ttft_later_turns")})


if __name__ == "__main__":
    main()
