"""`speculative`: speculative decoding on the device, through the worker as it serves.

The built-in model with its MTP head, fp32 and bf16, tier on: the same prefilled requests decode with speculation
off (eager) and with three draft tokens through the fixed-shape step (CUDA graphs: each speculative bucket is two
graphs, the verify forward and accept/commit/draft), greedy and seeded sampled. On the CPU the tokens are exactly
speculation off's (tests/integration/test_speculative.py); on the device the verify forward runs N + 1 times the
rows of a plain step, so its matmuls may pick other kernels and round differently: a token that differs is
reported with where it first differs. Figures: acceptance length, speculative graphs captured, steps and
wall seconds off vs on.
"""

from __future__ import annotations

import time

import torch

from bench.gpu_check_util import Ctx, synchronize
from cluster.inprocess import InProcessEngine
from core.configs import StepConfig, TierConfig
from core.request import Request
from core.types import SamplingParams
from model.builtin import ensure_builtin
from model.loader import load_model

MiB = 2**20


def _prompts(vocab: int, n: int, length: int) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(11)
    return [tuple(torch.randint(6, vocab, (length + 37 * i,), generator=g).tolist()) for i in range(n)]


def _run(model, prompts, params, spec: int, ctx: Ctx) -> dict:
    tier = TierConfig(offload=True, device_budget_bytes=64 * MiB, reserved_slots=4, speculative_tokens=spec)
    mode = "compiled" if spec else "eager"
    step = StepConfig(decode_mode=mode, compile_backend="eager", capture_context_tokens=1024, speculative_adaptive=False)
    eng = InProcessEngine(model, tier, step=step)
    synchronize(ctx.device)
    t0 = time.perf_counter()
    done = eng.generate([Request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))])
    synchronize(ctx.device)
    seconds = time.perf_counter() - t0
    stats = eng.decode.stats()
    runner = eng.decode.runner
    eng.decode.check_integrity()
    eng.close()
    return {"tokens": {k: v.token_ids for k, v in done.items()}, "seconds": round(seconds, 3), "steps": stats["steps"],
            "speculation": stats.get("speculation"), "spec_graphs": len(runner.spec_graphs), "mode": runner.mode,
            "uncaptured": runner.eager_steps}


def _differ(a: dict, b: dict) -> dict:
    out = {}
    for k in a:
        if a[k] != b[k]:
            out[k] = next((i for i, (x, y) in enumerate(zip(a[k], b[k])) if x != y), min(len(a[k]), len(b[k])))
    return out


def speculative(ctx: Ctx) -> dict:
    model_dir = ensure_builtin()
    n, length, tokens = (3, 40, 12) if ctx.small else (8, 300, 96)
    ok = True
    for dtype in (torch.float32,) if ctx.small else (torch.float32, torch.bfloat16):
        model = load_model(model_dir, dtype=dtype, device=ctx.device, mtp=True)
        prompts = _prompts(model.cfg.vocab_size, n, length)
        for kind in ("greedy", "sampled"):
            if kind == "greedy":
                params = [SamplingParams(max_tokens=tokens, ignore_eos=True)] * n
            else:
                params = [SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.8, top_p=0.95, seed=40 + i)
                          for i in range(n)]
            off = _run(model, prompts, params, 0, ctx)
            on = _run(model, prompts, params, 3, ctx)
            differ = _differ(off["tokens"], on["tokens"])
            part = {"requests": n, "tokens_each": tokens, "identical_requests": n - len(differ), "first_difference": differ,
                    "off_seconds": off["seconds"], "on_seconds": on["seconds"], "off_steps": off["steps"],
                    "on_steps": on["steps"], "speculation": on["speculation"], "spec_graphs": on["spec_graphs"],
                    "mode": on["mode"], "uncaptured_steps": on["uncaptured"]}
            # fp32: every request the same; bf16: rounding of the wider verify matmuls may move a near tie
            part["ok"] = bool((not differ if dtype == torch.float32 else len(differ) <= n // 2)
                              and (on["speculation"] or {}).get("steps", 0) > 0
                              and (not ctx.cuda or on["spec_graphs"] > 0))
            ctx.record(f"{str(dtype)[6:]}_{kind}", part)
            ok = ok and part["ok"]
        del model
        if ctx.cuda:
            torch.cuda.empty_cache()
    return {"ok": ok}
