"""Replicas of several ranks against one process: resident weights per rank, decode speed, collectives.

Every rank is a real process (`torch.multiprocessing`, one thread each on CPU; one GPU each with
`--device cuda`), joined by `model.parallel.Comm` (gloo on CPU, nccl on CUDA), loading only its shard
from the checkpoint through the loader. Reported, in one JSON object:
- `weights`: per layout, the bytes each rank holds against the whole model's;
- `decode`: a replica (default `dp2+ep2`, `--batch` requests per rank) against one process decoding all
  of the replica's requests in one batch: tokens/s of each (the tier on, greedy, `--steps` timed steps
  after two warm-up ones) and their ratio, with the largest logit difference between the two over the
  timed steps; on CPU this shows what the exchanges cost, not what splitting a model across devices wins;
- `collectives_per_step`: calls and bytes each rank puts into every kind of collective per decode step.

    python -m bench.parallel [--batch 8] [--context 256] [--steps 20] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from bench.common import emit, environment, open_rank, progress

WEIGHT_LAYOUTS = ("dp2", "dp2+ep2", "tp2", "dp4+ep4")
WIDE_LAYOUTS = ("tp4", "dp2xtp2+ep4", "dp4+ep4")


def _prompts(num: int, context: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(6, vocab, (context,), generator=g).tolist() for _ in range(num)]


def _rank(rank: int, layout_text: str, port: int, model_dir: str, out_dir: str, batch: int, context: int,
          steps: int, device_kind: str) -> None:
    """One rank: load its shard, prefill its DP group's requests, time `steps` decode steps, write a record."""
    torch.set_num_threads(1)
    from cachetier.store import TieredStore
    from core.configs import TierConfig
    from model.loader import load_model

    layout, device, comm = open_rank(layout_text, rank, port, device_kind, timeout_s=600)
    try:
        model = load_model(model_dir, device=device, shard=comm.shard).attach(comm if not layout.single else None)
        dp_rank, _ = layout.coords(rank)
        prompts = _prompts(batch * layout.dp, context, model.cfg.vocab_size, 3)[dp_rank * batch:(dp_rank + 1) * batch]
        budget = 256 * 2**20
        store = TieredStore(model.cfg, TierConfig(offload=True, hot_buffer_slots=model.cfg.index_topk, reserved_slots=4,
                                                  device_budget_bytes=budget, host_pool_bytes=budget),
                            dtype=model.dtype, device=device)
        with torch.inference_mode():
            logits, layouts = model.prefill_batch([(p, None) for p in prompts], last_only=True)
            ids = [f"r{i}" for i in range(len(prompts))]
            for rid, lay in zip(ids, layouts):
                store.admit(rid, lay, context + steps + 8)
            tokens = [int(lg[-1].argmax()) for lg in logits]
            record = []
            for step in range(steps + 2):
                if step == 2:
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    comm.stats.reset()
                    t0 = time.perf_counter()
                view = store.step_view(ids, len(ids), tokens=tokens)
                out = model.decode_forward(view, view.token_ids)[: len(ids)]
                view.advance()
                tokens = out.argmax(-1).tolist()
                if step >= 2:
                    record.append(out.float().cpu())
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
        weight_bytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        torch.save({"seconds": seconds, "tokens": steps * len(ids), "stats": comm.stats.to_dict(), "logits": record,
                    "weight_bytes": weight_bytes, "misses": int(store.hot.counters[:, 1].sum()) if store.hot is not None else 0},
                   Path(out_dir) / f"rank{rank}.pt")
    finally:
        comm.close()


def run_ranks(layout_text: str, model_dir: str, batch: int, context: int, steps: int, device: str) -> list[dict]:
    import torch.multiprocessing as mp

    from core.parallel import ParallelLayout
    from model.parallel import free_port

    world = ParallelLayout.parse(layout_text).world
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank, args=(layout_text, free_port(), model_dir, out, batch, context, steps, device), nprocs=world)
        return [torch.load(Path(out) / f"rank{r}.pt") for r in range(world)]


def shard_bytes(model_dir: Path, layouts) -> dict:
    """Per layout, each rank's resident bytes (its shard, loaded by the loader) against the whole model's."""
    from core.parallel import ParallelLayout
    from model.loader import load_model
    from model.packed import resident_bytes

    whole = resident_bytes(load_model(model_dir))
    out = {"whole_bytes": whole}
    for text in layouts:
        layout = ParallelLayout.parse(text)
        per_rank = [resident_bytes(load_model(model_dir, shard=layout.shard(r))) for r in range(layout.world)]
        out[text] = {"per_rank_bytes": per_rank, "max_rank_over_whole": round(max(per_rank) / whole, 3)}
    return out


def _wide_model_dir(tmp: Path) -> Path:
    """An 8-head, 4-group, 8-expert model (the built-in one is too small to split 4 ways)."""
    import dataclasses

    from model.builtin import random_init, tiny_config
    from model.loader import build_empty, save_checkpoint

    cfg = dataclasses.replace(tiny_config(), name="synthetic-8h", num_heads=8, o_groups=4, n_routed_experts=8)
    model = build_empty(cfg)
    random_init(model, 11)
    save_checkpoint(model, tmp)
    return tmp


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="tiny (the built-in model) or a model directory")
    p.add_argument("--layout", default="dp2+ep2", help="the replica to time against one process (default dp2+ep2)")
    p.add_argument("--batch", type=int, default=8, help="requests per DP group (default 8)")
    p.add_argument("--context", type=int, default=256, help="prompt tokens per request (default 256)")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps (default 20)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one GPU per rank, nccl")
    args = p.parse_args(argv)

    from core.parallel import ParallelLayout
    from model.builtin import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    result: dict = {"bench": "parallel", "environment": environment(), "model": str(model_dir)}
    progress("resident bytes per rank")
    result["weights"] = {"builtin": shard_bytes(model_dir, WEIGHT_LAYOUTS)}
    with tempfile.TemporaryDirectory() as tmp:
        result["weights"]["synthetic_8_heads_8_experts"] = shard_bytes(_wide_model_dir(Path(tmp)), WIDE_LAYOUTS)

    layout = ParallelLayout.parse(args.layout)
    progress(f"decode: one process, {args.batch * layout.dp} requests")
    single = run_ranks("dp1", str(model_dir), args.batch * layout.dp, args.context, args.steps, args.device)[0]
    progress(f"decode: replica {layout.describe()}, {args.batch} requests per DP group")
    ranks = run_ranks(args.layout, str(model_dir), args.batch, args.context, args.steps, args.device)
    replica_s = max(r["seconds"] for r in ranks)
    replica_tokens = sum(r["tokens"] for r in ranks[:: layout.tp])  # a TP group's ranks make the same tokens
    ref = single["logits"]
    diff = 0.0
    for dp_rank in range(layout.dp):
        rows = slice(dp_rank * args.batch, (dp_rank + 1) * args.batch)
        for got, want in zip(ranks[dp_rank * layout.tp]["logits"], ref):
            diff = max(diff, float((got - want[rows]).abs().max()))
    result["decode"] = {
        "layout": layout.describe(), "device": args.device, "context": args.context, "steps": args.steps,
        "requests": args.batch * layout.dp,
        "one_process_tokens_per_s": round(single["tokens"] / single["seconds"], 1),
        "replica_tokens_per_s": round(replica_tokens / replica_s, 1),
        "replica_over_one_process": round(single["seconds"] / replica_s, 3),
        "max_abs_logit_diff": diff,
        "misses": [r["misses"] for r in ranks],
    }
    calls = ranks[0]["stats"]["calls"]
    result["collectives_per_step"] = {
        "calls": {k: v / args.steps for k, v in calls.items()},
        "bytes": {k: v / args.steps for k, v in ranks[0]["stats"]["bytes"].items()},
    }
    emit(result)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
