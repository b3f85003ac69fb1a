"""`engine`: the single-process serving path on the device, as `hisparse generate` runs it.

`engine`: `InProcessEngine` with the built-in model in the serving dtype (`core.device.serving_dtype`: bf16 on
CUDA) and the default decode mode (CUDA graphs), 8 requests at once: five greedy, one asking for prompt
log-probabilities (checked against log-softmax of a full prefill's logits), two sampled with seeds. The batch
runs twice and each seeded request once alone: its tokens must not depend on the run or on its neighbours.
"""

from __future__ import annotations

import time

import torch

from bench.gpu_check_util import Ctx, runner_state
from cluster.inprocess import InProcessEngine
from core import device as devices
from core.configs import StepConfig, TierConfig
from core.request import Request
from core.types import SamplingParams
from model.builtin import ensure_builtin
from model.loader import load_model

PROMPT_LOGPROB_TOL = {torch.float32: 1e-3, torch.bfloat16: 0.1}
"""Largest |log-prob| difference between the prefill worker's prompt log-probs and a full prefill's."""
GREEDY_LENGTHS = (3, 17, 60, 120, 200)
SEEDS = (11, 12)


def _requests(vocab: int, tag: str) -> dict[str, Request]:
    gen = torch.Generator().manual_seed(17)

    def prompt(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(2, vocab, (n,), generator=gen).tolist())

    out = {f"greedy{i}": SamplingParams(max_tokens=12, ignore_eos=True) for i in range(len(GREEDY_LENGTHS))}
    prompts = {f"greedy{i}": prompt(n) for i, n in enumerate(GREEDY_LENGTHS)}
    out["logprobs"], prompts["logprobs"] = SamplingParams(max_tokens=4, prompt_logprobs=2), prompt(30)
    for s in SEEDS:
        out[f"seeded{s}"] = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, top_k=50, seed=s, ignore_eos=True)
        prompts[f"seeded{s}"] = prompt(25 + s)
    return {name: Request(f"{name}-{tag}", prompts[name], sp) for name, sp in out.items()}


def _run(engine: InProcessEngine, reqs: dict[str, Request]) -> dict:
    """Completions by request name (ids carry a per-run tag, so a later run never meets an earlier id)."""
    done = engine.generate(list(reqs.values()))
    return {name: done[r.request_id] for name, r in reqs.items()}


def _prompt_logprobs(model, req: Request, got: list) -> dict:
    """The prefill worker's prompt log-probs against log-softmax of one full prefill's logits, on the same device."""
    ids = list(req.prompt_token_ids)
    logits, _ = model.prefill(ids)  # [tokens, vocab]
    ref = torch.log_softmax(logits.float(), dim=-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    vals = [p.logprob for p in got[1:]]
    diff = max((abs(a - b) for a, b in zip(vals, ref)), default=float("inf"))
    shape_ok = len(got) == len(ids) and got[0].logprob is None and all(v is not None and v <= 0 for v in vals)
    return {"count": len(got), "prompt_tokens": len(ids), "max_abs_diff_vs_full_prefill": diff,
            "top_logprobs_per_token": len(got[1].top_logprobs) if len(got) > 1 else 0,
            "ok": shape_ok and diff <= PROMPT_LOGPROB_TOL[model.dtype]}


def engine(ctx: Ctx) -> dict:
    kind = "cuda" if ctx.cuda else "cpu"
    devices.configure_math(kind)
    model = load_model(ensure_builtin(), dtype=devices.serving_dtype("auto", kind), device=ctx.device, kv_format="auto")
    # CUDA: the serving default (graphs), captured up to 1K tokens to keep start-up short; CPU: eager (no Inductor wait)
    step = StepConfig(capture_context_tokens=1024) if ctx.cuda else StepConfig(decode_mode="eager")
    t0 = time.perf_counter()
    eng = InProcessEngine(model, TierConfig(max_running=16), step=step)
    startup_s = round(time.perf_counter() - t0, 2)
    vocab = model.cfg.vocab_size
    t0 = time.perf_counter()
    reqs = _requests(vocab, "a")
    done = _run(eng, reqs)
    batch_s = round(time.perf_counter() - t0, 2)
    first = {name: c.token_ids for name, c in done.items()}
    second = {name: c.token_ids for name, c in _run(eng, _requests(vocab, "b")).items()}
    ctx.record("runs", {"startup_s": startup_s, "batch_s": batch_s, "tokens": first, "decode": runner_state(eng.decode.runner)})
    alone = {}
    for s in SEEDS:
        name = f"seeded{s}"
        alone[name] = _run(eng, {name: _requests(vocab, f"alone{s}")[name]})[name].token_ids
    logprobs = _prompt_logprobs(model, reqs["logprobs"], done["logprobs"].prompt_logprobs or [])
    mode = eng.decode.runner.mode
    eng.close()
    same_runs = first == second
    alone_same = {name: toks == first[name] for name, toks in alone.items()}
    sampled_differ = first["seeded11"] != first["seeded12"]  # two seeds, two streams: sampling did sample
    return {"dtype": str(model.dtype), "kv_format": model.cfg.kv_format, "mode": mode, "runs_identical": same_runs,
            "first_difference": next((n for n in first if first[n] != second[n]), None), "seeded_alone_equals_batch": alone_same,
            "seeded_streams_differ": sampled_differ, "prompt_logprobs": logprobs,
            "ok": same_runs and all(alone_same.values()) and sampled_differ and logprobs["ok"]
            and mode == ("cuda_graphs" if ctx.cuda else "eager")}
