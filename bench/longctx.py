"""Long-context prefill on the built-in model, one process (prints one JSON object).

    python -m bench.longctx [--sizes 2048,16384,65536,131056] [--chunk 2048] [--tile 512] [--threads 1]
    python -m bench.longctx --device cuda --sizes 131072,1048576 --chunk 8192 --tile 4096

Each size is one prompt of random tokens through the real `PrefillWorker` (chunks of `--chunk`
tokens, sparse attention, tiled indexer), side by side in one run:
- prompt tokens/s, and the ratio of the largest size's tokens/s to the smallest's;
- peak memory during the prefill next to the layout's own bytes: on the CPU peak RSS (the kernel's
  high-water mark, reset before each size) minus the RSS before it; on CUDA torch's peak allocated
  bytes. `transient_bytes` = peak - layout: what the chunks needed besides the result;
- the indexer's share of the prefill time (its tiled scoring and top-k: the one quadratic part);
- parity on a 4K-token prompt (1024 C4 entries against a top-k of 16): max |logits| difference of
  the sparse path against the dense reference path and against HF transformers.

The built-in model allows 131,072 positions, so the CPU default's largest prompt is 131,056 tokens
(128K leaves no room for output tokens). On CUDA the model's limit is raised for the run (the
positions are computed, not tabled) and the output says so.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import time
from dataclasses import replace

import torch

from bench.common import emit, environment, progress

DEFAULT_SIZES = "2048,16384,65536,131056"
PARITY_TOKENS = 4096


def _rss_bytes(field: str) -> int:
    """VmRSS / VmHWM of this process from /proc (bytes)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _release_and_reset_peak(device: str) -> None:
    """Free what the last size left behind and start a new high-water mark."""
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return
    try:  # glibc keeps freed heap pages unless asked to return them
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


class IndexerTimer:
    """Wraps `model.prefill.tiled_topk` (the name the prefill layer calls) to add up its time."""

    def __init__(self, device: str) -> None:
        import model.prefill as prefill

        self.module, self.inner, self.device, self.seconds = prefill, prefill.tiled_topk, device, 0.0

    def __enter__(self) -> IndexerTimer:
        def timed(*args, **kwargs):
            if self.device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = self.inner(*args, **kwargs)
            if self.device == "cuda":
                torch.cuda.synchronize()
            self.seconds += time.perf_counter() - t0
            return out

        self.module.tiled_topk = timed
        return self

    def __exit__(self, *exc) -> None:
        self.module.tiled_topk = self.inner


def prefill_once(model, tokens: int, chunk: int, tile: int, device: str, seed: int = 0) -> dict:
    from core.configs import PrefillConfig
    from core.request import Attempt, Request
    from core.types import SamplingParams
    from prefill.worker import PrefillWorker

    g = torch.Generator().manual_seed(seed)
    prompt = tuple(torch.randint(6, model.cfg.vocab_size, (tokens,), generator=g).tolist())
    worker = PrefillWorker(model, PrefillConfig(max_batch_tokens=chunk, entry_tile=tile))
    worker.submit(Attempt(Request("long", prompt, SamplingParams(max_tokens=1), seed), "long"))
    _release_and_reset_peak(device)
    base = torch.cuda.memory_allocated() if device == "cuda" else _rss_bytes("VmRSS")
    results = []
    with IndexerTimer(device) as timer:
        c0 = time.process_time()
        t0 = time.perf_counter()
        while worker.has_work():
            results += worker.step()
            done = worker.progress()
            if done and done[0].done_tokens % (16 * chunk) == 0:
                progress(f"{tokens} tokens: {done[0].done_tokens} done ({time.perf_counter() - t0:.0f} s)")
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        cpu_seconds = time.process_time() - c0
    peak = (torch.cuda.max_memory_allocated() if device == "cuda" else _rss_bytes("VmHWM")) - base
    layout_bytes = results[0].layout.total_bytes()
    row = {
        "tokens": tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1),
        "cpu_seconds": round(cpu_seconds, 2),  # this process's CPU time: less sensitive to other load than wall time
        "tokens_per_cpu_s": round(tokens / cpu_seconds, 1),
        "peak_bytes_above_start": peak,
        "layout_bytes": layout_bytes,
        "transient_bytes": peak - layout_bytes,
        "indexer_seconds": round(timer.seconds, 2),
        "indexer_share": round(timer.seconds / seconds, 3),
    }
    progress(f"{tokens} tokens: {row['tokens_per_s']} tokens/s, transient {row['transient_bytes'] / 2**20:.0f} MiB, "
             f"indexer {row['indexer_share']:.0%}")
    return row


def parity(model, tokens: int, chunk: int, tile: int) -> dict:
    """Max |logits| difference over every position of one prompt: sparse vs dense path, sparse vs HF."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(6, model.cfg.vocab_size, (tokens,), generator=g)
    outs = {}
    for dense in (False, True):
        layout, parts = None, []
        for a in range(0, tokens, chunk):
            lo, layout = model.prefill(ids[a : a + chunk], layout, dense=dense, entry_tile=tile)
            parts.append(lo)
        outs[dense] = torch.cat(parts)
    sparse = outs[False].cpu()
    res = {"tokens": tokens, "c4_entries": tokens // model.cfg.csa_rate, "index_topk": model.cfg.index_topk,
           "max_abs_diff_vs_dense": float((sparse - outs[True].cpu()).abs().max())}
    try:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import DeepseekV4ForCausalLM

        from model.builtin import ensure_builtin

        hf = DeepseekV4ForCausalLM.from_pretrained(ensure_builtin(), dtype=torch.float32).eval()
        with torch.no_grad():
            ref = hf(ids[None], use_cache=False).logits[0]
        res["max_abs_diff_vs_hf"] = float((sparse - ref).abs().max())
        res["positions_over_1e-4_vs_hf"] = int(((sparse - ref).abs().amax(dim=-1) > 1e-4).sum())
    except ImportError as exc:
        res["max_abs_diff_vs_hf"] = f"not measured: {exc}"
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help="prompt lengths, comma separated")
    ap.add_argument("--chunk", type=int, default=2048, help="max_batch_tokens of the prefill worker")
    ap.add_argument("--tile", type=int, default=512, help="entry_tile of the prefill worker")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--parity-tokens", type=int, default=PARITY_TOKENS, help="0 skips the parity check")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda needs a CUDA device; run without it for the CPU figures")
        os.environ["HISPARSE_DEVICE"] = "cuda"
    else:
        os.environ["HISPARSE_DEVICE"] = "cpu"
    from model.builtin import ensure_builtin
    from model.loader import load_model

    model = load_model(ensure_builtin(), device=a.device)
    sizes = [int(s) for s in a.sizes.split(",")]
    notes = []
    limit = model.cfg.max_position_embeddings
    if max(sizes) + 1 > limit:
        if a.device != "cuda":
            raise SystemExit(f"the built-in model allows {limit} positions: prompts up to {limit - 1} tokens here")
        model.cfg = replace(model.cfg, max_position_embeddings=max(sizes) + 64)
        notes.append(f"max_position_embeddings raised from {limit} to {model.cfg.max_position_embeddings} for this run")
    progress(f"prefill of {sizes} tokens, chunks of {a.chunk}, tile {a.tile}, {a.threads} thread(s), {a.device}")
    prefill_once(model, 2 * a.chunk, a.chunk, a.tile, a.device, seed=99)  # warm-up: first calls, allocator
    rows = [prefill_once(model, n, a.chunk, a.tile, a.device) for n in sizes]
    out = {"bench": "longctx", "env": environment(), "device": a.device, "chunk": a.chunk, "tile": a.tile,
           "threads": a.threads, "memory": "peak GPU allocated bytes" if a.device == "cuda" else "peak RSS (VmHWM)",
           "rows": rows, "notes": notes}
    first, last = rows[0], rows[-1]
    out["tokens_per_s_ratio_largest_to_smallest"] = round(last["tokens_per_s"] / first["tokens_per_s"], 3)
    out["tokens_per_cpu_s_ratio_largest_to_smallest"] = round(last["tokens_per_cpu_s"] / first["tokens_per_cpu_s"], 3)
    goals = {"largest_within_300_s": last["seconds"] <= 300,
             "tokens_per_s_ratio_at_least_0.5": out["tokens_per_s_ratio_largest_to_smallest"] >= 0.5,
             "transient_at_most_1.5_GB": last["transient_bytes"] <= 1.5e9}
    if a.parity_tokens:
        progress(f"parity on {a.parity_tokens} tokens")
        out["parity"] = par = parity(model, a.parity_tokens, a.chunk, a.tile)
        goals["parity_within_1e-4"] = par["max_abs_diff_vs_dense"] <= 1e-4 and par.get("max_abs_diff_vs_hf", 1.0) <= 1e-4
    out["goals"] = goals
    emit(out)


if __name__ == "__main__":
    main()
