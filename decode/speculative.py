"""Speculative decoding with the MTP head: draft N tokens, verify N + 1 positions in one forward, keep what matches.

One speculative step over a `cachetier.spec_batch.SpecBatch` of `span` = N + 1 rows per request:

1. **verify**: the main model's decode step over every row (`V4Model.decode_forward`): request r's row j is the
   query at position b_r + j whose input is the token it decodes from (j = 0) or draft j. Logits and final
   streams come out per row.
2. **targets**: the token the request would draw at each position, by the one sampler the step always uses
   (greedy argmax, or `model.sampling.sample_tokens` with the row's token index): the token at index i depends only
   on the logits there and (seed, i), so a position whose inputs match spec-off draws what spec-off draws.
3. **accept**: a_r = how many leading drafts equal the target of the position before them. The step's tokens are
   targets 0..a_r: identical to speculation off, greedy or sampled, whatever the drafter proposed (a rejected
   draft costs its position's work, never a token). This is exact-match verification with the sampler's own
   counter-based noise: it keeps the target distribution because it *is* the target sampler, and a seeded
   request gives the same tokens with speculation on or off, after a retry and across the PD split.
4. **commit**: the store writes the state of positions up to b_r + a_r (`SpecBatch.commit`); nothing of a
   rejected position stays.
5. **draft**: the MTP ring's entries of the kept positions are rewritten from the verify's streams, and the head
   drafts the next step's N tokens from position b_r + a_r (`V4Model.draft`), chained, greedily.

All device work with fixed shapes and no host sync: the step compiles (CPU) and captures (CUDA) per
(rows, blocks, span); the host reads back one small int tensor, `[requests, span + 1 + N]`: the targets, a_r,
and the next drafts.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import torch

from cachetier.spec_batch import SpecBatch
from model.model import V4Model
from model.mtp import MTPState


def check_speculation(model, store, runner) -> None:
    """Refuse a worker asked to speculate (its store made with `TierConfig.speculative_tokens` > 0) that cannot:
    a model without an MTP head, a stand-in step, or an eagerly stepping rank of an expert-parallel replica."""
    n = getattr(getattr(store, "geo", None), "spec_tokens", 0)
    if not n:
        return
    if getattr(model, "mtp", None) is None:
        raise ValueError(f"--speculative-tokens {n} drafts with the model's MTP head, and this model has none (its "
                         "checkpoint holds no mtp.* tensors, or it is a stand-in step); serve it with --speculative-tokens 0, "
                         "or add a head with `hisparse train --mtp`")
    if runner is not None and runner.replica and not runner.fixed:
        raise ValueError("speculative decoding on an expert-parallel replica needs its fixed-shape step (the ranks agree "
                         "on each step's bucket and span): serve it with --decode-mode compiled or --speculative-tokens 0")


def verify(model: V4Model, view: SpecBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The verify forward: logits [rows, vocab] and final streams [rows, hc, hidden] of every row of the view."""
    return model.decode_forward(view, view.token_ids, with_streams=True)


def accepted_drafts(view: SpecBatch, targets: torch.Tensor) -> torch.Tensor:
    """[requests] how many leading drafts equal the target of the position before them (targets [requests, span])."""
    R, S = view.requests, view.span
    drafts = view.token_ids.view(R, S)[:, 1:]
    verified = view.verified.view(R, S)[:, 1:]
    match = (drafts == targets[:, :-1]) & verified
    return match.long().cumprod(dim=1).sum(dim=1)


class Drafter(Protocol):
    """What proposes a step's drafts, inside the step: a drafter sees the verify forward's outcome and returns the
    next step's `n` tokens per request. The MTP head (`MTPDrafter`) drafts one token per chained call of its one
    block; a block drafter (DSpark-style: one forward proposing n tokens at once from the target's hidden states)
    plugs in here as another `Drafter` with its own per-request state in the store. Fixed shapes, no host sync:
    it runs inside the compiled / captured step."""

    def propose(self, model: V4Model, view: SpecBatch, targets: torch.Tensor, streams: torch.Tensor,
                accepted: torch.Tensor, n: int) -> torch.Tensor:
        """targets [requests, span] (the tokens kept are 0..accepted), the verify's final streams [rows, hc, hidden],
        accepted [requests] -> drafts [requests, n] for the positions after the last kept token's."""
        ...


class MTPDrafter:
    """The checkpoint's MTP (NextN) head as the drafter (`model.mtp`): its window ring per request lives in the
    request's state group (`Geometry.mtp_slots`); the entries of the kept positions are rewritten from the main
    model's streams, then the block chains `n` greedy proposals from the last kept position."""

    def propose(self, model: V4Model, view: SpecBatch, targets: torch.Tensor, streams: torch.Tensor,
                accepted: torch.Tensor, n: int) -> torch.Tensor:
        R, S = view.requests, view.span
        a = accepted
        mtp = model._mtp()
        ring = view.take_mtp()  # [requests, slots, row]
        state = MTPState(ring, floor=view._first(view.mtp_floor))
        slots = ring.shape[1]
        # the ring entries of the kept positions b..b+a-1 from the main model's streams and the token after each
        keys = mtp.keys(model, streams, targets.flatten(), view.positions).view(R, S, -1)
        rows = torch.arange(R, device=ring.device)
        base = view._first(view.positions)
        for j in range(S - 1):
            slot = torch.remainder(base + j, slots)
            ring[rows, slot] = torch.where((a > j)[:, None], keys[:, j], ring[rows, slot])
        hidden = streams.view(R, S, *streams.shape[1:])[rows, a]
        drafts = model.draft(state, hidden, targets[rows, a], base + a, n)  # writes the entries of b + a and the drafts'
        view.put_mtp(state.ring)
        return drafts


MTP_DRAFTER = MTPDrafter()


def finish(model: V4Model, view: SpecBatch, targets: torch.Tensor, streams: torch.Tensor, n_draft: int,
           drafter: Drafter = MTP_DRAFTER) -> torch.Tensor:
    """Accept, commit and draft (steps 3-5 of the module docstring) -> [requests, span + 1 + n_draft] int64."""
    a = accepted_drafts(view, targets)
    view.commit(a)
    drafts = drafter.propose(model, view, targets, streams, a, n_draft)
    return torch.cat((targets, a[:, None], drafts), dim=1)


def greedy_step(model: V4Model, view: SpecBatch, n_draft: int) -> torch.Tensor:
    """A whole speculative step for greedy requests (what a worker compiles or captures)."""
    logits, streams = verify(model, view)
    targets = logits.view(view.requests, view.span, -1).argmax(dim=-1)
    return finish(model, view, targets, streams, n_draft)


@dataclass
class _Run:
    """A measured run of one draft count in one bucket: its first probes, or a re-measurement (`probe` steps in a
    row)."""

    count: int
    choice: int
    """The count it stands in for: what its loss is counted against."""
    left: int
    """Steps of it still to choose."""
    times: list[float] = field(default_factory=list)
    kept: float = 0.0
    """Tokens a row kept, summed over its steps."""


@dataclass
class _Bucket:
    """What the policy knows of one batch bucket."""

    choice: int = 0
    due: int = 0
    """The policy step from which the next re-measurement may start (nothing is computed before it while the plain
    step is the choice)."""
    times: dict[int, deque] = field(default_factory=dict)
    """The last `window` step times per count."""
    ratios: dict[int, deque] = field(default_factory=dict)
    """Per count > 0, its last `window` paired ratios: its step time over the plain step's, both measured side by
    side in time (a run of one against the other's steps just before it)."""
    ratio: dict[int, float] = field(default_factory=dict)
    """Their medians: a count's cost in plain steps, what every decision reads (0: 1.0)."""
    tried: dict[int, int] = field(default_factory=dict)
    last_tried: dict[int, int] = field(default_factory=dict)
    interval: dict[int, int] = field(default_factory=dict)
    """Steps between re-measurements of a count that is not the choice."""
    run_loss: dict[int, float] = field(default_factory=dict)
    """What a count's last measured run actually lost against the choice, in plain steps."""
    seeds: dict[int, float] = field(default_factory=dict)
    """Per count > 0, its cost in plain steps as timed before serving (`StepRunner.step_costs`): read only while the
    count has no measured ratio, and only to schedule its first probe (`seed`)."""
    born: int | None = None
    """The policy step the bucket first ran at: a seeded count's first probe is spaced from it."""
    run: _Run | None = None


class DraftPolicy:
    """How many tokens to draft each step: the count that maximises expected tokens per second, from the
    acceptance measured so far and the step cost measured per (batch bucket, count), down to 0 (the plain step)
    when verifying costs more than it keeps.

    Expected tokens of a step with n drafts: 1 + sum over k <= n of the product of alpha_1..alpha_k, alpha_k being
    the measured chance that draft k is kept given that the ones before it were. A step's cost is read in plain
    steps of its bucket: the median of its last `window` *paired* ratios, each the median of a run of one count over
    the median of the other's steps just before it. Only side-by-side times are compared, so a stretch where the
    whole machine runs slower (a neighbour's burst, a page-cache flush) moves both and decides nothing; comparing a
    speculative step's fresh time with a plain time measured long before did, both ways.

    Each candidate count is first tried in a run of `probe` steps per batch bucket, the plain step first (so an
    unmeasured count is never assumed cheap), unless its cost timed before serving says it would lose (`seed`). The
    choice changes only when something new is known: after a measured run (a re-measurement gives a fresh ratio),
    or, while speculating, as the acceptance moves (it is learnt every step). A speculative count must be expected
    to give `margin` more than the plain step to be chosen. The counts that could pay (`could_pay`) but are not the
    choice are re-measured in runs of `probe` steps (the first of them only makes drafts: the plain steps before
    made none) once their interval has passed: `explore_every` steps at first, doubling each time one is re-measured
    and is still not chosen after (up to `max_interval`), back to `explore_every` once it is chosen; the plain step
    every `max_interval` steps (`_interval`). Whatever the interval, a re-measurement waits until the time it is
    expected to lose (`explore_loss`, or what its last run here actually lost when that was more) is at most
    `explore_budget` of the choice's time over the steps since the last one: past a bucket's first probes,
    re-measuring never costs served tokens/s more than that share.

    While the plain step is the choice and no re-measurement is due, its steps are *quiet*: up to the last `window`
    before the due step (whose plain times the re-measurement pairs with), `choose` and `record` read and write two
    attributes of the policy and nothing else, and the quiet steps are counted in when the stretch ends (`_settle`).
    On a CPU the step leaves the interpreter's caches cold, so every object the host touches between two steps costs
    a trip to memory: at batch 16, stepped by turns with off, the per-bucket bookkeeping of every step cost about
    11 us of a 4 ms plain step (0.3%), a 0.75 us loop when warm. With `adaptive` off the policy always drafts
    `max_tokens`."""

    def __init__(self, max_tokens: int, adaptive: bool = True, probe: int = 3, explore_every: int = 50,
                 decay: float = 0.99, counts: list[int] | None = None, window: int = 7, max_interval: int = 3200,
                 explore_budget: float = 0.001, margin: float = 0.03, confirm: int = 3) -> None:
        self.max_tokens, self.adaptive = max_tokens, adaptive
        self.explore_budget = explore_budget
        """The share of the choice's time re-measurements may lose: well under the noise of a served figure."""
        self.margin = margin
        """How much more a speculative count must be expected to give than the plain step to be chosen over it: both
        figures are estimates, and a marginal call that is wrong costs served tokens/s."""
        self.confirm = confirm
        """Measured runs a count needs in a bucket before its measured cost alone outweighs a seed that says it pays
        (`_disputed`)."""
        self.counts = sorted(set(counts if counts is not None else range(max_tokens + 1)), reverse=True)
        """The draft counts it chooses among (a compiled CPU step holds one graph per count: `StepRunner.spec_counts`)."""
        self.probe, self.explore_every, self.decay = probe, explore_every, decay
        self.window, self.max_interval = window, max_interval
        self.reached = [1.0] * (max_tokens + 1)  # decayed counts per draft position k (index 1..N)
        self.kept = [0.7] * (max_tokens + 1)
        self.buckets: dict[int, _Bucket] = {}
        self.steps = 0
        self._choices: dict[int, dict[int, int]] = {}
        self._quiet: int | None = None
        """The bucket whose plain steps are quiet now (`record`), or None."""
        self._quiet_until = 0
        """The policy step from which that bucket's steps are full ones again: `window` steps before its due step."""
        self._quiet_steps = 0
        """The quiet stretch's steps so far (counted in by `_settle`)."""

    def alpha(self, k: int) -> float:
        return self.kept[k] / self.reached[k] if self.reached[k] > 0 else 0.0

    def expected_tokens(self, n: int, optimism: float = 0.0) -> float:
        """Tokens a step with n drafts is expected to keep; `optimism` moves each alpha that far towards 1."""
        total, run = 1.0, 1.0
        for k in range(1, n + 1):
            run *= self.alpha(k) + optimism * (1.0 - self.alpha(k))
            total += run
        return total

    def _bucket(self, bucket: int) -> _Bucket:
        b = self.buckets.get(bucket)
        if b is None:
            b = self.buckets[bucket] = _Bucket()
        return b

    @staticmethod
    def _unit(b: _Bucket, n: int) -> float | None:
        """A step of count n in plain steps of its bucket: measured, a seeded count's seed until it is, None for a
        count neither measured nor seeded there."""
        return b.ratio.get(n, b.seeds.get(n)) if n else 1.0

    def _score(self, b: _Bucket, n: int) -> float:
        """What a step of count n gives per plain step of time at its cost in the bucket (`_unit`)."""
        return self._score_at(n, self._unit(b, n))

    def _score_at(self, n: int, cost: float) -> float:
        """What a step of count n that costs `cost` plain steps gives per plain step of time, a speculative count's
        less the `margin` it must beat the plain step (1.0) by."""
        return self.expected_tokens(n) / cost / (1 + self.margin if n else 1)

    def best(self, bucket: int) -> int:
        b = self.buckets[bucket]
        return max((c for c in self.counts if not c or c in b.ratio), key=lambda c: self._score(b, c))

    @property
    def choices(self) -> dict[int, dict[int, int]]:
        """Steps run with each draft count, per batch bucket (what the bench and the worker's stats report); the quiet
        steps so far included. Read only."""
        if not self._quiet_steps:
            return self._choices
        out = {b: dict(c) for b, c in self._choices.items()}
        per = out.setdefault(self._quiet, {})
        per[0] = per.get(0, 0) + self._quiet_steps
        return out

    def choose(self, bucket: int) -> int:
        self.steps += 1
        if bucket == self._quiet:
            if self.steps < self._quiet_until:
                self._quiet_steps += 1
                return 0
            self._settle()
        elif self._quiet is not None:
            self._settle()
        n = self._pick(bucket) if self.adaptive and self.max_tokens else self.max_tokens
        per = self._choices.get(bucket)
        if per is None:
            per = self._choices[bucket] = {}
        per[n] = per.get(n, 0) + 1
        return n

    def _settle(self) -> None:
        """End the quiet stretch: its plain steps join the bucket's counts as if each had been chosen and recorded (their
        times are not kept: no decision reads a plain time older than the last `window`). Called by `choose` for the
        step after the stretch: its steps were the ones just before this one."""
        bucket, k = self._quiet, self._quiet_steps
        self._quiet, self._quiet_steps = None, 0
        if k:
            b = self.buckets[bucket]
            per = self._choices.setdefault(bucket, {})
            per[0] = per.get(0, 0) + k
            b.tried[0] = b.tried.get(0, 0) + k
            b.last_tried[0] = self.steps - 1

    def _pick(self, bucket: int) -> int:
        b = self._bucket(bucket)
        if b.born is None:
            b.born = self.steps
        run = b.run
        if run is not None:
            if run.left > 0:
                run.left -= 1
                return run.count
            self._close(bucket, b)  # its last steps were never recorded (they failed)
        if not b.choice and self.steps < b.due:
            return 0  # settled on the plain step until a re-measurement is due: nothing to compute
        new = next((c for c in reversed(self.counts)
                    if (b.tried.get(c, 0) < self.probe if not c else self._unprobed(b, c))), None)
        if new is not None:  # the first probes, the plain step first (a fresh request's MTP ring is empty anyway)
            return self._start(b, new)
        if b.choice and (best := self.best(bucket)) != b.choice:  # speculating: the acceptance moved
            self._decide(bucket, b, best)
        if self.steps >= b.due:
            due = [c for c in self.could_pay(bucket) if c != b.choice
                   and self.steps - b.last_tried.get(c, b.born) >= self._interval(bucket, c, b.choice)]
            if due:
                n = min(due, key=lambda c: b.last_tried.get(c, b.born))
                b.interval[n] = min(2 * b.interval.get(n, self.explore_every), self.max_interval)
                return self._start(b, n)
            b.due = self._next_due(bucket, b)
        return b.choice

    def _start(self, b: _Bucket, n: int) -> int:
        b.run = _Run(n, b.choice, self.probe - 1)
        return n

    def _decide(self, bucket: int, b: _Bucket, choice: int | None = None) -> None:
        b.choice = self.best(bucket) if choice is None else choice
        b.interval[b.choice] = self.explore_every  # the choice: re-measured promptly once it loses
        b.due = self._next_due(bucket, b)

    def _next_due(self, bucket: int, b: _Bucket) -> int:
        """The step from which a count that could pay is due to be re-measured (an unmeasured, unseeded one at once),
        looked at again within `explore_every` steps at the latest: what could pay follows the acceptance learnt anywhere."""
        due = (0 if self._unprobed(b, c) else b.last_tried.get(c, b.born) + self._interval(bucket, c, b.choice)
               for c in self.could_pay(bucket) if c != b.choice)
        return min(min(due, default=self.steps + self.explore_every), self.steps + self.explore_every)

    def _close(self, bucket: int, b: _Bucket) -> None:
        """A measured run ended: a paired ratio from it (against the plain step's times just before a speculative
        run, against the choice's just before a plain one), what it lost, and the choice made again."""
        run, b.run = b.run, None
        if not run.times:
            return
        n, med = run.count, statistics.median(run.times)
        unit = med
        if n and b.times.get(0):
            unit = statistics.median(b.times[0])
            self._add_ratio(b, n, med / unit)
        elif not n and run.choice and b.times.get(run.choice):
            self._add_ratio(b, run.choice, statistics.median(b.times[run.choice]) / med)
        if n != run.choice and (not run.choice or run.choice in b.ratio) and (not n or n in b.ratio):
            b.run_loss[n] = sum(run.times) / unit - self._choice_time(b, run.choice, run.kept)
        self._decide(bucket, b)

    def _add_ratio(self, b: _Bucket, n: int, ratio: float) -> None:
        r = b.ratios.get(n)
        if r is None:
            r = b.ratios[n] = deque(maxlen=self.window)
        r.append(ratio)
        b.ratio[n] = statistics.median(r)

    def _interval(self, bucket: int, n: int, choice: int) -> int:
        """Steps between re-measurements of count n while `choice` is the choice: `interval` (the plain step's only
        when the choice speculates, and rarely: the acceptance is measured all along, a drop in it switches to plain
        without it, and a plain step restarts every MTP ring), and never fewer than keep the loss within
        `explore_budget` of the choice's time: the expected loss, or what the count's last re-measurement here
        actually lost, when that was more (its first step after plain ones may run cold)."""
        b = self.buckets[bucket]
        steps = self.max_interval if n == 0 else b.interval.get(n, self.explore_every)
        if self._unit(b, n) is None or self._disputed(b, n):
            return steps
        loss = max(self.explore_loss(bucket, n, choice), b.run_loss.get(n, 0.0))
        if loss > 0:
            steps = max(steps, math.ceil(loss / (self.explore_budget * self._unit(b, choice))))
        return steps

    def explore_loss(self, bucket: int, n: int, choice: int) -> float:
        """Plain steps a re-measurement of count n (`probe` steps) is expected to lose against the choice: its steps'
        cost less the time the choice takes for the tokens they are expected to keep (the first step after plain
        ones keeps one token: its rings were empty; after a plain run the choice's first step does). Negative: it
        would gain."""
        b = self.buckets[bucket]
        kept = self.probe * self.expected_tokens(n)
        if choice == 0 and n > 0:
            kept -= self.expected_tokens(n) - 1.0
        loss = self.probe * self._unit(b, n) - self._choice_time(b, choice, kept)
        if n == 0 and choice > 0:
            loss += self._unit(b, choice) - self._choice_time(b, choice, 1.0)
        return loss

    def _choice_time(self, b: _Bucket, choice: int, tokens: float) -> float:
        """Plain steps the choice takes to give a row `tokens` tokens (what a re-measurement's loss is counted
        against)."""
        return tokens * self._unit(b, choice) / self.expected_tokens(choice)

    def could_pay(self, bucket: int) -> list[int]:
        """The counts worth re-measuring: those whose step costs less than the tokens it would keep were each
        draft's acceptance halfway from the measured one to certain (in plain steps; a count not measured yet, by its
        cost timed before serving, if any). A count that costs more is not tried again: past the probes, speculation
        that does not pay costs nothing, and a count timed before serving that could not pay is not even probed."""
        b = self.buckets[bucket]
        return [n for n in self.counts if n == 0 or (cost := self._unit(b, n)) is None
                or cost < self.expected_tokens(n, optimism=0.5) or self._disputed(b, n)]

    def seed(self, bucket: int, n: int, cost: float) -> None:
        """Count n's step in `bucket` costs `cost` plain steps, as timed before serving (`StepRunner.step_costs`). It
        schedules the count's first probe there, which at high batch is the costliest speculative run of all: at
        once if the count would be chosen at that cost (`_pays`); if it could pay only at a higher acceptance
        (`could_pay`), once the bucket has run long enough for the probe's expected loss to fit `explore_budget`, as
        a re-measurement's does; never while it could not pay. Nothing is chosen on a seed alone: the probe's measured
        ratio replaces it in every decision."""
        self._bucket(bucket).seeds[n] = cost

    def _unprobed(self, b: _Bucket, n: int) -> bool:
        """Whether count n > 0 is due for its first probe in the bucket now: never measured there, and not seeded or
        paying at its seed."""
        return n not in b.ratio and (n not in b.seeds or self._pays(b, n))

    def _disputed(self, b: _Bucket, n: int) -> bool:
        """Whether count n's cost timed before serving says it pays and its fewer than `confirm` measured runs say it
        does not. A run is `probe` steps against the plain steps just before it, and the first speculative steps after
        plain ones can run cold; one low run would otherwise keep a paying count off for as long as the exploration
        budget spaces its next run (in the bench, when its workers shared one process, a build of adaptive served
        over a thousand steps at batch 1 without N = 3, which paid 1.25x there). A disputed count is re-measured at
        its plain interval, the budget aside, until it has `confirm` runs whose median decides; where the seed says
        it does not pay, nothing changes."""
        seed = b.seeds.get(n)
        return (seed is not None and 0 < len(b.ratios.get(n, ())) < self.confirm
                and self._score_at(n, seed) > self._score(b, 0) and not self._pays(b, n))

    def _pays(self, b: _Bucket, n: int) -> bool:
        """Whether count n would be chosen over the plain step at its cost (`_unit`) and the acceptance now."""
        return self._score(b, n) > self._score(b, 0)

    def record(self, bucket: int, n: int, seconds: float, verified: list[int] | None = None,
               accepted: list[int] | None = None, kept: float | None = None) -> None:
        """A step with `n` drafts took `seconds`; per request, how many drafts it verified (0 where its acceptance
        is not to be learnt from) and kept; `kept`: the tokens a row that verified drafts kept, on average."""
        if not n and bucket == self._quiet and self.steps < self._quiet_until:
            return
        if verified:
            self._learn(verified, accepted)
        b = self._bucket(bucket)
        times = b.times.get(n)
        if times is None:
            times = b.times[n] = deque(maxlen=self.window)
        times.append(seconds)
        b.tried[n] = b.tried.get(n, 0) + 1
        b.last_tried[n] = self.steps
        run = b.run
        if run is not None and run.count == n:
            run.times.append(seconds)
            run.kept += kept if kept is not None else 1.0
            if len(run.times) == self.probe:
                self._close(bucket, b)
        elif not n and run is None and not b.choice and self.adaptive:
            self._go_quiet(bucket, b)

    def _go_quiet(self, bucket: int, b: _Bucket) -> None:
        """Settled on the plain step until a re-measurement is due: the steps before its last `window` are quiet."""
        if self.steps + 1 < b.due - self.window:
            self._quiet, self._quiet_until = bucket, b.due - self.window

    def _learn(self, verified: list[int], accepted: list[int]) -> None:
        """One step's rows, all at once: per draft position, the rows that looked at it (the drafts before it kept)
        and those that kept it, each row weighing as one decayed observation."""
        for k in range(1, self.max_tokens + 1):
            reached = hits = 0
            for d, a in zip(verified, accepted):
                if d >= k and a >= k - 1:  # draft k was looked at when the k - 1 before it were kept
                    reached += 1
                    hits += a >= k
            if not reached:
                break
            fade = self.decay ** reached
            weight = (1.0 - fade) / (1.0 - self.decay) / reached  # what `reached` rows add, decayed in turn
            self.reached[k] = fade * self.reached[k] + weight * reached
            self.kept[k] = fade * self.kept[k] + weight * hits
