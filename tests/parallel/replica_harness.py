"""Runs workloads on a replica of real processes (gloo, one thread each) and in one process, for the
parallel tests to compare.

The model-level workload (`run_replica`): every DP group gets its own prompts (uneven counts; a group may
get none), prefills them in one forward, then decodes greedily through a tiered store whose hot buffer is
small enough to miss. Requests stop at different steps, so ranks run uneven rows and, near the end, zero
rows (an idle forward). Each rank records per request the prefill logits of the last token, every decode
step's logits and token, and every router and indexer top-k selection it made; the reference runs each DP
group's exact schedule with the whole model in one process and records the same.

The worker-level workload (`run_worker_replica`, below): the same comparison through decode workers
stepping in lockstep, as a served decode replica does.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from cachetier.store import TieredStore
from core.configs import StepConfig, TierConfig
from core.parallel import ParallelLayout
from core.types import SampledToken, SamplingParams

DECODE_STEPS = 18


def prompts_for(layout: ParallelLayout, vocab: int, lengths: list[list[int]], seed: int) -> list[list[list[int]]]:
    """Per DP group, its prompts (token ids): `lengths[d]` gives the group's prompt lengths."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(6, vocab, (n,), generator=g).tolist() for n in group] for group in lengths[: layout.dp]]


def steps_for(prompt_lists: list[list[list[int]]]) -> list[list[int]]:
    """Decode steps per request: uneven, so rows per rank vary and ranks run out at different times."""
    return [[DECODE_STEPS - 3 * i - 2 * d for i in range(len(ps))] for d, ps in enumerate(prompt_lists)]


class Recorder:
    """Wraps the model's router and indexer selection to record what they pick (the near-tie guard)."""

    def __init__(self, model) -> None:
        from cachetier.batch import DecodeKV

        self.router: list[torch.Tensor] = []
        self.index: list[torch.Tensor] = []
        self._select = DecodeKV.index_topk  # every store's decode selection goes through it
        self._gates = [blk.ffn.gate for blk in model.layers]
        for blk in model.layers:
            gate = blk.ffn.gate
            original = gate.forward

            def forward(x, token_ids, original=original):
                idx, w = original(x, token_ids)
                if idx.numel():  # an idle forward routes no rows
                    self.router.append(idx.sort(dim=-1).values.clone())
                return idx, w

            gate.forward = forward

        def select(store, layer, q, w, topk):
            ids = self._select(store, layer, q, w, topk)
            self.index.append(ids.sort(dim=-1).values.clone())
            return ids

        DecodeKV.index_topk = select

    def close(self) -> None:
        from cachetier.batch import DecodeKV

        DecodeKV.index_topk = self._select
        for gate in self._gates:
            del gate.forward  # back to the class's method


def tier(cfg) -> TierConfig:
    return TierConfig(offload=True, hot_buffer_slots=cfg.index_topk, reserved_slots=2,
                      device_budget_bytes=16 * 2**20, host_pool_bytes=16 * 2**20)


def run_group(model, prompts: list[list[int]], steps: list[int], idle=None, sync=None) -> dict:
    """One DP group's schedule on `model` (whole, or a rank's shard attached to its replica).

    `sync(rows) -> counts` gathers every rank's rows before each forward (None: a single process);
    `idle()` runs the forward of a rank without rows."""
    rec = Recorder(model)
    out = {"prefill": [], "logits": [[] for _ in prompts], "tokens": [[] for _ in prompts]}
    store = TieredStore(model.cfg, tier(model.cfg))
    try:
        with torch.inference_mode():
            if sync is not None:
                sync(sum(len(p) for p in prompts))
            if prompts:
                logits, layouts = model.prefill_batch([(p, None) for p in prompts], last_only=True)
                out["prefill"] = [lg[-1] for lg in logits]
                tokens = [int(lg[-1].argmax()) for lg in logits]
                for i, (p, lay) in enumerate(zip(prompts, layouts)):
                    store.admit(f"r{i}", lay, len(p) + DECODE_STEPS + 2)
                    out["tokens"][i].append(tokens[i])
            elif idle is not None:
                idle()
            for step in range(max(steps, default=0) if sync is None else DECODE_STEPS):
                active = [i for i, n in enumerate(steps) if step < n]
                if sync is not None:
                    counts = sync(len(active))
                    if sum(counts) == 0:
                        break
                if not active:
                    if idle is not None:
                        idle()
                    continue
                ids = [f"r{i}" for i in active]
                view = store.step_view(ids, len(ids), tokens=[out["tokens"][i][-1] for i in active])
                logits = model.decode_forward(view, view.token_ids)[: len(ids)]
                view.advance()
                for row, i in enumerate(active):
                    out["logits"][i].append(logits[row].clone())
                    out["tokens"][i].append(int(logits[row].argmax()))
        store.check_integrity()
        out["misses"] = int(store.hot.counters[:, 1].sum()) if store.hot is not None else 0
    finally:
        rec.close()
        store.close()
    out["router"], out["index"] = rec.router, rec.index
    return out


def rank_main(rank: int, layout_text: str, port: int, model_dir: str, out_dir: str, lengths, seed: int) -> None:
    """The body of one rank's process (`torch.multiprocessing.spawn` calls it)."""
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from model.loader import load_model
    from model.parallel import Comm

    layout = ParallelLayout.parse(layout_text)
    comm = Comm.open(layout, rank, f"tcp://127.0.0.1:{port}", timeout_s=120)
    try:
        model = load_model(model_dir, shard=comm.shard).attach(comm)
        dp_rank, _ = layout.coords(rank)
        prompt_lists = prompts_for(layout, model.cfg.vocab_size, lengths, seed)
        steps = steps_for(prompt_lists)
        comm.stats.reset()
        result = run_group(model, prompt_lists[dp_rank], steps[dp_rank], idle=model.idle_forward, sync=comm.sync_rows)
        result["stats"] = comm.stats.to_dict()
        result["counters_equal_in_replica"] = comm.all_equal(result["misses"]) if layout.dp == 1 else None
        result["weight_bytes"] = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        comm.close()


def run_replica(layout_text: str, model_dir: str, out_dir: str, lengths, seed: int) -> list[dict]:
    """Spawn the replica's ranks, wait for them, and return each rank's record."""
    import torch.multiprocessing as mp

    from model.parallel import free_port

    layout = ParallelLayout.parse(layout_text)
    mp.spawn(rank_main, args=(layout_text, free_port(), model_dir, out_dir, lengths, seed), nprocs=layout.world)
    return [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(layout.world)]


def run_reference(model, layout_text: str, lengths, seed: int) -> list[dict]:
    """Each DP group's schedule with the whole model in this process."""
    layout = ParallelLayout.parse(layout_text)
    prompt_lists = prompts_for(layout, model.cfg.vocab_size, lengths, seed)
    steps = steps_for(prompt_lists)
    return [run_group(model, ps, st) for ps, st in zip(prompt_lists, steps)]


# --- decode workers in lockstep ---------------------------------------------------------------------------
#
# The serving path of a decode replica: every rank a `DecodeWorker` joined to its replica (`join_replica`),
# stepping in lockstep (`DecodeWorker.step`: the step's agreement, the forwards, padding-only or idle ones for
# the rounds a rank has nothing for). Requests arrive at given steps, so ranks have work at different times
# (a rank runs steps with none) and need different buckets (rows and context), and a `solo` request makes a
# second forward in some steps. The reference runs each rank's schedule with the whole model in one process.

WORKER_STEPS = 24
WORKER_TIER = {"block_tokens": 64}  # small blocks: prompts of a few hundred tokens span several context buckets


@dataclasses.dataclass(frozen=True)
class Arrival:
    """A request of the worker schedule: its prompt length, when it is submitted, how many tokens it makes."""

    prompt: int
    step: int
    max_tokens: int
    solo: bool = False


def worker_tier(cfg, spec: int = 0) -> TierConfig:
    from cachetier.geometry import spec_lru_floor

    t = dataclasses.replace(tier(cfg), max_running=4, speculative_tokens=spec, **WORKER_TIER)
    return dataclasses.replace(t, hot_buffer_slots=max(t.hot_buffer_slots, spec_lru_floor(cfg, spec)))


def worker_prompts(vocab: int, schedule: list[list[Arrival]], seed: int) -> list[list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(6, vocab, (a.prompt,), generator=g).tolist() for a in group] for group in schedule]


def run_workers(model, schedule: list[Arrival], prompts: list[list[int]], step_cfg: StepConfig, join=None,
                spec: int = 0) -> dict:
    """One DP group's schedule through a `DecodeWorker` on `model` (whole, or a rank's shard attached to its
    replica: `join()` then runs on every rank at once, before the first step). Greedy; records each
    request's tokens (the prefill's first), and the step runner's mode and buckets. `spec`: draft tokens a step
    (the model then needs its MTP head)."""
    from decode.worker import DecodeRequest, DecodeWorker

    cfg = model.cfg
    store = TieredStore(cfg, worker_tier(cfg, spec), dtype=model.dtype, device=model.device)
    worker = DecodeWorker(model, store, max_running=store.tier.max_running, step_config=step_cfg)
    plans = []  # per step: (the bucket this rank's own forwards need, the agreed plan)
    if join is not None:
        agree = worker.runner.agree

        def recording(groups, *span):
            plan = agree(groups, *span)
            plans.append((worker.runner.need(groups[:1]), plan))
            return plan

        worker.runner.agree = recording
    try:
        if join is not None:
            join(worker)
        with torch.inference_mode():  # every rank prefills at once (a rank without prompts joins the exchanges)
            if prompts:
                logits, layouts = model.prefill_batch([(p, None) for p in prompts], last_only=True)
            else:
                logits, layouts = [], []
                model.idle_forward()
        tokens = {f"q{i}": [int(lg[-1].argmax())] for i, lg in enumerate(logits)}
        arrivals: dict[int, list] = {}
        for i, (a, lay) in enumerate(zip(schedule, layouts)):
            sp = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
            req = DecodeRequest.fresh(f"q{i}", lay, SampledToken(tokens[f"q{i}"][0]), sp, 1000 + i, solo=a.solo)
            arrivals.setdefault(a.step, []).append(req)
        busy = []  # per step: did this rank decode anything
        for step in range(WORKER_STEPS):
            for req in arrivals.pop(step, []):
                worker.submit(req)
            events = worker.step()
            busy.append(len(events) > 0)
            for ev in events:
                tokens[ev.request_id].append(ev.token.token_id)
        worker.check_integrity()
        runner = worker.runner
        return {"tokens": tokens, "mode": runner.mode, "steps_by_bucket": dict(runner.steps_by_bucket), "busy": busy,
                "idle_forwards": runner.idle_forwards, "steps": worker.steps, "left": len(worker.running) + len(worker.waiting),
                "plans": [(need, plan.rounds, plan.first, plan.rest, plan.capture) for need, plan in plans],
                "spans": [plan.span for _, plan in plans], "speculation": worker.stats().get("speculation"),
                "graphs": sorted(runner.graphs), "uncaptured": runner.eager_steps, "pending": list(runner.pending_captures)}
    finally:
        worker.close()


def worker_rank_main(rank: int, layout_text: str, port: int, model_dir: str, out_dir: str, schedule, seed: int,
                     decode_mode: str | list[str], device_kind: str = "cpu", step_kw: dict | None = None, spec: int = 0) -> None:
    """The body of one rank's process for the worker schedule (`torch.multiprocessing.spawn` calls it);
    `decode_mode` per rank when a list; `step_kw`: more `StepConfig` fields."""
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from bench.common import open_rank
    from model.loader import load_model

    layout, device, comm = open_rank(layout_text, rank, port, device_kind, timeout_s=120)
    try:
        model = load_model(model_dir, shard=comm.shard, device=device, mtp=spec > 0).attach(comm)
        dp_rank, _ = layout.coords(rank)
        prompts = worker_prompts(model.cfg.vocab_size, schedule, seed)[dp_rank]

        def join(worker) -> None:
            worker.join_replica()
            comm.stats.reset()

        mode = decode_mode[rank] if isinstance(decode_mode, list) else decode_mode
        result = run_workers(model, schedule[dp_rank], prompts, StepConfig(decode_mode=mode, **(step_kw or {})), join=join,
                             spec=spec)
        result["stats"] = comm.stats.to_dict()
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        comm.close()


def run_worker_replica(layout_text: str, model_dir: str, out_dir: str, schedule, seed: int, decode_mode: str | list[str],
                       device_kind: str = "cpu", step_kw: dict | None = None, spec: int = 0) -> list[dict]:
    import torch.multiprocessing as mp

    from model.parallel import free_port

    layout = ParallelLayout.parse(layout_text)
    mp.spawn(worker_rank_main, args=(layout_text, free_port(), model_dir, out_dir, schedule, seed, decode_mode, device_kind,
                                     step_kw, spec), nprocs=layout.world)
    return [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(layout.world)]


def run_worker_reference(model, schedule, seed: int) -> list[dict]:
    """Each DP group's worker schedule with the whole model in this process, decoding eagerly."""
    prompts = worker_prompts(model.cfg.vocab_size, schedule, seed)
    return [run_workers(model, group, ps, StepConfig(decode_mode="eager")) for group, ps in zip(schedule, prompts)]
