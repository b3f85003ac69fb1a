"""A decode replica's step, fixed-shape against eager: time per step, tokens/s, collectives per step.

Every rank is a real process (`torch.multiprocessing`; one thread each on CPU, one GPU each with `--device
cuda`) joined by `model.parallel.Comm` (gloo on CPU, nccl on CUDA), holding its shard and a `DecodeWorker`
in lockstep with the others (`join_replica`), as a served decode replica runs. Ranks get uneven batches
(`--batches`, one count per rank), so under the fixed-shape step the smaller ones pad to the agreed bucket.
For each decode mode (`eager`: exact rows, row counts gathered inside every forward; `auto`: the fixed-shape
step, uncompiled on CPU, CUDA graphs with the exchanges inside on CUDA) it reports, in one JSON object:
- `ms_per_step` / `median_ms_per_step`: per step the slowest rank's time, over `--steps` timed steps (after
  a warm-up step), and `tokens_per_s` of the whole replica. Both modes run in the same processes on the same
  requests, by turns of `--block` steps, so a busy machine slows both alike;
- `collectives_per_step`: calls and bytes rank 0 put into every kind of collective per step (a replayed
  graph counts what its capture recorded);
- the buckets the fixed-shape ranks agreed on, the graphs captured and how long capture took (CUDA).
Greedy tokens of the two modes are compared (`same_tokens`).

    python -m bench.replica_step [--batches 8,3] [--context 256] [--steps 40] [--block 5] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import emit, environment, open_rank, progress

MODES = ("eager", "auto")


def _prompts(counts: list[int], context: int, vocab: int, seed: int) -> list[list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(6, vocab, (context,), generator=g).tolist() for _ in range(n)] for n in counts]


def _rank(rank: int, layout_text: str, port: int, model_dir: str, out_dir: str, counts: list[int], context: int,
          steps: int, block: int, device_kind: str) -> None:
    """One rank: load its shard, prefill its requests, give the same requests to one worker per decode mode
    (each in lockstep with its peers), then run them by turns, `block` steps of one mode and then of the
    next, so that both modes share whatever else the machine is doing; write a record."""
    torch.set_num_threads(1)
    from cachetier.store import TieredStore
    from core.configs import StepConfig, TierConfig
    from core.types import SampledToken, SamplingParams
    from decode.worker import DecodeRequest, DecodeWorker
    from model.loader import load_model
    from model.parallel import CollectiveStats

    layout, device, comm = open_rank(layout_text, rank, port, device_kind, timeout_s=600)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    try:
        model = load_model(model_dir, device=device, shard=comm.shard).attach(comm)
        prompts = _prompts(counts, context, model.cfg.vocab_size, 3)[rank]
        budget = 64 * 2**20
        tier = TierConfig(offload=True, hot_buffer_slots=model.cfg.index_topk, reserved_slots=4, max_running=max(counts),
                          device_budget_bytes=budget, host_pool_bytes=budget)
        with torch.inference_mode():
            if prompts:
                logits, layouts = model.prefill_batch([(p, None) for p in prompts], last_only=True)
            else:
                logits, layouts = [], []
                model.idle_forward()
        first = [int(lg[-1].argmax()) for lg in logits]
        sp = SamplingParams(max_tokens=steps + 8, ignore_eos=True)
        workers, tokens, join_s = {}, {}, {}
        for mode in MODES:
            store = TieredStore(model.cfg, tier, dtype=model.dtype, device=device)
            # captures up to the context the bench reaches, so no timed step runs uncaptured
            step_cfg = StepConfig(decode_mode=mode, capture_context_tokens=context + steps + 8)
            worker = workers[mode] = DecodeWorker(model, store, max_running=tier.max_running, step_config=step_cfg)
            t0 = time.perf_counter()
            worker.join_replica()
            join_s[mode] = time.perf_counter() - t0
            tokens[mode] = {f"q{i}": [t] for i, t in enumerate(first)}
            for i, lay in enumerate(layouts):
                worker.submit(DecodeRequest.fresh(f"q{i}", lay.clone(), SampledToken(first[i]), sp, 1000 + i))
            for ev in worker.step():  # a warm-up step (admission)
                tokens[mode][ev.request_id].append(ev.token.token_id)
        times = {mode: [] for mode in MODES}
        spent = {mode: CollectiveStats() for mode in MODES}  # collectives of each mode's timed steps
        for _ in range(steps // block):
            for mode in MODES:
                before = comm.stats.copy()
                for _ in range(block):
                    sync()
                    t0 = time.perf_counter()
                    events = workers[mode].step()
                    sync()
                    times[mode].append(time.perf_counter() - t0)
                    for ev in events:
                        tokens[mode][ev.request_id].append(ev.token.token_id)
                spent[mode].merge(comm.stats.since(before))
        record = {"tokens": tokens, "rows": len(prompts)}
        for mode, worker in workers.items():
            runner = worker.runner
            record[mode] = {"times": times[mode], "stats": spent[mode].to_dict(), "runs": runner.mode,
                            "buckets": sorted(runner.steps_by_bucket), "graphs": len(runner.graphs),
                            "capture_s": round(runner.capture_s, 3), "join_s": round(join_s[mode], 3),
                            "uncaptured": runner.eager_steps}
            worker.close()
        torch.save(record, Path(out_dir) / f"rank{rank}.pt")
    finally:
        comm.close()


def run_ranks(model_dir: str, counts: list[int], context: int, steps: int, block: int, device: str) -> list[dict]:
    import torch.multiprocessing as mp

    from model.parallel import free_port

    layout = f"dp{len(counts)}+ep{len(counts)}"
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank, args=(layout, free_port(), model_dir, out, counts, context, steps, block, device), nprocs=len(counts))
        return [torch.load(Path(out) / f"rank{r}.pt") for r in range(len(counts))]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="tiny (the built-in model) or a model directory")
    p.add_argument("--batches", default="8,3", help="requests per rank, comma-separated (default 8,3: a dp2+ep2 replica)")
    p.add_argument("--context", type=int, default=256, help="prompt tokens per request (default 256)")
    p.add_argument("--steps", type=int, default=40, help="timed decode steps per mode (default 40)")
    p.add_argument("--block", type=int, default=5, help="steps of one mode before the other's turn (default 5)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one GPU per rank, nccl")
    args = p.parse_args(argv)

    from model.builtin import resolve_model_dir

    counts = [int(x) for x in args.batches.split(",")]
    if args.device == "cuda" and torch.cuda.device_count() < len(counts):
        raise SystemExit(f"{len(counts)} ranks need {len(counts)} GPUs (nccl puts one rank on each); "
                         f"this machine has {torch.cuda.device_count()}")
    model_dir = str(resolve_model_dir(args.model))
    result: dict = {"bench": "replica_step", "environment": environment(), "model": model_dir, "batches": counts,
                    "context": args.context, "steps": args.steps, "device": args.device, "modes": {}}
    progress(f"dp{len(counts)}+ep{len(counts)}, batches {counts}: modes {MODES} by turns of {args.block} steps")
    ranks = run_ranks(model_dir, counts, args.context, args.steps, args.block, args.device)
    steps = len(ranks[0][MODES[0]]["times"])
    for mode in MODES:
        # a lockstep step ends on every rank at about the same time: the slowest rank's figures are the replica's
        per_step = [max(r[mode]["times"][i] for r in ranks) for i in range(steps)]
        mine = ranks[0][mode]
        result["modes"][mode] = {
            "runs": mine["runs"],
            "ms_per_step": round(1e3 * sum(per_step) / steps, 2),
            "median_ms_per_step": round(1e3 * statistics.median(per_step), 2),
            "tokens_per_s": round(sum(r["rows"] for r in ranks) * steps / sum(per_step), 1),
            "collectives_per_step": {"calls": {k: v / steps for k, v in mine["stats"]["calls"].items()},
                                     "bytes": {k: v / steps for k, v in mine["stats"]["bytes"].items()}},
            "buckets": mine["buckets"], "graphs": mine["graphs"], "capture_s": max(r[mode]["capture_s"] for r in ranks),
            "join_s": max(r[mode]["join_s"] for r in ranks), "uncaptured_steps": max(r[mode]["uncaptured"] for r in ranks),
        }
    eager, fixed = (result["modes"][m]["median_ms_per_step"] for m in MODES)
    result["fixed_over_eager_median_step"] = round(fixed / eager, 3)
    result["same_tokens"] = all(r["tokens"][MODES[0]] == r["tokens"][MODES[1]] for r in ranks)
    emit(result)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
