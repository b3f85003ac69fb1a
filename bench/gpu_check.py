"""Everything that needs a CUDA device, checked in one run; prints one JSON object.

    python -m bench.gpu_check

Each check is a function in `CHECKS` that returns a dict of what it measured, with `ok` saying
whether it held. A check that raises is reported (its error and the end of its traceback) and the
run goes on, so one run on a borrowed machine shows everything. Another area adds its checks by
appending a function to `CHECKS` (or decorating it with `@check`). Without CUDA nothing runs: the
object says so.

The checks:
- `triton_kernels`: sparse attention, hot-buffer resolve (several steps of hits, misses and
  evictions) and the host-pool write, Triton on the device against the torch references;
- `decode_graphs`: the built-in model decoding on the device through the tiered store (tier on
  and off), eager versus `decode_mode=compiled` (one CUDA graph per bucket, captured and
  replayed): identical tokens, graphs captured, capture seconds, step times, kernels per eager step;
- `parallel_nccl`: replicas over nccl, one GPU per rank, for every layout the GPUs allow (DP2+EP2, TP2,
  DP4+EP4, DP2xTP2+EP4, DP8+EP8): logits against one GPU, step times, collectives per step;
- `packed_weights`: the packed-weight kernels (`bench.gpu_check_weights --quick`: FP8 linears, FP4
  experts, the real-format checkpoint, compiled packed modules, TFLOP/s at V4-Flash shapes).

One command covers what a lent GPU machine should run: `python -m bench.gpu_check`.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from bench.common import emit, environment, progress  # noqa: E402

CHECKS: list[Callable[[], dict]] = []


def check(fn: Callable[[], dict]) -> Callable[[], dict]:
    CHECKS.append(fn)
    return fn


def _median_ms(times: list[float]) -> float:
    return round(sorted(times)[len(times) // 2] * 1e3, 3)


# --- kernels ----------------------------------------------------------------------------------------


def _attention_case(seed: int, batch: int, heads: int, dim: int, lens: tuple[int, ...]):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, dim, generator=g)
    segments = []
    for n in lens:
        pool = torch.randn(3 * n + 5, dim, generator=g)
        rows = torch.randint(0, pool.shape[0], (batch, n), generator=g)
        rows = torch.where(torch.rand(batch, n, generator=g) < 0.2, -1, rows)
        segments.append((pool, rows))
    return q, segments, torch.randn(heads, generator=g), dim**-0.5


def _resolve_state(batch: int, lru: int, reserved: int, dim: int, entries: int, device: str):
    """Hot-buffer state for `batch` requests (book b, scratch book last) over a pinned host pool."""
    slots = lru + reserved
    host = torch.randn(batch * entries, dim)
    return {
        "entry_map": torch.full((batch * entries + 1,), -1, dtype=torch.int32, device=device),
        "kv": torch.zeros((batch + 1) * slots * dim, device=device),
        "entry_row": torch.full((batch + 1, slots), -1, dtype=torch.long, device=device),
        "stamp": torch.full((batch + 1, lru), -1, dtype=torch.long, device=device),
        "host": host.pin_memory() if device == "cuda" else host,
        "counters": torch.zeros(3, dtype=torch.long, device=device),
    }


@check
def triton_kernels() -> dict:
    from kernels.attention_ref import sparse_attention_ref
    from kernels.attention_triton import sparse_attention_triton
    from kernels.host_write_ref import write_rows_ref
    from kernels.host_write_triton import write_rows_triton
    from kernels.resolve_ref import resolve_ref
    from kernels.resolve_triton import resolve_triton

    out: dict = {}
    worst = 0.0
    for seed, shape in enumerate(((4, 8, 64, (32, 40)), (16, 64, 512, (128, 64, 512)), (3, 4, 48, (7, 0, 13)))):
        q, segs, sinks, scale = _attention_case(seed, *shape)
        want = sparse_attention_ref(q, segs, sinks, scale)
        got = sparse_attention_triton(q.cuda(), [(p.cuda(), r.cuda()) for p, r in segs], sinks.cuda(), scale).cpu()
        worst = max(worst, (got - want).abs().max().item())
    out["attention_max_abs_diff"] = worst

    batch, lru, reserved, dim, entries, k = 3, 12, 4, 64, 200, 8
    states = {dev: _resolve_state(batch, lru, reserved, dim, entries, dev) for dev in ("cpu", "cuda")}
    states["cuda"]["host"].copy_(states["cpu"]["host"])
    g = torch.Generator().manual_seed(7)
    books = torch.arange(batch)
    same = True
    for step in range(1, 13):
        ids = torch.randint(0, 24 + 4 * step, (batch, k), generator=g)  # a growing range: hits, misses, evictions
        ids = torch.where(torch.rand(batch, k, generator=g) < 0.1, -1, ids)
        rows = torch.where(ids >= 0, books[:, None] * entries + ids, -1)
        slots = {}
        for dev, st in states.items():
            fn = resolve_triton if dev == "cuda" else resolve_ref
            slots[dev] = fn(ids.to(dev), rows.to(dev), rows.to(dev), books.to(dev), (books * (lru + reserved)).to(dev),
                            st["entry_map"], st["kv"], st["entry_row"], st["stamp"], st["host"],
                            torch.tensor(step, device=dev), st["counters"]).cpu()  # fmt: skip
        a, b = states["cpu"], states["cuda"]
        scratch_kv = batch * (lru + reserved) * dim
        same &= torch.equal(slots["cpu"], slots["cuda"])
        same &= torch.equal(a["entry_map"][:-1], b["entry_map"][:-1].cpu())
        same &= torch.equal(a["entry_row"][:-1], b["entry_row"][:-1].cpu())
        same &= torch.equal(a["stamp"][:-1], b["stamp"][:-1].cpu())
        same &= torch.equal(a["kv"][:scratch_kv], b["kv"][:scratch_kv].cpu())
        same &= torch.equal(a["counters"], b["counters"].cpu())
    out["resolve_equal_over_12_steps"] = bool(same)
    out["resolve_counters"] = states["cpu"]["counters"].tolist()

    pool = torch.randn(2, 50, 96)
    rows, values = torch.tensor([3, 49, 0]), torch.randn(3, 96)
    want = pool.clone()
    write_rows_ref(want, 1, rows, values)
    pinned = pool.clone().pin_memory()
    write_rows_triton(pinned, 1, rows.cuda(), values.cuda())
    torch.cuda.synchronize()
    out["host_write_equal"] = torch.equal(pinned, want)
    out["ok"] = worst < 1e-4 and bool(same) and out["host_write_equal"]
    return out


# --- the captured decode step -----------------------------------------------------------------------


def _decode_streams(model, offload: bool, mode: str, prompts: list[list[int]], max_tokens: int) -> dict:
    from cachetier.store import TieredStore
    from core.roles import StepConfig, TierConfig
    from core.types import SamplingParams
    from decode.worker import DecodeRequest, DecodeWorker
    from model.sampling import sample

    cfg = model.cfg
    tier = TierConfig(offload=offload, hot_buffer_slots=cfg.index_topk, reserved_slots=4, device_budget_bytes=256 * 2**20,
                      host_pool_bytes=256 * 2**20)
    store = TieredStore(cfg, tier, dtype=model.dtype, device=model.device)
    t0 = time.perf_counter()
    worker = DecodeWorker(model, store, max_running=16, step_config=StepConfig(decode_mode=mode, capture_context_tokens=1024))
    startup_s = time.perf_counter() - t0
    out = {}
    for i, prompt in enumerate(prompts):
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0 if i % 2 == 0 else 0.8, top_p=0.95)
        logits, layout = model.prefill(prompt, last_only=True)
        first = sample(logits, [sp], [i], [0])[0]
        worker.submit(DecodeRequest(f"r{i}", layout, first, sp, seed=i))
        out[f"r{i}"] = [first.token_id]
    times = []
    while worker.has_work():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        events = worker.step()
        times.append(time.perf_counter() - t0)
        for ev in events:
            out[ev.request_id].append(ev.token.token_id)
    worker.check_integrity()
    stats = worker.stats()
    return {"tokens": out, "step_ms": _median_ms(times[2:]), "startup_s": round(startup_s, 2), "step": stats["step"],
            "misses": stats.get("misses", 0)}


def _kernels_per_step(worker) -> int:
    """CUDA kernels one step launches (profiled)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        worker.step()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


@check
def decode_graphs() -> dict:
    from model.builtin import ensure_builtin
    from model.loader import load_model

    model = load_model(ensure_builtin(), device="cuda")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(6, model.cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 40, 130, 260, 77, 300)]
    out: dict = {}
    ok = True
    for offload in (True, False):
        name = "tier_on" if offload else "tier_off"
        progress(f"gpu_check: {name} eager")
        eager = _decode_streams(model, offload, "eager", prompts, 96)
        progress(f"gpu_check: {name} captured")
        graphs = _decode_streams(model, offload, "compiled", prompts, 96)
        same = eager["tokens"] == graphs["tokens"]
        ok &= same and graphs["step"]["mode"] == "cuda_graphs"
        out[name] = {
            "tokens_identical": same, "eager_step_ms": eager["step_ms"], "graph_step_ms": graphs["step_ms"],
            "speedup": round(eager["step_ms"] / graphs["step_ms"], 2), "graphs": graphs["step"]["graphs"],
            "capture_s": graphs["step"]["capture_s"], "startup_s": graphs["startup_s"], "misses": graphs["misses"],
        }
    # kernel launches of one eager step (6 requests, context ~100-400)
    progress("gpu_check: profiling one eager step")
    from cachetier.store import TieredStore
    from core.roles import TierConfig
    from core.types import SamplingParams
    from decode.worker import DecodeRequest, DecodeWorker
    from model.sampling import sample

    store = TieredStore(model.cfg, TierConfig(offload=True), dtype=model.dtype, device=model.device)
    worker = DecodeWorker(model, store, max_running=16)
    for i, prompt in enumerate(prompts):
        sp = SamplingParams(max_tokens=8, ignore_eos=True)
        logits, layout = model.prefill(prompt, last_only=True)
        worker.submit(DecodeRequest(f"k{i}", layout, sample(logits, [sp], [i], [0])[0], sp, seed=i))
    worker.step()
    out["eager_kernels_per_step"] = _kernels_per_step(worker)
    out["ok"] = bool(ok)
    return out


@check
def packed_weights() -> dict:
    from bench.gpu_check_weights import checks

    results = checks(quick=True)
    return {"ok": all(c["ok"] is not False for c in results), "checks": results}


@check
def parallel_nccl() -> dict:
    """Replicas over nccl, one GPU per rank (`bench.parallel`): every layout the GPUs allow against one GPU
    running the same requests; logits within 1e-3 (bf16-free fp32 model), tokens/s and collectives per step."""
    from bench.parallel import run_ranks
    from core.parallel import ParallelLayout
    from model.builtin import ensure_builtin

    gpus = torch.cuda.device_count()
    model_dir = str(ensure_builtin())
    batch, context, steps = 8, 256, 20
    out: dict = {"gpus": gpus, "layouts": {}}
    layouts = [t for t in ("dp2+ep2", "tp2", "dp4+ep4", "dp2xtp2+ep4", "dp8+ep8") if ParallelLayout.parse(t).world <= gpus]
    ok = True
    for text in layouts or ["dp1"]:
        layout = ParallelLayout.parse(text)
        single = run_ranks("dp1", model_dir, batch * layout.dp, context, steps, "cuda")[0]
        ranks = run_ranks(text, model_dir, batch, context, steps, "cuda")
        diff = 0.0
        for d in range(layout.dp):
            rows = slice(d * batch, (d + 1) * batch)
            for got, want in zip(ranks[d * layout.tp]["logits"], single["logits"]):
                diff = max(diff, float((got - want[rows]).abs().max()))
        seconds = max(r["seconds"] for r in ranks)
        out["layouts"][text] = {
            "max_abs_logit_diff": diff, "ok": diff <= 1e-3,
            "one_gpu_step_ms": round(single["seconds"] / steps * 1e3, 3),
            "replica_step_ms": round(seconds / steps * 1e3, 3),
            "collective_calls_per_step": {k: v / steps for k, v in ranks[0]["stats"]["calls"].items()},
        }
        ok = ok and diff <= 1e-3
    out["ok"] = ok
    return out


def main() -> None:
    if not torch.cuda.is_available():
        emit({"bench": "gpu_check", "cuda": False, "env": environment(),
              "note": "no CUDA device is present: no check was run"})
        return
    results = {}
    for fn in CHECKS:
        progress(f"gpu_check: {fn.__name__}")
        t0 = time.perf_counter()
        try:
            res = fn()
        except Exception as e:  # reported, not raised: the other checks still run
            res = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        res["seconds"] = round(time.perf_counter() - t0, 1)
        results[fn.__name__] = res
    emit({"bench": "gpu_check", "cuda": True, "device": torch.cuda.get_device_name(), "env": environment(),
          "ok": all(r.get("ok") for r in results.values()), "checks": results})


if __name__ == "__main__":
    main()
