"""Decode-step speed of our model against HF `transformers` on the same checkpoint and batch.

Both load the built-in model's directory (or --model DIR) and prefill the same prompts; then every
step feeds the same next token to each of, side by side in one loop:
- HF `DeepseekV4ForCausalLM` with its cache;
- ours over plain layouts (`decode_layouts`, eager: the model's reference path);
- ours through the tiered store, tier off and tier on, each eager and compiled
  (`decode_mode=compiled`: the bucketed step under `torch.compile` with Inductor on CPU, CUDA
  graphs on CUDA).
Per variant: median step time, tokens/s, speed-up over HF, and the largest logit difference from HF
over the run; the tier on/off step-cost ratio; aten ops per step per layer (torch.profiler, one
step); and what compiling cost at start-up (first compile, and again from Inductor's cache).
Prints one JSON object.

    python -m bench.decode_vs_hf [--context 256] [--batches 1,16] [--steps 20]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from functools import partial

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from bench.common import emit, environment, progress  # noqa: E402

TIERED = ("tier_off", "tier_on")


def _aten_ops(fn) -> int:
    """aten ops the dispatcher runs during one call of `fn` (nested ones included, as the profiler lists them)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


def _tiered_runner(model, layouts, offload: bool, mode: str, budget: int):
    from cachetier.store import TieredStore
    from core.configs import StepConfig, TierConfig
    from decode.runner import StepRunner

    store = TieredStore(model.cfg, TierConfig(offload=offload, device_budget_bytes=budget, host_pool_bytes=budget),
                        dtype=model.dtype, device=model.device)
    ids = []
    for i, lay in enumerate(layouts):
        store.admit(f"b{i}", lay.clone(), lay.num_tokens + 1024)
        ids.append(f"b{i}")
    runner = StepRunner(model, store, max_running=max(len(ids), 1), cfg=StepConfig(decode_mode=mode, warmup=False))
    return runner, ids


def _variants(ours, plain, runners: dict) -> Callable[[list[int]], dict]:
    """For a step's input tokens: every variant of ours as a zero-argument call."""

    def fns(ids: list[int]) -> dict:
        out = {"plain_eager": lambda: ours.decode_layouts(plain, ids)}
        for key, (runner, rids) in runners.items():
            out[key] = lambda r=runner, rids=rids: r.run(rids, ids)
        return out

    return fns


def _one_batch(ours, hf, b: int, context: int, steps: int, budget: int) -> dict:
    g = torch.Generator().manual_seed(b)
    prompts = torch.randint(2, ours.cfg.vocab_size, (b, context), generator=g)
    nxt = torch.randint(2, ours.cfg.vocab_size, (steps + 2, b), generator=g)
    progress(f"batch {b}: prefilling {context} tokens")
    _, layouts = ours.prefill_batch([(p, None) for p in prompts], last_only=True)
    with torch.no_grad():
        pkv = hf(prompts, use_cache=True).past_key_values
    runners = {f"{name}_{mode}": _tiered_runner(ours, layouts, name == "tier_on", mode, budget)
               for name in TIERED for mode in ("eager", "compiled")}
    variants = _variants(ours, [lay.clone() for lay in layouts], runners)
    times: dict[str, list[float]] = {k: [] for k in ["hf", "plain_eager", *runners]}
    diff = dict.fromkeys(times, 0.0)
    compile_s = {}
    for s in range(steps + 1):  # step 0 compiles and is not timed
        progress(f"batch {b}: step {s}/{steps}") if s % 10 == 0 else None
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf(nxt[s][:, None], past_key_values=pkv, use_cache=True)
        dt = time.perf_counter() - t0
        pkv, ref = out.past_key_values, out.logits[:, -1]
        if s:
            times["hf"].append(dt)
        for key, fn in variants(nxt[s].tolist()).items():
            t0 = time.perf_counter()
            logits = fn()
            dt = time.perf_counter() - t0
            if s:
                times[key].append(dt)
            elif key.endswith("compiled"):
                compile_s[key] = round(dt, 2)
            diff[key] = max(diff[key], (logits - ref).abs().max().item())
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    ours_out = {
        k: {"step_ms": round(med[k] * 1e3, 3), "tokens_per_s": round(b / med[k], 1), "speedup_vs_hf": round(med["hf"] / med[k], 3),
            "max_abs_logit_diff_vs_hf": diff[k]}
        for k in times if k != "hf"
    }
    # one more step under the profiler, every variant fed the same token
    last = nxt[steps + 1]
    with torch.no_grad():
        ops = {"hf": _aten_ops(partial(hf, last[:, None], past_key_values=pkv, use_cache=True))}
    ops.update({k: _aten_ops(fn) for k, fn in variants(last.tolist()).items()})
    # start-up: compiling again in a fresh runner reads Inductor's on-disk cache
    t0 = time.perf_counter()
    again, rids = _tiered_runner(ours, layouts, True, "compiled", budget)
    again.run(rids, last.tolist())
    cached_s = time.perf_counter() - t0
    return {
        "batch": b, "context": context, "steps": steps,
        "hf": {"step_ms": round(med["hf"] * 1e3, 3), "tokens_per_s": round(b / med["hf"], 1)},
        "ours": ours_out,
        "tier_on_off_step_ratio": {m: round(med[f"tier_on_{m}"] / med[f"tier_off_{m}"], 3) for m in ("eager", "compiled")},
        "aten_ops_per_step_per_layer": {k: round(v / ours.cfg.num_layers, 1) for k, v in ops.items()},
        "compile_s": {"first_call": compile_s, "tier_on_again_from_cache": round(cached_s, 2),
                      "graphs": {k: r.compiles for k, (r, _) in runners.items() if k.endswith("compiled")}},
    }


def run(model_dir: str, context: int, batches: list[int], steps: int) -> dict:
    from transformers import DeepseekV4ForCausalLM

    from model.builtin import resolve_model_dir
    from model.loader import load_model

    path = resolve_model_dir(model_dir)
    ours = load_model(path)
    hf = DeepseekV4ForCausalLM.from_pretrained(path).eval()
    budget = 64 * 2**20 * max(1, max(batches) // 8)
    return {
        "bench": "decode_vs_hf", "model": str(path), "env": environment(),
        "inductor_cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR", "torch default (/tmp/torchinductor_$USER)"),
        "results": [_one_batch(ours, hf, b, context, steps, budget) for b in batches],
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args(argv)
    emit(run(a.model, a.context, [int(x) for x in a.batches.split(",")], a.steps))


if __name__ == "__main__":
    main()
