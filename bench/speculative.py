"""Speculative decoding with the MTP head, measured side by side in one run (prints one JSON object).

    python -m bench.speculative [--quick] [--batches 1,4,16] [--tokens 128] [--repeats 3] [--builds 4]
                                [--accept-prompts 8] [--accept-tokens 256]
                                [--miss-prompts 4] [--miss-context 1536] [--miss-tokens 256]
                                [--step compiled|eager] [--compile-backend inductor|eager] [--threads N]

On the trained built-in model with its MTP head, over held-out prompts, greedy, the tier on throughout:

1. acceptance: tokens kept per request-step with N = 1, 2, 3 drafts (adaptive policy off), overall and split at
   the MTP ring's window (the decode side's ring starts empty at admission, so the first `sliding_window` decode
   tokens draft from a partial ring), and the kept rate of each draft position;
2. throughput: decode tokens/s with speculation off, N = 3 fixed and N = 3 adaptive at each batch, through the
   compiled step (`StepConfig(decode_mode="compiled")`; the first run compiles for minutes, later ones read
   Inductor's on-disk cache), beside a twin of the off worker. Each worker runs in a process of its own
   (`WorkerProcess`), as a decode actor does; the four are stepped in lockstep (one step each by turns,
   `lockstep`). Every batch runs `--repeats` rounds on each of `--builds` builds of the four in fresh processes
   (`build_plan`: the orders alternate, swapping the arenas and build places of off and adaptive, and of the twin
   and N = 3 fixed). A round serves `POOL` x batch requests with batch of them in flight. Reported: served
   tokens/s at that concurrency over all rounds (the steps that began with batch requests unfinished, the
   adaptive policy's probes included), the ratio on / off, each build's, the noise (how far the twin lands from
   off, round by round), the draft counts the adaptive policy chose and what its measured runs gave;
   `whole_pool` gives the same over every step, the drain once the pool runs out included;
3. miss rate: the hot buffer's misses per request-step and per generated token at LRU sizes k, 2k, 4k
   (k = index_topk), speculation off and at every N the hot-buffer rule allows
   (`cachetier.geometry.spec_lru_floor`: B >= (N + 1) k);
4. greedy identity: every speculative run's tokens equal the plain run's over the same requests.

`--quick`: a smoke run of a few seconds (tiny sizes, eager step everywhere).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time

import torch

from bench.common import emit, environment, progress
from core.configs import EAGER_STEP, StepConfig, TierConfig, parse_bytes

COMPILED_STEP = StepConfig(decode_mode="compiled")
"""The served step on a CPU: one fixed-shape step per bucket, compiled by Inductor."""


def _model_and_tokenizer():
    from model.builtin import SHIPPED, ensure_builtin
    from model.loader import load_model
    from model.tokenizer import load_tokenizer

    path = ensure_builtin()
    if path != SHIPPED:
        raise SystemExit("no trained built-in model is shipped (model/assets/tiny); run `hisparse train --out model/assets/tiny --mtp`")
    model = load_model(path, mtp=True)
    if model.mtp is None:
        raise SystemExit("the built-in model has no MTP head; train one with `hisparse train --mtp`")
    return model, load_tokenizer(path)


def greedy_requests(model, prompts: list[list[int]], batch: int, max_tokens: int, tag: str = "r") -> list:
    """`batch` prefilled greedy requests over `prompts` (cycled), each generating `max_tokens` tokens (no early stop)."""
    from core.types import SampledToken, SamplingParams
    from decode.worker import DecodeRequest

    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    layouts = {}
    out = []
    for i in range(batch):
        j = i % len(prompts)
        if j not in layouts:
            logits, lay = model.prefill(prompts[j], last_only=True)
            layouts[j] = (int(logits[-1].argmax()), lay)
        first, lay = layouts[j]
        out.append(DecodeRequest.fresh(f"{tag}{i}", lay, SampledToken(first), sp, seed=i))
    return out


def make_worker(model, draft_tokens: int, step: StepConfig, budget: int, max_running: int, lru: int | None = None,
                adaptive: bool = False):
    """A decode worker over a tiered store (tier on) that drafts up to `draft_tokens` (0: no speculation)."""
    from cachetier.store import TieredStore
    from decode.worker import DecodeWorker

    tier = TierConfig(offload=True, speculative_tokens=draft_tokens, hot_buffer_slots=lru, device_budget_bytes=budget,
                      host_pool_bytes=4 * budget, max_running=max_running)
    store = TieredStore(model.cfg, tier, dtype=model.dtype)
    step = dataclasses.replace(step, speculative_adaptive=adaptive)
    # the idle integrity check would land in the last timed step of every run
    return DecodeWorker(model, store, max_running=max_running, step_config=step, check_when_idle=False)


class SpecLog:
    """Wraps a worker's `runner.run_spec`: records, per speculative step, each request's verified drafts and how
    many of them it kept (the step's own read back), for the per-position kept rates."""

    def __init__(self, worker) -> None:
        self.verified: list[int] = []
        self.kept: list[int] = []
        inner = worker.runner.run_spec

        def run_spec(request_ids, tokens, drafts, span, *args, **kwargs):
            rows = inner(request_ids, tokens, drafts, span, *args, **kwargs)
            self.verified.extend(drafts)
            self.kept.extend(row[span] for row in rows)
            return rows

        worker.runner.run_spec = run_spec

    def kept_rates(self, n: int) -> dict[str, float | None]:
        """Per draft position k: of the request-steps that verified draft k with drafts 1..k-1 kept, the share
        that kept it too."""
        out = {}
        for k in range(1, n + 1):
            reached = sum(1 for d, a in zip(self.verified, self.kept) if d >= k and a >= k - 1)
            kept = sum(1 for d, a in zip(self.verified, self.kept) if d >= k and a >= k)
            out[str(k)] = round(kept / reached, 4) if reached else None
        return out


@dataclasses.dataclass
class Run:
    tokens: dict[str, list[int]]
    """Each request's generated token ids, in order (the prefill's first token not included)."""
    request_steps: list[tuple[int, int]]
    """(decode tokens the request had before the step, tokens it kept in the step), one per request and step."""
    steps: int
    seconds: float
    """Wall time of the steps after the warm-up ones."""
    timed_tokens: int
    counters_after_warmup: dict
    warm_request_steps: int
    """Request-steps and tokens of the steps before the miss counters' snapshot (left out of the steady figures)."""
    warm_tokens: int
    steady_tokens: int = 0
    steady_seconds: float = 0.0
    """Tokens and seconds of the timed steps that began with the full concurrency in flight (`lockstep`'s
    `in_flight`): served throughput at that concurrency, without the drain once the requests run out."""


def drive(worker, requests: list, warmup_steps: int = 0, warmup_tokens: int = 0) -> Run:
    """Submit copies of `requests`, step until they all finish. Times the steps after the first `warmup_steps`,
    and snapshots the tier's counters once every request has `warmup_tokens` decode tokens."""
    lane = LocalLane(worker, requests)
    for r in requests:
        lane.give(r.request_id)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    request_steps: list[tuple[int, int]] = []
    steps, seconds, timed = 0, 0.0, 0
    snapshot, warm_rs, warm_tok = None, 0, 0
    while lane.has_work():
        dt, events, running = lane.timed_step()
        if steps == 0:
            _check_admitted(running, events, len(requests))
        kept: dict[str, int] = {}
        for rid, _, _ in events:
            kept[rid] = kept.get(rid, 0) + 1
        for rid, n in kept.items():
            request_steps.append((len(tokens[rid]), n))
        for rid, token, _ in events:
            tokens[rid].append(token)
        steps += 1
        if steps > warmup_steps:
            seconds += dt
            timed += len(events)
        if snapshot is None and min(len(t) for t in tokens.values()) >= warmup_tokens:
            snapshot = dict(worker.store.counter_totals())
            warm_rs, warm_tok = len(request_steps), sum(len(t) for t in tokens.values())
    return Run(tokens, request_steps, steps, seconds, timed, snapshot or dict(worker.store.counter_totals()), warm_rs, warm_tok)


def _mean_kept(request_steps: list[tuple[int, int]]) -> dict:
    n = len(request_steps)
    return {"request_steps": n, "acceptance_length": round(sum(k for _, k in request_steps) / n, 4) if n else None}


# --- 1. acceptance ---------------------------------------------------------------------------------


def acceptance(model, prompts: list[list[int]], tokens: int, budget: int, step: StepConfig) -> dict:
    window = model.cfg.sliding_window
    reqs = greedy_requests(model, prompts, len(prompts), tokens, "a")
    progress(f"acceptance: {len(reqs)} requests x {tokens} tokens, speculation off")
    w = make_worker(model, 0, step, budget, len(reqs))
    plain = drive(w, reqs)
    w.close()
    out = {"requests": len(reqs), "prompt_tokens": len(prompts[0]), "tokens_per_request": tokens, "step": step.decode_mode,
           "sliding_window": window, "by_draft_tokens": {}, "identical_to_off": {}}
    for n in (1, 2, 3):
        w = make_worker(model, n, step, budget, len(reqs))
        log = SpecLog(w)
        run = drive(w, reqs)
        spec = w.stats()["speculation"]
        w.close()
        row = {"steps": run.steps, "steps_off": plain.steps, **_mean_kept(run.request_steps),
               "worker_acceptance_length": spec["acceptance_length"],
               f"first_{window}_decode_tokens": _mean_kept([rs for rs in run.request_steps if rs[0] < window]),
               f"after_{window}_decode_tokens": _mean_kept([rs for rs in run.request_steps if rs[0] >= window]),
               "kept_rate_per_draft_position": log.kept_rates(n)}
        out["by_draft_tokens"][str(n)] = row
        out["identical_to_off"][str(n)] = run.tokens == plain.tokens
        progress(f"acceptance with N={n}: {row['acceptance_length']} tokens per request-step "
                 f"({run.steps} steps against {plain.steps}), identical: {out['identical_to_off'][str(n)]}")
    return out


# --- 2. throughput ---------------------------------------------------------------------------------


def _choices_since(before: dict[int, dict[int, int]], after: dict[int, dict[int, int]]) -> dict[str, dict[str, int]]:
    """Draft counts chosen per batch bucket between two snapshots of `DraftPolicy.choices`."""
    out = {}
    for bucket, per in sorted(after.items()):
        diff = {str(n): c - before.get(bucket, {}).get(n, 0) for n, c in sorted(per.items())}
        diff = {n: c for n, c in diff.items() if c}
        if diff:
            out[str(bucket)] = diff
    return out


THROUGHPUT_WORKERS = (("off", 0, False), ("off_twin", 0, False), ("on_n3", 3, False), ("on_adaptive", 3, True))
"""The throughput run's workers: (name, draft tokens, adaptive). `off_twin` is a second, identical plain worker:
how far its tokens/s lands from off's is the noise a ratio is read against."""


POOL = 4
"""The throughput run at batch B serves POOL x B requests, B at a time (the next one starts as one finishes): a
steady concurrency of B. A batch that only drains would end in a tail of a few rows whenever speculation makes the
requests finish at different steps, a cost no server with a queue pays."""


def own_code_budget(budget: int, index: int) -> int:
    """The device budget of the `index`-th worker of a lockstep run: `index` MiB over `budget`, so that its arena, a
    constant of its compiled step, differs from every other worker's and Inductor builds it machine code of its own
    (identical workers would share one compiled module, and the one that steps right after its twin would find its
    instructions cached). Nothing else about the worker changes."""
    return budget + (index << 20)


Event = tuple[str, int, bool]
"""A step's token for one request: (request id, token id, whether the request finished with it)."""


class LocalLane:
    """A worker of this process as a `lockstep` lane: `requests` by id, each given as a copy (the worker writes
    into its layout), each step timed around `DecodeWorker.step`."""

    def __init__(self, worker, requests: list) -> None:
        self.worker = worker
        self.requests = {r.request_id: r for r in requests}

    def give(self, request_id: str) -> None:
        r = self.requests[request_id]
        self.worker.submit(dataclasses.replace(r, layout=r.layout.clone()))

    def has_work(self) -> bool:
        return self.worker.has_work()

    def timed_step(self) -> tuple[float, list[Event], int]:
        """One step: (its seconds, its tokens, the requests running after it)."""
        t0 = time.perf_counter()
        events = self.worker.step()
        dt = time.perf_counter() - t0
        return dt, [(ev.request_id, ev.token.token_id, bool(ev.finish_reason)) for ev in events], len(self.worker.running)


def _check_admitted(running: int, events: list[Event], wanted: int) -> None:
    """After a worker's first step: every one of the `wanted` requests it was given is running or finished in it."""
    if running + sum(1 for _, _, end in events if end) < wanted:
        raise SystemExit(f"only {running} of {wanted} requests were admitted: raise --budget")


def _lane_state(worker, build_s: float | None = None) -> dict:
    """What the throughput run reads of a worker in its own process: its step's stats, its speculation counters,
    and the adaptive policy's choices, seeds and measured costs per bucket."""
    out = {"step": dataclasses.asdict(worker.runner.stats()), "spec_tokens": worker.spec_tokens,
           "spec_kept": worker.spec_kept, "spec_rows": worker.spec_rows}
    if build_s is not None:
        out["build_s"] = build_s
    policy = worker.policy
    if policy is not None and policy.adaptive:
        out["choices"] = {b: dict(c) for b, c in policy.choices.items()}
        out["seeded_costs"] = {str(b): {str(n): round(c, 3) for n, c in known.seeds.items()}
                               for b, known in policy.buckets.items()}
        # per bucket: the count it serves with, and each count's measured runs (paired ratios, oldest first): what
        # its choices followed
        out["measured"] = {str(b): {"choice": known.choice,
                                    "ratios": {str(n): [round(r, 3) for r in rs] for n, rs in sorted(known.ratios.items())},
                                    "steps": {str(n): c for n, c in sorted(known.tried.items())}}
                           for b, known in sorted(policy.buckets.items())}
    return out


def _lane_main(conn, spec: dict) -> None:
    """A `WorkerProcess`'s process: load the trained model, build the worker, then answer the parent's calls
    (`requests`, `give`, `step`, `state`, `close`) until it closes; an error goes back as its traceback."""
    import traceback

    try:
        if spec["threads"]:
            torch.set_num_threads(spec["threads"])
        t0 = time.perf_counter()
        model, _ = _model_and_tokenizer()
        worker = make_worker(model, spec["draft_tokens"], spec["step"], spec["budget"], spec["max_running"],
                             adaptive=spec["adaptive"])
        conn.send(("ok", _lane_state(worker, time.perf_counter() - t0)))
        lane = None
        while True:
            call, *args = conn.recv()
            if call == "requests":
                requests = greedy_requests(model, *args)
                lane = LocalLane(worker, requests)
                conn.send(("ok", [r.request_id for r in requests]))
            elif call == "give":
                lane.give(args[0])
                conn.send(("ok", None))
            elif call == "step":
                dt, events, running = lane.timed_step()
                conn.send(("ok", (dt, events, running, worker.has_work())))
            elif call == "state":
                conn.send(("ok", _lane_state(worker)))
            elif call == "close":
                worker.close()
                conn.send(("ok", None))
                return
    except BaseException:
        conn.send(("error", traceback.format_exc()))


class WorkerProcess:
    """A bench worker (`make_worker` over the trained model) in a process of its own, as a decode actor holds
    one, and a `lockstep` lane stepped from this process through a pipe, each step timed where it runs. Workers
    sharing one process ran at speeds set by their places in it: at batch 16, five identical plain workers in one
    process ran up to 1.1% apart, and in three runs of workers that ran only plain steps the first one built was the
    fastest, with two different arenas. Here every worker is the only one of its process."""

    def __init__(self, ctx, name: str, **spec) -> None:
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_lane_main, args=(child, spec), daemon=True, name=f"bench-{name}")
        self.proc.start()
        child.close()
        self._work = False
        self._built: dict | None = None

    def _call(self, *message):
        if message:
            self.conn.send(message)
        try:
            kind, value = self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise SystemExit(f"the {self.name} worker's process ended (exit code {self.proc.exitcode})") from None
        if kind == "error":
            raise SystemExit(f"the {self.name} worker failed in its process:\n{value}")
        return value

    def ready(self) -> dict:
        """Wait for the worker's build: its `_lane_state` then, `build_s` included."""
        if self._built is None:
            self._built = self._call()
        return self._built

    def requests(self, prompts: list[list[int]], count: int, tokens: int, tag: str) -> list[str]:
        """Prefill `count` greedy requests there (`greedy_requests`) for the next run: their ids."""
        return self._call("requests", prompts, count, tokens, tag)

    def give(self, request_id: str) -> None:
        self._call("give", request_id)
        self._work = True

    def has_work(self) -> bool:
        return self._work

    def timed_step(self) -> tuple[float, list[Event], int]:
        dt, events, running, self._work = self._call("step")
        return dt, events, running

    def state(self) -> dict:
        return self._call("state")

    def close(self) -> None:
        """Close the worker and end its process (killed if it does not end within a minute); a process that
        already failed or ended is only reaped."""
        try:
            if self.proc.is_alive():
                self.conn.send(("close",))
                self.conn.recv()
        except (OSError, EOFError):
            pass
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def lockstep(lanes: dict, request_ids: list[str], warmup_steps: int, in_flight: int | None = None) -> dict[str, Run]:
    """Give every lane (`LocalLane`, `WorkerProcess`) the requests `request_ids` and step the lanes by turns, one
    step each in a round, until all finish: the workers share whatever else the machine does step by step, so their
    ratio is not moved by drift between whole runs. The order is drawn afresh every round (seeded; no worker steps
    twice in a row), so each worker follows every other equally often: a step runs faster right after one that ran
    the same machine code (its instructions still cached), and with a fixed cyclic order the worker that always
    followed its own twin gained 1-2% over the rest (give each worker code of its own too: `own_code_budget`).
    `in_flight`: each worker is given that many at first and the next one as each finishes, so it serves a steady
    concurrency rather than a batch that drains (None: all at once). Each worker's time and tokens leave out its
    first `warmup_steps` steps; its steady figures, those of the steps that began with `in_flight` requests
    unfinished: once the requests run out, a worker whose rows finished at different steps (speculation keeps
    different token counts per row) drains through steps of fewer rows at the same bucket's cost, which an open
    workload, whose next request is always waiting, never pays."""
    names = list(lanes)
    first = len(request_ids) if in_flight is None else min(in_flight, len(request_ids))
    given = {n: 0 for n in names}
    done = {n: 0 for n in names}
    steady = {n: [0, 0.0] for n in names}

    def give(n: str, count: int) -> None:
        for rid in request_ids[given[n] : given[n] + count]:
            lanes[n].give(rid)
        given[n] = min(len(request_ids), given[n] + count)

    for n in names:
        give(n, first)
    tokens = {n: {rid: [] for rid in request_ids} for n in names}
    steps, seconds, timed = ({n: 0 for n in names}, {n: 0.0 for n in names}, {n: 0 for n in names})
    draw = random.Random(0)
    order = list(names)
    while any(lane.has_work() for lane in lanes.values()):
        last = order[-1]
        while True:
            draw.shuffle(order)
            if len(order) == 1 or order[0] != last:
                break
        for n in order:
            lane = lanes[n]
            if not lane.has_work():
                continue
            dt, events, running = lane.timed_step()
            finished = sum(1 for _, _, end in events if end)
            if steps[n] == 0:
                _check_admitted(running, events, first)
            for rid, token, _ in events:
                tokens[n][rid].append(token)
            steps[n] += 1
            if steps[n] > warmup_steps:
                seconds[n] += dt
                timed[n] += len(events)
                if given[n] - done[n] >= first:
                    steady[n][0] += len(events)
                    steady[n][1] += dt
            done[n] += finished
            if finished:
                give(n, finished)
    return {n: Run(tokens[n], [], steps[n], seconds[n], timed[n], {}, 0, 0, *steady[n]) for n in names}


def twin_noise(twin: list[float], base: list[float]) -> tuple[list[float], float]:
    """Round by round, a twin worker's figure over its base's (the same worker twice), and the largest distance of
    those ratios from 1: the noise a ratio between two different workers in the same rounds is read against."""
    ratios = [a / b for a, b in zip(twin, base)]
    return ratios, max(abs(1 - r) for r in ratios)


BUILDS = {"off_built_first": [(name, i) for i, (name, _, _) in enumerate(THROUGHPUT_WORKERS)],
          "off_built_last": [(name, len(THROUGHPUT_WORKERS) - 1 - i)
                             for i, (name, _, _) in reversed(list(enumerate(THROUGHPUT_WORKERS)))]}
"""The two orders the throughput run builds its four workers in, each worker with the `own_code_budget` index given
(the second reverses the first's order and its indices): over the two, off and adaptive swap arenas (and the twin
and N = 3 fixed theirs) and build places (`build_plan`)."""


def build_plan(count: int) -> list[tuple[str, list[tuple[str, int]]]]:
    """`count` builds of the four workers, alternating the `BUILDS` orders, each labelled by its order (and, from
    the second time an order comes round, its round). Every build starts fresh processes (`WorkerProcess`), and
    `--repeats` rounds of every batch run on each. A worker's process sets where its memory lands, and that moves
    its speed for as long as the process lives: off's twin, in a process of its own, ran up to 2% from off in a
    round, and which of the two was faster changed from one run to the next. More builds average more placements;
    the twin's distance from off (the noise) carries the same spread."""
    orders = list(BUILDS.items())
    plan = []
    for i in range(count):
        label, order = orders[i % len(orders)]
        plan.append((label if i < len(orders) else f"{label}_{i // len(orders) + 1}", order))
    return plan


def _against_off(served: dict[str, float]) -> dict:
    """Each worker's tokens/s and every other worker's ratio to off's (the figures of a batch, a build, a pool)."""
    return {**{f"tokens_per_s_{name}": round(v, 1) for name, v in served.items()},
            **{f"ratio_{name}_off": round(v / served["off"], 3) for name, v in served.items() if name != "off"}}


def throughput(prompts: list[list[int]], batches: list[int], tokens: int, repeats: int, warmup_steps: int,
               budget: int, step: StepConfig, threads: int | None, builds: int = 2) -> dict:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    cap = max(batches)
    spec = {name: (n, adaptive) for name, n, adaptive in THROUGHPUT_WORKERS}
    out = {"step": step.decode_mode, "compile_backend": step.compile_backend if step.decode_mode == "compiled" else None,
           "tokens_per_request": tokens, "repeats_per_build": repeats,
           "builds": {label: [f"{name} (arena {index})" for name, index in order] for label, order in build_plan(builds)},
           "workers_in": "a process each (WorkerProcess), stepped by turns from the bench's process",
           "warmup_steps_left_out": warmup_steps, "requests_per_batch_run": f"{POOL} x batch, batch at a time",
           "prompt_tokens": len(prompts[0]), "workers": {}, "by_batch": {}}
    names = list(spec)
    # per batch, over every build: each round's tokens/s, steady and whole-pool totals, steps, the adaptive choices
    rates = {b: {name: [] for name in names} for b in batches}
    totals = {b: {name: [0, 0.0] for name in names} for b in batches}
    whole = {b: {name: [0, 0.0] for name in names} for b in batches}
    steps = {b: {name: [] for name in names} for b in batches}
    choices = {b: {} for b in batches}
    per_order = {b: {} for b in batches}
    kept = {name: [0, 0] for name in names}  # tokens kept, request-steps that speculated
    identical = True
    for label, order in build_plan(builds):
        progress(f"throughput ({label}): starting the workers' processes ({step.decode_mode} step"
                 + ("; compiling, minutes from an empty Inductor cache" if step.decode_mode == "compiled" else "") + ")")
        lanes = {}
        try:
            # one at a time where a worker times its steps' costs as it is built (the seeds of a fixed-shape step)
            at_once = step.decode_mode == "eager"
            for name, index in order:
                lanes[name] = WorkerProcess(ctx, name, draft_tokens=spec[name][0], adaptive=spec[name][1], step=step,
                                            budget=own_code_budget(budget, index), max_running=cap, threads=threads)
                if not at_once:
                    lanes[name].ready()
            for name, lane in lanes.items():
                st = lane.ready()
                progress(f"  {name} ready in {st['build_s']:.1f} s ({st['step']['compiles']} compiles, "
                         f"{st['step']['compile_s']:.1f} s compiling)")
                w_out = out["workers"].setdefault(name, {"mode": st["step"]["mode"], "compiles": st["step"]["compiles"],
                                                         "compile_s": {}, "eager_steps": 0})
                w_out["compile_s"][label] = round(st["step"]["compile_s"], 2)
                if "seeded_costs" in st:  # what the adaptive policy's first probe per bucket follows (`DraftPolicy.seed`)
                    w_out.setdefault("seeded_costs", {})[label] = st["seeded_costs"]
            for batch in batches:
                ids = {name: lane.requests(prompts, POOL * batch, tokens, f"b{batch}-") for name, lane in lanes.items()}
                here = {name: [0, 0.0] for name in names}
                before = lanes["on_adaptive"].state()["choices"]
                for rep in range(repeats):
                    runs = lockstep(lanes, ids["off"], warmup_steps, in_flight=batch)
                    for name, run in runs.items():
                        rates[batch][name].append(run.steady_tokens / run.steady_seconds)
                        for acc in (totals[batch][name], here[name]):
                            acc[0] += run.steady_tokens
                            acc[1] += run.steady_seconds
                        whole[batch][name][0] += run.timed_tokens
                        whole[batch][name][1] += run.seconds
                        steps[batch][name].append(run.steps)
                        if run.tokens != runs["off"].tokens:
                            identical = False
                            progress(f"  batch {batch} {name} ({label}) repeat {rep + 1}: tokens differ from speculation off")
                    progress(f"throughput ({label}) batch {batch} repeat {rep + 1}/{repeats}: "
                             + ", ".join(f"{k} {v[-1]:.0f} tok/s" for k, v in rates[batch].items()))
                for bucket, counts in _choices_since(before, lanes["on_adaptive"].state()["choices"]).items():
                    into = choices[batch].setdefault(bucket, {})
                    for n, c in counts.items():
                        into[n] = into.get(n, 0) + c
                per_order[batch][label] = _against_off({name: tok / sec for name, (tok, sec) in here.items()})
            for name, lane in lanes.items():
                st = lane.state()
                # steps that left the compiled step for the eager one (a bucket it did not cover): 0 means every
                # timed step was compiled
                out["workers"][name]["eager_steps"] += st["step"]["eager_steps"]
                if st["spec_tokens"]:
                    kept[name][0] += st["spec_kept"]
                    kept[name][1] += st["spec_rows"]
                if "measured" in st:
                    out["workers"][name].setdefault("measured", {})[label] = st["measured"]
        finally:
            for lane in lanes.values():
                lane.close()
    for name, (k, rows) in kept.items():
        if rows:
            out["workers"][name]["acceptance_length"] = round(k / rows, 4)
    for batch in batches:
        # served tokens/s at this concurrency over every round of every build (the adaptive policy's probes and
        # re-measurements included), and over the whole pool, its drain included
        served = {name: tok / sec for name, (tok, sec) in totals[batch].items()}
        pool = {name: tok / sec for name, (tok, sec) in whole[batch].items()}
        r = rates[batch]
        twin, noise = twin_noise(r["off_twin"], r["off"])
        out["by_batch"][str(batch)] = {
            **_against_off(served),
            "noise": round(noise, 3),
            "adaptive_within_noise_of_off": served["on_adaptive"] / served["off"] >= 1 - noise,
            "by_build_order": per_order[batch],
            "ratio_on_adaptive_off_by_repeat": [round(a / b, 3) for a, b in zip(r["on_adaptive"], r["off"])],
            "ratio_off_twin_off_by_repeat": [round(x, 3) for x in twin],
            "steps_per_run": {name: statistics.median(v) for name, v in steps[batch].items()},
            "tokens_per_s_all_repeats": {name: [round(x, 1) for x in v] for name, v in r.items()},
            "adaptive_draft_choices": choices[batch],
            "whole_pool": _against_off(pool),
        }
    out["identical_to_off"] = identical
    return out


# --- 3. miss rate ----------------------------------------------------------------------------------


def _misses(counters: dict, base: dict | None, request_steps: int, tokens: int) -> dict:
    base = base or {"hits": 0, "misses": 0}
    misses = counters["misses"] - base["misses"]
    hits = counters["hits"] - base["hits"]
    return {"misses": misses, "hits": hits, "request_steps": request_steps, "tokens": tokens,
            "misses_per_request_step": round(misses / request_steps, 4) if request_steps else None,
            "misses_per_token": round(misses / tokens, 4) if tokens else None}


def miss_rate(model, prompts: list[list[int]], tokens: int, warmup_tokens: int, budget: int, step: StepConfig) -> dict:
    from cachetier.geometry import spec_lru_floor

    k = model.cfg.index_topk
    reqs = greedy_requests(model, prompts, len(prompts), tokens, "m")
    out = {"index_topk": k, "requests": len(reqs), "prompt_tokens": len(prompts[0]), "tokens_per_request": tokens,
           "step": step.decode_mode, "steady_after_decode_tokens": warmup_tokens, "by_hot_buffer": {}, "identical_to_off": True}
    ref = None
    for name, lru in (("k", k), ("2k", 2 * k), ("4k", 4 * k)):
        row = {"hot_buffer_slots": lru}
        for n in (0, 1, 2, 3):
            key = "off" if n == 0 else f"on_n{n}"
            if lru < spec_lru_floor(model.cfg, n):
                row[key] = f"not allowed: the hot buffer needs (N + 1) x index_topk = {spec_lru_floor(model.cfg, n)} slots"
                continue
            w = make_worker(model, n, step, budget, len(reqs), lru=lru)
            run = drive(w, reqs, warmup_tokens=warmup_tokens)
            total = w.store.counter_totals()
            w.close()
            all_tokens = sum(len(t) for t in run.tokens.values())
            row[key] = {"steps": run.steps,
                        "whole_run": _misses(total, None, len(run.request_steps), all_tokens),
                        "steady": _misses(total, run.counters_after_warmup, len(run.request_steps) - run.warm_request_steps,
                                          all_tokens - run.warm_tokens)}
            if ref is None:
                ref = run.tokens
            same = run.tokens == ref
            out["identical_to_off"] = out["identical_to_off"] and same
            progress(f"miss rate B={name} ({lru} slots) {key}: {row[key]['steady']['misses_per_request_step']} misses per "
                     f"request-step, {row[key]['steady']['misses_per_token']} per token (steady), identical: {same}")
        out["by_hot_buffer"][name] = row
    return out


# --- the run ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes and the eager step: a smoke run")
    ap.add_argument("--batches", default=None, help="throughput batches (default 1,4,16; quick 1,2)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per request in the throughput runs (default 128)")
    ap.add_argument("--repeats", type=int, default=None, help="lockstep rounds of the four workers per batch and build (default 3)")
    ap.add_argument("--builds", type=int, default=None,
                    help="builds of the four workers in fresh processes, alternating two orders (default 4; quick 2)")
    ap.add_argument("--warmup-steps", type=int, default=None, help="steps of each throughput run left out of its time")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="prompt length of the acceptance and throughput runs")
    ap.add_argument("--accept-prompts", type=int, default=None)
    ap.add_argument("--accept-tokens", type=int, default=None)
    ap.add_argument("--miss-prompts", type=int, default=None)
    ap.add_argument("--miss-context", type=int, default=None, help="prompt length of the miss-rate runs (>> 4 x index_topk)")
    ap.add_argument("--miss-tokens", type=int, default=None)
    ap.add_argument("--miss-warmup-tokens", type=int, default=None, help="decode tokens left out of the steady miss figures")
    ap.add_argument("--step", choices=["compiled", "eager"], default=None, help="throughput step (default compiled; quick eager)")
    ap.add_argument("--compile-backend", choices=["inductor", "eager"], default="inductor",
                    help="compiled step: inductor (served; minutes to compile cold) or eager (capture only: checks the path in seconds)")
    ap.add_argument("--budget", default="64MiB", help="device budget of every worker's store")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    a = ap.parse_args(argv)
    q = a.quick

    def pick(value, full, quick):
        return value if value is not None else (quick if q else full)

    batches = [int(x) for x in pick(a.batches, "1,4,16", "1,2").split(",")]
    budget = parse_bytes(a.budget)
    if a.threads:
        torch.set_num_threads(a.threads)
    through_step = {"compiled": dataclasses.replace(COMPILED_STEP, compile_backend=a.compile_backend),
                    "eager": EAGER_STEP}[pick(a.step, "compiled", "eager")]
    from bench.trained import held_out_prompts

    model, tok = _model_and_tokenizer()
    prompt_len = pick(a.prompt_tokens, 256, 48)
    out = {"bench": "speculative", "env": environment(), "model": "built-in (trained), MTP head loaded", "quick": q}
    out["notes"] = [
        "greedy throughout; tier on (offload) in every run; acceptance length = tokens kept per request-step, the "
        "worker's own definition (request-steps whose row verified fewer drafts, e.g. a request's first step with no "
        "drafts yet or its last ones near max_tokens, count too)",
        f"the decode side's MTP ring starts empty at admission: the first sliding_window ({model.cfg.sliding_window}) "
        "decode tokens of a request draft from a partial ring, hence the acceptance split at that point",
        "acceptance and miss-rate runs use the eager step (the tokens do not depend on the step mode); throughput uses "
        f"the {through_step.decode_mode} step",
        "CPU figures: the tiny model's step is overhead-bound, so verifying N + 1 positions costs little more than one",
        "miss counters sum both CSA layers; a resolve counts each distinct missing entry once per request-step, and "
        "hits count every selected id (duplicates across a step's verified positions included)",
    ]
    a_prompts = [ids for _, ids in held_out_prompts(tok, pick(a.accept_prompts, 8, 2), prompt_len)]
    out["acceptance"] = acceptance(model, a_prompts, pick(a.accept_tokens, 256, 40), budget, EAGER_STEP)

    t_prompts = [ids for _, ids in held_out_prompts(tok, max(batches), prompt_len)]
    out["throughput"] = throughput(t_prompts, batches, pick(a.tokens, 128, 16), pick(a.repeats, 3, 1),
                                   pick(a.warmup_steps, 4, 1), budget, through_step,
                                   a.threads or torch.get_num_threads(), pick(a.builds, 4, 2))

    m_prompts = [ids for _, ids in held_out_prompts(tok, pick(a.miss_prompts, 4, 2), pick(a.miss_context, 1536, 160))]
    out["miss_rate"] = miss_rate(model, m_prompts, pick(a.miss_tokens, 256, 24), pick(a.miss_warmup_tokens, 32, 8), budget,
                                 EAGER_STEP)

    out["greedy_identical"] = (all(out["acceptance"]["identical_to_off"].values()) and out["throughput"]["identical_to_off"]
                               and out["miss_rate"]["identical_to_off"])
    emit(out)
    if not out["greedy_identical"]:
        raise SystemExit("speculative decoding changed greedy tokens (see the identical_to_off fields)")


if __name__ == "__main__":
    main()
