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


class DraftPolicy:
    """How many tokens to draft each step: the count that maximises expected tokens per second, from the
    acceptance measured so far and the step time measured per (batch bucket, draft count), down to 0 (the plain
    step) when verifying costs more than it keeps.

    Expected tokens of a step with n drafts: 1 + sum over k <= n of the product of alpha_1..alpha_k, alpha_k being
    the measured chance that draft k is kept given that the ones before it were. A step's cost is the median of
    its count's last `window` timings in that bucket (one slow sample, a page fault or a neighbour's burst, does
    not decide). A speculative count is chosen over the plain step only when expected to give `margin` more. Each
    candidate count is first tried `probe` times per batch bucket, the plain step first (so an unmeasured count is
    never assumed cheap). Afterwards the counts that could pay (`could_pay`) but are not the
    choice are re-measured, `probe` steps in a row (the first of them only makes drafts: the plain steps before
    made none), once their interval has passed: `explore_every` steps at first, doubling each time one is
    re-measured and is still not chosen after (up to `max_interval`), back to `explore_every` once it is chosen;
    the plain step every `max_interval` steps (`_interval`). So a choice follows a change of load or text, while a
    count that keeps losing costs less and less, and one that cannot pay is never run again. Whatever the interval,
    a re-measurement waits until the time it is expected to lose (`explore_loss`: its steps' cost less the time the
    choice would take for the tokens they keep) is at most `explore_budget` of the choice's time over the steps
    since the last one: past a bucket's first probes, re-measuring never costs served tokens/s more than that share
    (1% by default). With `adaptive` off the policy always drafts `max_tokens`."""

    def __init__(self, max_tokens: int, adaptive: bool = True, probe: int = 3, explore_every: int = 50,
                 decay: float = 0.99, counts: list[int] | None = None, window: int = 7, max_interval: int = 3200,
                 explore_budget: float = 0.01, margin: float = 0.03) -> None:
        self.max_tokens, self.adaptive = max_tokens, adaptive
        self.explore_budget = explore_budget
        self.margin = margin
        """How much more a speculative count must be expected to give than the plain step to be chosen over it: both
        figures are estimates, and a marginal call that is wrong costs served tokens/s."""
        self.counts = sorted(set(counts if counts is not None else range(max_tokens + 1)), reverse=True)
        """The draft counts it chooses among (a compiled CPU step holds one graph per count: `StepRunner.spec_counts`)."""
        self.probe, self.explore_every, self.decay = probe, explore_every, decay
        self.window, self.max_interval = window, max_interval
        self.reached = [1.0] * (max_tokens + 1)  # decayed counts per draft position k (index 1..N)
        self.kept = [0.7] * (max_tokens + 1)
        self.samples: dict[tuple[int, int], deque[float]] = {}
        """The last `window` step times per (bucket, count)."""
        self.cost: dict[tuple[int, int], float] = {}
        """Their median: the cost the choice reads."""
        self.tries: dict[tuple[int, int], int] = {}
        self.last_tried: dict[tuple[int, int], int] = {}
        self.interval: dict[tuple[int, int], int] = {}
        """Steps between re-measurements of a count that is not the choice, per (bucket, count)."""
        self._run: dict[int, tuple[int, int]] = {}
        """Per bucket, a re-measurement under way: (its count, steps left)."""
        self._tally: dict[int, list] = {}
        """Per bucket, the re-measurement (or first probes) under way as it runs: [its count, the choice it stands in
        for, seconds, tokens a row kept, steps recorded]."""
        self.run_loss: dict[tuple[int, int], float] = {}
        """Per (bucket, count): what its last re-measurement actually lost against the choice (seconds)."""
        self.steps = 0
        self.choices: dict[int, dict[int, int]] = {}
        """Steps run with each draft count, per batch bucket (what the bench reports)."""

    def alpha(self, k: int) -> float:
        return self.kept[k] / self.reached[k] if self.reached[k] > 0 else 0.0

    def expected_tokens(self, n: int, optimism: float = 0.0) -> float:
        """Tokens a step with n drafts is expected to keep; `optimism` moves each alpha that far towards 1."""
        total, run = 1.0, 1.0
        for k in range(1, n + 1):
            run *= self.alpha(k) + optimism * (1.0 - self.alpha(k))
            total += run
        return total

    def best(self, bucket: int) -> int:
        return max(self.counts, key=lambda c: self.expected_tokens(c) / self.cost[(bucket, c)] / (1 + self.margin if c else 1))

    def choose(self, bucket: int) -> int:
        self.steps += 1
        if not self.adaptive or self.max_tokens == 0:
            n = self.max_tokens
        elif (run := self._run.get(bucket)) is not None and run[1] > 0:
            n = run[0]
            self._run[bucket] = (n, run[1] - 1)
        else:
            unmeasured = [n for n in self.counts if self.tries.get((bucket, n), 0) < self.probe]
            if unmeasured:
                n = unmeasured[-1]  # the plain step first: a fresh request's MTP ring is empty anyway
                if n and not self.tries.get((bucket, n)) and (bucket, 0) in self.cost:  # its probes: tallied as a re-measurement
                    self._tally[bucket] = [n, 0, 0.0, 0.0, 0]
            else:
                n = self.best(bucket)
                self.interval[(bucket, n)] = self.explore_every  # the choice: re-measured promptly once it loses
                due = [c for c in self.could_pay(bucket) if c != n
                       and self.steps - self.last_tried.get((bucket, c), 0) >= self._interval(bucket, c, n)]
                if due:
                    choice, n = n, min(due, key=lambda c: self.last_tried.get((bucket, c), 0))
                    self._tally[bucket] = [n, choice, 0.0, 0.0, 0]
                    key = (bucket, n)
                    self.interval[key] = min(2 * self.interval.get(key, self.explore_every), self.max_interval)
                    self._run[bucket] = (n, self.probe - 1)
        per = self.choices.setdefault(bucket, {})
        per[n] = per.get(n, 0) + 1
        return n

    def _interval(self, bucket: int, n: int, choice: int) -> int:
        """Steps between re-measurements of count n while `choice` is the choice: `interval` (the plain step's only
        when the choice speculates, and rarely: its time follows the speculative step's, whose time and acceptance
        are measured all along, a drop in acceptance switches to plain without it, and a plain step restarts every
        MTP ring), and never fewer than keep the loss within `explore_budget` of the choice's time: the expected
        loss, or what the count's last re-measurement here actually lost, when that was more (its first step after
        plain ones may run cold, which the median cost does not show)."""
        steps = self.max_interval if n == 0 else self.interval.get((bucket, n), self.explore_every)
        loss = max(self.explore_loss(bucket, n, choice), self.run_loss.get((bucket, n), 0.0))
        if loss > 0:
            steps = max(steps, math.ceil(loss / (self.explore_budget * self.cost[(bucket, choice)])))
        return steps

    def explore_loss(self, bucket: int, n: int, choice: int) -> float:
        """Seconds a re-measurement of count n (`probe` steps) is expected to lose against the choice: its steps'
        measured cost less the time the choice takes for the tokens they are expected to keep (the first step after
        plain ones keeps one token: its rings were empty). Negative: it would gain."""
        kept = self.probe * self.expected_tokens(n)
        if choice == 0 and n > 0:
            kept -= self.expected_tokens(n) - 1.0
        return self.probe * self.cost[(bucket, n)] - self._choice_time(bucket, choice, kept)

    def _choice_time(self, bucket: int, choice: int, tokens: float) -> float:
        """Seconds the choice takes to give a row `tokens` tokens (what a re-measurement's loss is counted against)."""
        return tokens * self.cost[(bucket, choice)] / self.expected_tokens(choice)

    def could_pay(self, bucket: int) -> list[int]:
        """The counts worth re-measuring: those whose step costs less than the plain step times the tokens it would
        keep were each draft's acceptance halfway from the measured one to certain. A count that costs more is not
        tried again: past the probes, speculation that does not pay costs nothing."""
        plain = self.cost.get((bucket, 0))
        return [n for n in self.counts
                if n == 0 or plain is None or self.cost[(bucket, n)] < self.expected_tokens(n, optimism=0.5) * plain]

    def record(self, bucket: int, n: int, seconds: float, verified: list[int] | None = None,
               accepted: list[int] | None = None, kept: float | None = None) -> None:
        """A step with `n` drafts took `seconds`; per request, how many drafts it verified (0 where its acceptance
        is not to be learnt from) and kept; `kept`: the tokens a row that verified drafts kept, on average."""
        key = (bucket, n)
        tally = self._tally.get(bucket)
        if tally is not None and tally[0] == n:
            tally[2] += seconds
            tally[3] += kept if kept is not None else 1.0
            tally[4] += 1
            if tally[4] == self.probe:
                del self._tally[bucket]
                self.run_loss[key] = tally[2] - self._choice_time(bucket, tally[1], tally[3])
        times = self.samples.setdefault(key, deque(maxlen=self.window))
        times.append(seconds)
        self.cost[key] = statistics.median(times)
        self.tries[key] = self.tries.get(key, 0) + 1
        self.last_tried[key] = self.steps
        if not verified:
            return
        for d, a in zip(verified, accepted):
            for k in range(1, min(d, a + 1) + 1):  # draft k was looked at when the k - 1 before it were kept
                self.reached[k] = self.decay * self.reached[k] + 1
                self.kept[k] = self.decay * self.kept[k] + (1 if k <= a else 0)
