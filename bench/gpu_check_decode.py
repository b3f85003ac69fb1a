"""`decode_graphs` and `capture_guard`: the decode step as a worker runs it on the device.

`decode_graphs`: the built-in model in fp32 and bf16, KV `bf16` and `v4`, tier on and off. Per case the same
prefilled requests decode greedily three times: eagerly; then through CUDA graphs, captured at start only up
to one block of context, so the longest request crosses into a bucket with no graph mid-run and its steps
run uncaptured; then, once the worker is idle, `DecodeWorker.idle_work` captures that bucket while a second
thread reserves and frees pages in the store (what an actor's event loop does during a capture), and the
requests decode again, every step now a replay. Tokens must match and logits agree within a tolerance
(padded and exact batches may pick different matmul kernels); a token that differs must sit on a near tie.

`capture_guard`: `kernels.capture_guard` over one fixed-shape step on the device itself (real tensors, CUDA's
sync debug mode on), for the same cases as tests/integration/test_capture_safety.py, then that step captured
in a CUDA graph and replayed against its eager output.
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
import traceback

import torch

from bench.gpu_check_util import Ctx, device_ms, runner_state, synchronize
from cachetier.geometry import default_block_tokens
from cachetier.store import TieredStore
from cluster.inprocess import InProcessEngine
from core.config import CSA, HASH_MOE, HCA, MOE
from core.configs import StepConfig, TierConfig
from core.request import Request
from core.types import SamplingParams
from decode.runner import _forward
from decode.worker import DecodeWorker
from kernels.capture_guard import CaptureUnsafe, capture_guard
from model.builtin import ensure_builtin, random_init
from model.loader import build_empty, load_model
from model.packed import pack_like_checkpoint
from model.realformat import realformat_config

LOGIT_REL_TOL = {torch.float32: 1e-3, torch.bfloat16: 5e-2}
"""Largest logit difference between two runs of the same step, over the largest |logit|."""
MAX_RUNNING = 8
MAX_TOKENS = 32
MiB = 2**20


def _tier(cfg, offload: bool, budget: int, reserved: int, resident: bool = False) -> TierConfig:
    # a hot buffer as small as top-k, so the resolve misses and evicts
    return TierConfig(offload=offload, hot_buffer_slots=cfg.index_topk, reserved_slots=reserved, device_budget_bytes=budget,
                      host_pool_bytes=budget, max_running=MAX_RUNNING, resident=resident)


def _prompts(vocab: int, block: int) -> list[tuple[int, ...]]:
    # the longest starts a few tokens short of one block and crosses into the second block mid-run
    gen = torch.Generator().manual_seed(3)
    return [tuple(torch.randint(6, vocab, (n,), generator=gen).tolist()) for n in (5, 40, block // 2, block - 6)]


def _recording(runner, device: str) -> tuple[list, list]:
    """Keep every forward's logits (on the device) and its time as the worker's runner returns them."""
    steps, times, run = [], [], runner.run

    def run_and_keep(ids, tokens, before_forward=None):
        synchronize(device)
        t0 = time.perf_counter()
        logits = run(ids, tokens, before_forward)
        synchronize(device)
        times.append(time.perf_counter() - t0)
        steps.append((tuple(ids), logits.float()))
        return logits

    runner.run = run_and_keep
    return steps, times


def _decode(engine: InProcessEngine, prompts: list, device: str) -> dict:
    """Greedy completions of the prompts (prefilled by the engine, decoded by its worker), every step's logits."""
    steps, times = _recording(engine.decode.runner, device)
    sp = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    done = engine.generate([Request(f"r{i}", p, sp) for i, p in enumerate(prompts)])
    del engine.decode.runner.run  # the runner's own method again
    return {"tokens": {rid: c.token_ids for rid, c in done.items()}, "logits": steps,
            "step_ms": round(statistics.median(times[2:] or times) * 1e3, 3)}


def compare(a: dict, b: dict, dtype: torch.dtype) -> dict:
    """Tokens equal, and the logits of every step up to the first differing argmax within tolerance; a token that
    differs is accepted only where its row's top two logits are closer than twice that step's difference (a near
    tie, which a rounding difference may flip)."""
    diffs, flips, scale = [], [], []
    for (ids_a, la), (ids_b, lb) in zip(a["logits"], b["logits"]):
        if ids_a != ids_b:
            break
        diffs.append((la - lb).abs().max())
        flips.append(la.argmax(-1) != lb.argmax(-1))  # [rows]
        scale.append(la.abs().max())
    if not diffs:
        return {"tokens_identical": a["tokens"] == b["tokens"], "compared_steps": 0, "ok": False}
    flipped = torch.stack([f.any() for f in flips]).tolist()
    upto = flipped.index(True) + 1 if True in flipped else len(diffs)
    diff = torch.stack(diffs[:upto]).max().item()
    rel = diff / max(torch.stack(scale[:upto]).max().item(), 1e-30)
    same = a["tokens"] == b["tokens"]
    out = {"tokens_identical": same, "compared_steps": upto, "max_abs_logit_diff": diff, "rel_logit_diff": rel}
    if True in flipped:
        top2 = a["logits"][upto - 1][1][flips[upto - 1]].topk(2, dim=-1).values  # [flipped rows, 2]
        out["gap_at_first_flip"] = (top2[:, 0] - top2[:, 1]).max().item()
        same = out["gap_at_first_flip"] <= 2 * diffs[upto - 1].item()
    out["ok"] = rel <= LOGIT_REL_TOL[dtype] and same
    return out


def _churn(store: TieredStore, stop: threading.Event, stats: dict) -> None:
    """Reserve and free pages until stopped, as an actor's event loop does while its step thread works."""
    i = 0
    while not stop.is_set():
        try:
            if store.reserve(f"churn{i}", 64):
                store.free(f"churn{i}")
        except Exception as exc:
            stats["error"] = f"{type(exc).__name__}: {exc}"
            return
        i += 1
    stats["loops"] = i


def _capture_when_idle(worker: DecodeWorker) -> dict:
    """Let the idle worker capture what its steps found uncaptured while another thread reserves and frees."""
    stop, stats = threading.Event(), {}
    churn = threading.Thread(target=_churn, args=(worker.store, stop, stats), daemon=True)
    pending = len(worker.runner.pending_captures)
    t0 = time.perf_counter()
    churn.start()
    try:
        captured = 0
        while worker.idle_work():
            captured += 1
    finally:
        stop.set()
        churn.join(10)
    return {"pending_before": pending, "captured": captured, "seconds": round(time.perf_counter() - t0, 3),
            "reserve_free_loops": stats.get("loops", 0), "thread_error": stats.get("error")}


def _graphs_case(ctx: Ctx, model, offload: bool, resident: bool = False) -> dict:
    """`resident`: C4 entries resident while there is room (`--resident on`): the graphs hold the mixed view."""
    cfg, dev = model.cfg, ctx.device
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()
    block = default_block_tokens(cfg)
    prompts = _prompts(cfg.vocab_size, block)

    def engine(mode: str) -> InProcessEngine:
        # graphs at start for contexts up to one block only; CPU debug runs compile with the quick backend
        step = StepConfig(decode_mode=mode, capture_context_tokens=block, compile_backend="eager")
        return InProcessEngine(model, _tier(cfg, offload, 64 * MiB, 4, resident), step=step)

    eng = engine("eager")
    eager = _decode(eng, prompts, dev)
    eng.close()
    eng = engine("compiled")
    runner = eng.decode.runner
    start = runner_state(runner)
    first = _decode(eng, prompts, dev)
    after_first = runner_state(runner)
    idle = _capture_when_idle(eng.decode)
    second = _decode(eng, prompts, dev)
    end = runner_state(runner)
    out = {"eager_step_ms": eager["step_ms"], "graph_step_ms": second["step_ms"], "mode": end["mode"],
           "graphs_at_start": start["graphs"], "capture_s_at_start": start["capture_s"],
           "uncaptured_steps_first_run": after_first["uncaptured_steps"], "idle_capture": idle, "graphs_at_end": end["graphs"],
           "capture_s_total": end["capture_s"], "uncaptured_steps_second_run": end["uncaptured_steps"] - after_first["uncaptured_steps"],
           "eager_vs_first": compare(eager, first, model.dtype), "eager_vs_second": compare(eager, second, model.dtype)}
    lazy_ok = True
    if ctx.cuda:
        lazy = [b for b in runner.graphs if b[1] > 1]  # a bucket wider than one block: captured while idle
        if lazy:
            out["replay_ms"] = {"bucket": list(lazy[0]), "ms": device_ms(runner.graphs[lazy[0]][0].replay, dev)}
        out["max_memory_allocated_mib"] = round(torch.cuda.max_memory_allocated() / MiB, 1)
        lazy_ok = (out["uncaptured_steps_first_run"] > 0 and idle["captured"] > 0 and out["uncaptured_steps_second_run"] == 0
                   and idle["reserve_free_loops"] > 0 and idle["thread_error"] is None and end["mode"] == "cuda_graphs")
    eng.close()
    out["ok"] = bool(lazy_ok and out["eager_vs_first"]["ok"] and out["eager_vs_second"]["ok"])
    return out


def decode_graphs(ctx: Ctx) -> dict:
    model_dir = ensure_builtin()
    cases = [(torch.float32, "bf16"), (torch.bfloat16, "v4")] if ctx.small else \
        [(dt, fmt) for dt in (torch.float32, torch.bfloat16) for fmt in ("bf16", "v4")]
    ok, resident_done = True, False
    for dtype, fmt in cases:
        model = load_model(model_dir, dtype=dtype, device=ctx.device, kv_format=fmt)
        for offload in (True, False) if not ctx.small else (fmt == "v4",):
            name = f"{str(dtype)[6:]}_kv_{fmt}_tier_{'on' if offload else 'off'}"
            ok = _part(ctx, name, _graphs_case, ctx, model, offload) and ok
            if offload and not resident_done:  # resident C4 entries (`--resident on`): the first tier-on case only
                resident_done = True
                ok = _part(ctx, f"{name}_resident", _graphs_case, ctx, model, True, True) and ok
        del model
        if ctx.cuda:
            torch.cuda.empty_cache()
    return {"ok": ok}


def _part(ctx: Ctx, name: str, fn, *args) -> bool:
    """Run `fn(*args)`, one part of a check; record its result (or its error); say whether it held."""
    try:
        res = fn(*args)
    except Exception as exc:
        res = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
    ctx.record(name, res)
    return bool(res["ok"])


# --- the capture guard on the device -------------------------------------------------------------------

GUARD_CASES = [  # (kv format, tier on, packed weights, dtype): every pair of two factors' values occurs
    ("bf16", False, False, torch.float32),
    ("bf16", True, True, torch.bfloat16),
    ("v4", False, True, torch.bfloat16),
    ("v4", True, False, torch.bfloat16),
    ("v4", True, True, torch.float32),
]
GUARD_ROWS, GUARD_BLOCKS = 4, 8  # two requests and two padding rows; 512 C4 entries gathered per row


def _guard_model(ctx: Ctx, fmt: str, packed: bool, dtype: torch.dtype):
    cfg = dataclasses.replace(realformat_config(), layer_types=(CSA, HCA), mlp_layer_types=(HASH_MOE, MOE), kv_format="bf16")
    model = build_empty(cfg, dtype)
    random_init(model, 7)
    if packed:
        pack_like_checkpoint(model)
    return model.set_kv_format(fmt).to(ctx.device)


def _device_state(store: TieredStore) -> list[torch.Tensor]:
    """Every tensor the store holds (and its host pool): a step rewrites some of them (an emitting row's overlap
    state among them, so the same step run twice differs), and restoring them reruns a step from one state."""
    out = []
    for v in vars(store).values():
        out += [t for t in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(t, torch.Tensor)]
    return out + ([store.hot.host.kv] if store.hot is not None else [])


def _restorer(store: TieredStore, device: str):
    state = _device_state(store)
    saved = [t.clone() for t in state]

    def restore() -> None:
        synchronize(device)  # kernels may still be writing the host pool through its mapping
        for t, s in zip(state, saved):
            t.copy_(s)

    return restore


def _captured(view, model, restore) -> torch.Tensor:
    """The step captured in a CUDA graph (warmed up on a side stream first, as the runner does), then replayed
    once from the restored state."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _forward(model, view)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = _forward(model, view)
    restore()  # capturing ran nothing; the replay starts where the eager step did
    graph.replay()
    torch.cuda.synchronize()
    return out


def _guard_case(ctx: Ctx, fmt: str, offload: bool, packed: bool, dtype: torch.dtype) -> dict:
    model = _guard_model(ctx, fmt, packed, dtype)
    store = TieredStore(model.cfg, _tier(model.cfg, offload, 8 * MiB, 2), dtype=dtype, device=ctx.device)
    gen = torch.Generator().manual_seed(7)
    ids = []
    for i, n in enumerate((23, 41)):
        _, lay = model.prefill(torch.randint(2, model.cfg.vocab_size, (n,), generator=gen).tolist(), last_only=True)
        store.admit(f"r{i}", lay, lay.num_tokens + 8)
        ids.append(f"r{i}")
    view = store.step_view(ids, GUARD_ROWS, num_blocks=GUARD_BLOCKS, tokens=[3, 5])
    restore = _restorer(store, ctx.device)
    out: dict = {"violations": []}
    with torch.inference_mode():
        eager = _forward(model, view).float()  # outside the guard: Triton compiles its kernels here
        restore()
        try:
            with capture_guard(ctx.device):
                _forward(model, view)
        except CaptureUnsafe as exc:
            out["violations"] = [str(v) for v in exc.violations][:20]
        restore()
        if ctx.cuda and not out["violations"]:
            replayed = _captured(view, model, restore).float()
            out["graph_vs_eager_rel"] = ((replayed - eager).abs().max() / eager.abs().max()).item()
    store.close()
    if not ctx.cuda:  # the CPU's eager step ranks top-k by data-dependent paths on purpose (a compiled one does not)
        return {**out, "ok": True, "note": "CPU debug run: setup only; violations are reported, not judged"}
    out["ok"] = not out["violations"] and out["graph_vs_eager_rel"] <= LOGIT_REL_TOL[dtype]
    return out


def capture_guard_check(ctx: Ctx) -> dict:
    ok = True
    for fmt, offload, packed, dtype in GUARD_CASES:
        name = f"{fmt}_tier_{'on' if offload else 'off'}_{'packed' if packed else 'dense'}_{str(dtype)[6:]}"
        ok = _part(ctx, name, _guard_case, ctx, fmt, offload, packed, dtype) and ok
    return {"ok": ok}
