"""The decode worker: admission under a device budget and continuous batching, as a plain class.

Requests arrive prefilled (a layout, the next input token, sampling params). Each step decodes one
token for every running request; finished and aborted requests leave and return their memory at once.

Two ways in:
- **reserved** (the PD split): `reserve` takes a request's pages at its final length before its prefill
  starts (callable from any thread, so an actor answers at once); the layout arrives later through
  `arrive` and is written between steps, in batches. A reservation whose layout does not arrive within
  its lease is freed and reported as a failure.
- **queued** (one process): `submit` queues a prefilled request; it is admitted in arrival order once
  its pages fit.

Growth policy: the store's (`cachetier.admission`). Under `final` (the default) pages are held at the final
length (prompt + max_tokens), so an admitted request never stalls, and the reservation returns the moment a
request stops. Under `estimate` a request is admitted with the pages of its prompt plus an output estimate and
grows before each step (`_make_room`); when the device has no free page, the newest running request is paused:
its device state moves to host memory (`swap_out`) and it resumes from there, with the same tokens and no
prefill, once its pages are free again. Paused requests resume in the order they paused, before anything new
is admitted, so no admitted request waits behind a newcomer, and none fails for lack of room: a request that
fits the whole budget at its final length (`check_fits_ever`) can always run alone.

Failures: an exception in a step fails exactly the requests of that step (their state may be half
written), as retryable failures collected by `take_failures`; a request that failed once this way is
marked `solo` when it comes back, and a solo request always decodes in a step of its own, so a request
that crashes every step it joins takes down at most one batch. A layout that cannot be written fails
its own request and returns the pages it took.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from cachetier.buckets import batch_bucket
from cachetier.layout import KVLayout, PackedLayout, unpack_layout
from cachetier.store import IntegrityError, KVStore
from core.configs import FaultConfig, StepConfig
from core.request import Attempt, FailureKind, Request
from core.types import SampledToken, SamplingParams, StepTokens, TokenEvent, finish_reason
from decode.runner import StepRunner
from decode.speculative import DraftPolicy, check_speculation
from model.grammar import GrammarEngine, GrammarMasks, GrammarState
from model.model import V4Model
from model.parallel import ReplicaBroken
from model.sampling import SamplingBatch, SamplingCall, TokenHistory, greedy_tokens, index_column, sample_batch

log = logging.getLogger(__name__)


@dataclass
class DecodeRequest:
    """A prefilled attempt handed to decode: the attempt, the token it decodes from, its layout."""

    attempt: Attempt
    first_token: SampledToken
    """The last token generated so far: the next step's input (the first token for a fresh request)."""
    num_generated: int = 1
    """Tokens already generated (the first token included); more than 1 when a request is re-prefilled."""
    layout: KVLayout | None = None
    """The prefilled layout; None while it is still `packed` (it is unpacked on the step thread, when written)."""
    packed: PackedLayout | None = None
    """The layout as it arrived (one buffer), when `layout` is not unpacked yet."""

    def __post_init__(self) -> None:
        sp, a = self.attempt.sampling, self.attempt
        if a.request.structure is not None and not a.generated and self.num_generated != 1:
            raise ValueError(f"{a.key}: its grammar is rebuilt from its tokens, so the {self.num_generated} generated "
                             "so far must come with it (Attempt.generated)")
        if not sp.needs_history:
            return
        if a.generated and (len(a.generated) != self.num_generated or a.generated[-1] != self.first_token.token_id):
            raise ValueError(f"{a.key}: its generated tokens ({len(a.generated)}) disagree with num_generated "
                             f"({self.num_generated}) or the token it decodes from")
        if not a.generated and self.num_generated != 1:
            raise ValueError(f"{a.key}: its sampling looks back at its tokens, so the {self.num_generated} generated "
                             "so far must come with it (Attempt.generated)")
        if sp.needs_prompt and a.request.prompt_len and not a.prompt_token_ids:
            raise ValueError(f"{a.key}: its repetition penalty reads the prompt, which was left out (Attempt.stripped "
                             "keeps it for such a request)")

    def tokens_so_far(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(prompt, generated): what this request has seen when it arrives here, for its `TokenHistory` row."""
        return self.attempt.prompt_token_ids, self.attempt.generated or (self.first_token.token_id,)

    @property
    def request_id(self) -> str:
        return self.attempt.key

    @property
    def sampling(self) -> SamplingParams:
        return self.attempt.sampling

    @property
    def seed(self) -> int:
        return self.attempt.seed

    @property
    def owner(self) -> str:
        return self.attempt.owner

    @property
    def solo(self) -> bool:
        return self.attempt.solo

    @property
    def fault(self) -> str | None:
        return self.attempt.fault

    @property
    def reserve_tokens(self) -> int:
        return self.attempt.reserve_tokens

    @property
    def context_tokens(self) -> int:
        """Tokens its layout holds: the prompt and all generated tokens but the last."""
        return self.attempt.request.prompt_len + self.num_generated - 1

    @classmethod
    def fresh(cls, key: str, layout: KVLayout, first_token: SampledToken, sampling: SamplingParams, seed: int,
              num_generated: int = 1, prompt_token_ids: Sequence[int] = (), **attempt) -> DecodeRequest:
        """A request prefilled here (its layout holds the prompt and all but the last of `num_generated` tokens),
        decoding on from `first_token`, the last of them. The decode side needs no more of the request, unless
        its sampling looks back (`SamplingParams.needs_history`): then give the prompt's tokens when it has a
        repetition penalty, and `generated` (all `num_generated` tokens) when there is more than one.
        `attempt`: the attempt's other fields (generated, solo, owner, fault)."""
        request = Request(key, tuple(prompt_token_ids), sampling, seed, prompt_len=layout.num_tokens - num_generated + 1)
        return cls(Attempt(request, key, **attempt), first_token, num_generated, layout=layout)

    def unpacked(self) -> KVLayout:
        """The layout (unpacked from `packed` on first use: step thread only)."""
        if self.layout is None:
            self.layout, self.packed = unpack_layout(self.packed), None
        return self.layout


@dataclass
class Failure:
    """A request the worker dropped, and why."""

    request_id: str
    owner: str
    message: str
    kind: FailureKind
    """A new prefill elsewhere may succeed after any of them."""


@dataclass
class _Running:
    req: DecodeRequest
    last_token: int
    num_generated: int
    slot: int = field(default=-1)
    """Its row in the worker's `TokenHistory` (-1: its sampling does not look back)."""
    grammar: GrammarState | None = None
    """Its matcher, rebuilt at admission from its tokens so far (None: free text); it leaves with the request."""
    drafts: list[int] = field(default_factory=list)
    """Speculation: the MTP head's drafts for the tokens after `last_token` (empty: none yet)."""


class _Group:
    """Requests that decode in one forward, held column by column between steps: built when the running set
    changes, then each step reads its inputs from here and writes its progress back here, so a steady batch
    costs a few vector operations per step instead of Python work per request. While a group exists its
    columns, not its `_Running` objects, hold each request's last token and count (`sync` writes them back)."""

    __slots__ = ("ids", "runs", "params", "seeds", "slots", "tokens", "num_generated", "max_tokens", "stops", "plain",
                 "faults", "sampling", "index", "grammars", "drafts", "drafted", "speculates", "spec_sampling")

    def __init__(self, ids: list[str], runs: list[_Running], eos_ids: tuple[int, ...]) -> None:
        self.ids, self.runs = ids, runs
        self.params = [r.req.sampling for r in runs]
        self.seeds = [r.req.seed for r in runs]
        self.slots = [r.slot for r in runs]
        self.tokens = [r.last_token for r in runs]
        self.num_generated = np.array([r.num_generated for r in runs], dtype=np.int64)
        self.max_tokens = np.array([p.max_tokens for p in self.params], dtype=np.int64)
        stops = set(eos_ids)
        for p in self.params:
            stops.update(p.stop_token_ids)
        self.stops = frozenset(stops)
        """Every token that ends some row (end-of-sequence and stop ids): only rows that drew one of these, or
        reached their length, are asked `finish_reason`."""
        self.grammars = [r.grammar for r in runs] if any(r.grammar is not None for r in runs) else None
        """Each row's matcher (None for a free row); None when no row has one: then no mask is made at all."""
        self.plain = all(p.plain for p in self.params) and self.grammars is None
        """Greedy on the raw logits without log-probabilities everywhere (no bias, penalty or mask either): a
        token id per row is all sampling has to give."""
        self.faults = {r.req.fault for r in runs} - {None}
        self.sampling: SamplingBatch | None = None
        """The rows' sampling parameters as device tensors: built at the group's first sampled step (on the
        logits' device), then only `index` (and the rows' `TokenHistory` rows, on the device) change."""
        self.index: torch.Tensor | None = None
        """`num_generated` on the device (the index of the token each row generates), advanced beside it."""
        self.drafts = [r.drafts for r in runs]
        self.drafted = any(self.drafts)
        """Whether some row holds drafts: kept beside `drafts`, so a plain step reads one flag, not every row's list."""
        self.speculates = True
        """Whether its steps may speculate: every verified position is sampled exactly as spec-off would sample it
        after the inputs before it, for every kind of request: a grammar's mask and a token history (penalties,
        bad words) are those after the position's drafts (`DecodeWorker._spec_inputs`), and log-probabilities
        are the kept positions' raw distributions."""
        self.spec_sampling: dict[int, SamplingBatch] = {}
        """Per span, the rows' sampling parameters repeated for each verified position (sampled, constrained or
        processed batches); a row with a token history reads it at position j > 0 from its scratch row
        (`DecodeWorker._spec_slots`)."""

    def sync(self) -> None:
        for run, tok, n, d in zip(self.runs, self.tokens, self.num_generated.tolist(), self.drafts):
            run.last_token, run.num_generated, run.drafts = tok, n, d


@dataclass
class _Reservation:
    owner: str
    deadline: float


class InjectedFault(RuntimeError):
    """Raised by a step that holds a request carrying an injected `poison` fault."""


class DecodeWorker:
    def __init__(self, model: V4Model, store: KVStore, max_running: int = 64, eos_ids: tuple[int, ...] | None = None,
                 check_when_idle: bool = True, faults: FaultConfig | None = None,
                 step_config: StepConfig | None = None, grammar: GrammarEngine | None = None) -> None:
        self.model = model
        self.store = store
        self.max_running = max_running
        self.runner = StepRunner(model, store, max_running, step_config) if model is not None else None
        check_speculation(model, store, self.runner)
        self.spec_tokens = self.runner.spec_tokens if self.runner is not None else 0
        """The most draft tokens a step verifies per request (0: no speculation; `decode.speculative`)."""
        self.policy = None
        if self.spec_tokens:
            self.policy = DraftPolicy(self.spec_tokens, (step_config or StepConfig()).speculative_adaptive,
                                      counts=self.runner.spec_counts)
        if self.runner is not None:
            self.runner.warmup()
            if self.spec_tokens:
                spans = [n + 1 for n in self.runner.spec_counts if n]
                self.runner.warmup_spec(spans)
                if self.policy.adaptive:  # each count's first probe per bucket follows its timed cost (`DraftPolicy.seed`)
                    for bucket, costs in self.runner.step_costs(spans).items():
                        for n, cost in costs.items():
                            self.policy.seed(bucket, n, cost)
        self.spec_steps = 0
        self.spec_rows = 0
        """Request-steps that speculated; with `spec_kept`, the acceptance length (tokens kept per request-step)."""
        self.spec_kept = 0
        self.eos_ids = model.cfg.eos_token_ids if eos_ids is None else eos_ids
        self.faults = faults or FaultConfig()
        self.waiting: deque[DecodeRequest] = deque()
        self.running: dict[str, _Running] = {}
        self._groups: list[_Group] | None = None
        """The running requests as the next step's groups; None after the running set changed (`_regroup`)."""
        self.lockstep = False
        """Step in lockstep with the ranks of the model's expert-parallel replica (`join_replica`)."""
        self.last_rounds: int | None = None
        """Forwards the replica ran in the last lockstep step (0: nobody had work)."""
        self.before_forward: Callable[[], None] | None = None
        """Called on the step thread right before each forward, once its inputs are built: the owner hands
        the previous step's output on there, so the threads that deliver it run while the forward does
        (GIL released), not in the gap between steps."""
        self.reserved: dict[str, _Reservation] = {}
        self.paused: deque[_Running] = deque()
        """Running requests paused for room, their device state in host memory (`store.swap_out`), oldest first."""
        self.arrivals: deque[DecodeRequest] = deque()
        self.failures: list[Failure] = []
        self.history: TokenHistory | None = None
        """Token counts and recent tokens on the device, one row per running request whose sampling looks back
        (penalties, bad words of several tokens); made, `max_running` rows, when the first such request is
        admitted (running requests never outnumber `max_running`)."""
        self.grammar = grammar
        """Compiles the structures of constrained requests (None: a request with one is refused at admission)."""
        self.masks: GrammarMasks | None = None
        """The token bitmask of a constrained forward, host and device, `max_running` rows: made when the first
        constrained request is admitted."""
        self._lock = threading.Lock()  # guards `reserved` (reservations come from other threads)
        self.steps = 0
        self.tokens_out = 0
        self.failed_steps = 0
        self.check_when_idle = check_when_idle
        self.integrity_checks = 0
        self.integrity_errors = 0

    # requests in and out -------------------------------------------------------------------------

    def reserve(self, request_id: str, reserve_tokens: int, owner: str = "", lease_s: float = 60.0,
                prefix_keys: tuple[str, ...] = ()) -> bool:
        """Hold a request's pages before its prefill; False when they are not free now (thread-safe).
        Raises `NeverFitsError` when no budget could ever hold it. `prefix_keys`: its context's page keys, for a
        store that keeps finished requests' pages (`KVStore.held_tokens` then says what its handoff may leave out)."""
        self.store.check_fits_ever(request_id, reserve_tokens)
        with self._lock:
            if request_id in self.reserved or request_id in self.running:
                raise ValueError(f"request {request_id} is already here")
            if len(self.reserved) + len(self.running) + len(self.arrivals) + len(self.paused) >= self.max_running:
                return False
            if self.paused:  # paused requests get the room first
                return False
            if not self.store.reserve(request_id, reserve_tokens, prefix_keys=prefix_keys):
                return False
            self.reserved[request_id] = _Reservation(owner, time.monotonic() + lease_s)
        return True

    def arrive(self, req: DecodeRequest) -> bool:
        """A prefilled request whose pages are reserved; written in before the next step (thread-safe).
        False when it holds no reservation (cancelled or lapsed)."""
        with self._lock:
            if req.request_id not in self.reserved:
                return False
            self.arrivals.append(req)
        return True

    def submit(self, req: DecodeRequest) -> None:
        """Queue a prefilled request; raises `NeverFitsError` if no budget could ever hold it."""
        self.store.check_fits_ever(req.request_id, req.reserve_tokens)
        self.waiting.append(req)

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is; its memory in both tiers returns at once (step thread only)."""
        found = False
        if request_id in self.running:
            self._leave([request_id])
            found = True
        elif (run := next((run for run in self.paused if run.req.request_id == request_id), None)) is not None:
            self.paused.remove(run)
            self._release(request_id, run)
            found = True
        else:
            with self._lock:
                if self.reserved.pop(request_id, None) is not None:
                    self.store.free(request_id)
                    found = True
                for req in list(self.arrivals):
                    if req.request_id == request_id:
                        self.arrivals.remove(req)
            for req in self.waiting:
                if req.request_id == request_id:
                    self.waiting.remove(req)
                    found = True
                    break
        self._check_if_idle()
        return found

    def owned_by(self, owner: str) -> list[str]:
        """Ids of every request (reserved, arriving, running or paused) collected by `owner`."""
        with self._lock:
            ids = [rid for rid, r in self.reserved.items() if r.owner == owner]
        return ids + [run.req.request_id for run in [*self.running.values(), *self.paused] if run.req.owner == owner]

    def has_work(self) -> bool:
        """Whether `step` has something to do: requests to decode or admit, or a reservation that lapsed."""
        if self.running or self.waiting or self.arrivals or self.paused:
            return True
        with self._lock:
            return bool(self.reserved) and min(r.deadline for r in self.reserved.values()) < time.monotonic()

    def idle(self) -> bool:
        """Nothing held at all: no request running, paused, queued, arriving or reserved."""
        return not (self.running or self.waiting or self.arrivals or self.reserved or self.paused)

    def take_failures(self) -> list[Failure]:
        out, self.failures = self.failures, []
        return out

    def _fail(self, request_id: str, owner: str, message: str, kind: FailureKind) -> None:
        self.failures.append(Failure(request_id, owner, message, kind))

    def _admit(self) -> None:
        # reserved requests whose layout arrived, in batches between steps
        while self.arrivals:
            with self._lock:
                req = self.arrivals.popleft()
                res = self.reserved.pop(req.request_id, None)
            if res is None:
                continue  # aborted while its layout was on the way
            try:
                self.store.fill(req.request_id, req.unpacked())
            except Exception as e:
                log.exception("writing the layout of %s failed", req.request_id)
                self.store.free(req.request_id)
                self._fail(req.request_id, req.owner, f"writing its layout failed: {e}", FailureKind.LAYOUT)
                continue
            self._start(req)
        # paused requests, in the order they paused, with a block to spare (so that the first to grow does not
        # pause it again at once)
        while self.paused and self.store.swap_in(self.paused[0].req.request_id, spare_blocks=1):
            run = self.paused.popleft()
            self._running_changed()
            self.running[run.req.request_id] = run
        # queued requests, in arrival order while they fit (and nobody paused is waiting for room)
        while self.waiting and not self.paused and len(self.running) < self.max_running:
            req = self.waiting[0]
            if not self.store.fits(req.reserve_tokens, req.context_tokens) and not (
                    self.store.rebalance(new_step=False) and self.store.fits(req.reserve_tokens, req.context_tokens)):
                break  # arrival order: nobody jumps the queue
            self.waiting.popleft()
            a = req.attempt
            context = (*a.prompt_token_ids, *a.generated[:-1])  # what it prefilled, when the prompt came with it
            keys = self.store.page_keys(context) if len(context) == req.layout.num_tokens else ()
            self.store.admit(req.request_id, req.layout, req.reserve_tokens, keys)
            self._start(req)
        # reservations whose layout never came
        if self.reserved:
            now = time.monotonic()
            with self._lock:
                lapsed = [(rid, r) for rid, r in self.reserved.items() if r.deadline < now]
                for rid, _ in lapsed:
                    del self.reserved[rid]
                    self.store.free(rid)
            for rid, r in lapsed:
                self._fail(rid, r.owner, "its layout did not arrive within the reservation lease", FailureKind.LEASE)

    def _start(self, req: DecodeRequest) -> None:
        """An admitted request joins the running set, its token history and its grammar's matcher rebuilt here
        from its tokens so far when its sampling looks back or its output is constrained."""
        state = None
        if req.attempt.request.structure is not None:
            try:
                state = self._grammar_state(req)
            except Exception as e:
                log.exception("rebuilding the grammar of %s failed", req.request_id)
                self.store.free(req.request_id)
                self._fail(req.request_id, req.owner, f"its grammar could not be rebuilt: {e}", FailureKind.LAYOUT)
                return
        slot = -1
        if req.sampling.needs_history:
            if self.history is None:
                self.history = TokenHistory(self.max_running, self.model.cfg.vocab_size, self.model.device,
                                            scratch=self.max_running * self.spec_tokens)
            slot = self.history.take(req.sampling, *req.tokens_so_far())
        self._running_changed()
        self.running[req.request_id] = _Running(req, req.first_token.token_id, req.num_generated, slot, state)

    def _grammar_state(self, req: DecodeRequest) -> GrammarState:
        if self.grammar is None:
            raise ValueError("this decode worker has no grammar engine (its model has no tokenizer)")
        if self.masks is None:
            self.masks = GrammarMasks(self.max_running * (self.spec_tokens + 1), self.grammar.words, self.model.device)
        sp = req.sampling
        return self.grammar.state(req.attempt.request.structure, req.tokens_so_far()[1], sp.stop_token_ids)

    # the step ------------------------------------------------------------------------------------

    def join_replica(self) -> None:
        """Step in lockstep with the other ranks of the model's replica from now on (`model.comm`, expert
        parallel; every rank calls this at once, and a CUDA rank captures its warm-up graphs with the others
        here): every step, the ranks agree on how many forwards the busiest runs, and a rank with fewer runs
        idle forwards for the rest, so every MoE exchange finds all ranks. Fixed-shape ranks also agree on
        each forward's bucket, so that every exchange is the same size on every rank (`StepRunner.agree`)."""
        if self.model.comm is None or self.model.comm.ep == 1:
            raise ValueError("lockstep needs a model attached to an expert-parallel replica")
        self.runner.join_replica()
        self.lockstep = True

    def step(self) -> Sequence[TokenEvent]:
        """Admit what arrived or fits, decode one token for every running request; returns the new tokens
        (a `StepTokens` when one forward ran). Requests that failed are collected by `take_failures`."""
        self._admit()
        if self.store.grows and self.running:
            self._make_room()
        if self.running:
            self.store.rebalance()  # residency follows the room left (a no-op for most stores)
        if self._groups is None:
            self._groups = self._regroup()
        groups = self._groups
        rounds, plan = len(groups), None
        if self.lockstep:  # one gather: every rank's forwards (and, fixed-shape, their buckets and span)
            wish = 1
            if self.policy is not None and groups and groups[0].speculates:
                wish = 1 + self.policy.choose(batch_bucket(len(groups[0].ids), self.max_running))
            plan = self.runner.agree([g.ids for g in groups], wish)
            self.last_rounds = rounds = plan.rounds
        if not self.running:
            for r in range(rounds):
                self._run_idle(plan, r)
            if plan is not None and plan.capture is not None:  # nobody has work: every rank captures it now
                self.runner.capture_agreed(plan.capture)
            if not self.lockstep or rounds:
                self._check_if_idle()
            return []
        ended: list[str] = []
        outputs = [self._decode(g, ended, plan.bucket(r) if plan is not None else None,
                                (plan.span if r == 0 else 1) if plan is not None else None) for r, g in enumerate(groups)]
        for r in range(len(groups), rounds):
            self._run_idle(plan, r)
        if ended:
            self._leave(ended, keep=True)
        self.steps += 1
        events = outputs[0] if len(outputs) == 1 else [ev for out in outputs for ev in out]
        self.tokens_out += len(events)
        self._check_if_idle()
        return events

    def _run_idle(self, plan, r: int) -> None:
        """Round r of a lockstep step that this rank has nothing for: the agreed kind of forward over padding rows."""
        if r == 0 and plan.span > 1:
            self.runner.run_idle_spec(plan.first, plan.span)
        else:
            self.runner.run_idle(plan.bucket(r))

    def _regroup(self) -> list[_Group]:
        """The forwards of a step: every request that is not solo in one, then each solo request alone."""
        batch = [(rid, run) for rid, run in self.running.items() if not run.req.solo]
        groups = [_Group([rid for rid, _ in batch], [run for _, run in batch], self.eos_ids)] if batch else []
        return groups + [_Group([rid], [run], self.eos_ids) for rid, run in self.running.items() if run.req.solo]

    def _running_changed(self) -> None:
        """Before the running set changes: write the groups' columns back to their requests, drop the groups."""
        if self._groups is not None:
            for g in self._groups:
                g.sync()
            self._groups = None

    def _make_room(self) -> None:
        """Every running request's blocks cover this step's positions (the most a step may verify), oldest first;
        while the device has no page for one, the newest running request pauses (possibly that one itself: alone, it
        waits for pages that reservations made before prefill hold, which either arrive and run, or lapse)."""
        ahead = 1 + self.spec_tokens
        for rid in list(self.running):
            while rid in self.running and not self.store.grow(rid, ahead):
                self._pause(next(reversed(self.running)))

    def _pause(self, request_id: str) -> None:
        self._running_changed()
        run = self.running.pop(request_id)
        self.store.swap_out(request_id)
        self.paused.append(run)
        log.info("paused %s for room (%d paused)", request_id, len(self.paused))

    def _leave(self, request_ids: list[str], keep: bool = False) -> None:
        """These running requests stop; their memory returns at once (`keep`: those that finished rather than failed
        may leave their prompt pages for a follow-up turn, `KVStore.free`)."""
        self._running_changed()
        failed = {f.request_id for f in self.failures} if keep else set()
        for rid in request_ids:
            self._release(rid, self.running.pop(rid), keep and rid not in failed)

    def _release(self, request_id: str, run: _Running, keep: bool = False) -> None:
        """A request that stops (running or paused): its history row and its memory in both tiers return."""
        if run.slot >= 0:
            self.history.free(run.slot)
        self.store.finished(request_id, run.num_generated)
        if keep:
            self.store.free(request_id, keep=True)
        else:
            self.store.free(request_id)

    def _decode(self, g: _Group, ended: list[str], bucket: tuple[int, int] | None = None, span: int | None = None) -> StepTokens:
        """One forward over a group (in `bucket`, when the replica's ranks agreed on one, verifying `span` positions
        per request when they agreed on a speculative step; None: this worker decides); the ids of rows that
        finished (or failed) are added to `ended`."""
        def launch() -> None:  # once the step's inputs are built, right before its forward
            if self.before_forward is not None:
                self.before_forward()
            if g.faults:
                self._inject_faults(g.faults)  # a fault stands for a forward that hangs or fails

        spec_bucket = None
        if self.policy is not None and (g.speculates or span is not None):
            spec_bucket = batch_bucket(len(g.ids), self.max_running)
            n = self.policy.choose(spec_bucket) if span is None else span - 1  # a replica's ranks agreed on theirs
            if n > 0:
                return self._decode_spec(g, ended, n, launch, spec_bucket, bucket)
            if g.drafted:  # a plain step writes no MTP entries: these rings restart at the next one
                g.drafts, g.drafted = [[] for _ in g.ids], False
        t0 = time.perf_counter()
        try:
            logits = self.runner.run(g.ids, g.tokens, launch, bucket)
            if g.plain:
                sampled, tokens = None, greedy_tokens(logits.float())
            else:
                if g.sampling is None:
                    g.sampling = SamplingBatch.build(g.params, g.seeds, logits.device, logits.shape[-1], eos_ids=self.eos_ids,
                                                     history=self.history, slots=g.slots)
                    g.index = index_column(g.num_generated.tolist(), logits.device)
                mask = None if g.grammars is None else self.masks.fill(g.grammars)  # [rows, vocab/32] int32
                sampled = sample_batch(logits, g.sampling, g.index, mask)
                tokens = [t.token_id for t in sampled]
            if g.grammars is not None:
                for state, t in zip(g.grammars, tokens):
                    if state is not None:
                        state.accept(t)
        except Exception as e:
            return self._step_failed(g, ended, e, "decode")
        g.tokens = tokens
        g.num_generated += 1
        if g.index is not None:
            g.index += 1
        counts = g.num_generated
        # `finish_reason` decides; it is asked only for rows that drew a stop token or reached their length
        maybe = np.flatnonzero(counts >= g.max_tokens).tolist()
        hit = g.stops.intersection(tokens)
        if hit:
            maybe = sorted(set(maybe).union(i for i, t in enumerate(tokens) if t in hit))
        ended_grammar = set()
        if g.grammars is not None:  # a grammar that took its last token (or was left) ends its request
            ended_grammar = {i for i, state in enumerate(g.grammars) if state is not None and state.done}
            maybe = sorted(set(maybe) | ended_grammar)
        reasons = {}
        for row in maybe:
            reason = finish_reason(tokens[row], int(counts[row]), g.params[row], self.eos_ids)
            if reason is None and row in ended_grammar:
                reason = "stop"
            if reason is not None:
                reasons[row] = reason
                ended.append(g.ids[row])
        if spec_bucket is not None:
            self.policy.record(spec_bucket, 0, time.perf_counter() - t0)
        return StepTokens(g.ids, counts - 1, tokens, sampled, reasons)

    def _decode_spec(self, g: _Group, ended: list[str], n: int, launch: Callable[[], None], bucket: int,
                     agreed: tuple[int, int] | None = None) -> StepTokens:
        """One speculative step over a group (`decode.speculative`): every row verifies up to `n` drafts and keeps
        1 to n + 1 tokens, the same tokens a plain step would give one by one. Returns them in order, a row's
        tokens side by side; a row that ends (stop token, length, its grammar's end) keeps nothing after its last
        token. The kept tokens join the rows' matchers and token histories here, after the step."""
        t0 = time.perf_counter()  # the step's cost for the policy: all of it, its bookkeeping included
        span = n + 1
        # A row without drafts just arrived (its ring starts at its first decode position already) or took plain
        # steps, which write no MTP entries: its ring holds nothing of the positions since, so it restarts here.
        stale = [rid for rid, d in zip(g.ids, g.drafts) if not d]
        if stale:
            self.store.restart_mtp(stale)
        remaining = (g.max_tokens - g.num_generated).tolist()
        verify = [max(0, min(n, len(d), left - 1)) for d, left in zip(g.drafts, remaining)]
        history = self.store.mtp_history(g.ids)
        restarted = self.store.mtp_restarted(g.ids)
        sampling = None
        try:
            if not g.plain:
                sampling, verify = self._spec_inputs(g, span, verify)
            inputs = [[t, *d[:k]] for t, d, k in zip(g.tokens, g.drafts, verify)]
            if sampling is not None and self.history is not None:
                self._spec_history(g, inputs)
            rows = self.runner.run_spec(g.ids, inputs, verify, span, launch, sampling, agreed)
        except Exception as e:
            return self._step_failed(g, ended, e, "speculative decode")
        kept_counts = [row[span] for row in rows]
        drawn = sampling.tokens([t for row in rows for t in row[:span]]) if sampling is not None else None
        ids, index, tokens, reasons = [], [], [], {}
        sampled = [] if drawn is not None else None
        kept_slots, kept_params, kept_tokens = [], [], []
        for r, row in enumerate(rows):
            before = int(g.num_generated[r])
            state = g.grammars[r] if g.grammars is not None else None
            out = []
            reason = None
            for t in row[: row[span] + 1]:
                out.append(t)
                if state is not None:
                    state.accept(t)
                reason = finish_reason(t, before + len(out), g.params[r], self.eos_ids)
                if reason is None and state is not None and state.done:  # its grammar took its last token
                    reason = "stop"
                if reason is not None:
                    break
            ids.extend([g.ids[r]] * len(out))
            index.extend(range(before, before + len(out)))
            tokens.extend(out)
            if sampled is not None:
                sampled.extend(drawn[r * span : r * span + len(out)])
            if g.slots[r] >= 0:
                kept_slots.append(g.slots[r])
                kept_params.append(g.params[r])
                kept_tokens.append(out)
            if reason is not None:
                reasons[len(tokens) - 1] = reason
                ended.append(g.ids[r])
            g.tokens[r] = out[-1]
            g.num_generated[r] = before + len(out)
            g.drafts[r] = row[span + 1 :]
        g.drafted = any(g.drafts)
        if kept_slots:
            self.history.extend(kept_slots, kept_params, kept_tokens)
        if g.index is not None:
            g.index = index_column(g.num_generated.tolist(), g.index.device)
        self.spec_steps += 1
        self.spec_rows += len(rows)
        self.spec_kept += sum(kept_counts) + len(rows)
        # Acceptance is learnt from the rows as served (a new request's ring fills from its admission on), except
        # those whose ring plain steps restarted less than a window ago: what a re-measurement after a plain stretch
        # sees of them is a transition, not what the count gives once it is the choice.
        window = self.model.cfg.sliding_window
        steady = [h >= window or not again for h, again in zip(history, restarted)]
        learnt = [v if ok else 0 for v, ok in zip(verify, steady)]
        # what the rows that had drafts kept (a stale row's first step only drafts, a transition the policy accounts
        # for apart)
        drafted = [k for k, d in zip(kept_counts, verify) if d]
        self.policy.record(bucket, n, time.perf_counter() - t0, learnt, kept_counts,
                           kept=1 + sum(drafted) / len(drafted) if drafted else None)
        return StepTokens(ids, index, tokens, sampled, reasons)

    def _spec_inputs(self, g: _Group, span: int, verify: list[int]) -> tuple[SamplingCall, list[int]]:
        """The sampling call of a speculative step that does more than take the argmax of raw logits: the rows'
        parameters once per verified position (position j of row r at r * span + j, as the view lays them out),
        their token indices, and the grammar masks after each position's drafts, which may verify fewer drafts
        than `verify` (`GrammarMasks.fill_spec`) -> (the call, the drafts each row verifies)."""
        device = self.model.device
        sb = g.spec_sampling.get(span)
        if sb is None:
            sb = g.spec_sampling[span] = SamplingBatch.build(
                [p for p in g.params for _ in range(span)], [s for s in g.seeds for _ in range(span)], device,
                self.model.cfg.vocab_size, eos_ids=self.eos_ids, history=self.history, slots=self._spec_slots(g, span))
        mask = None
        if g.grammars is not None:
            mask, verify = self.masks.fill_spec(g.grammars, [d[:k] for d, k in zip(g.drafts, verify)], span)
        index = index_column([c + j for c in g.num_generated.tolist() for j in range(span)], device)
        return SamplingCall(sb, index, mask), verify

    def _spec_slots(self, g: _Group, span: int) -> list[int]:
        """The token-history slot each verified position reads (r * span + j): position 0 the row's own, position
        j > 0 the row's j-th scratch row, holding its history plus its first j drafts (`_spec_history`); -1 for
        a row that keeps none."""
        h = self.history
        return [s if j == 0 or s < 0 else h.scratch_slot(r * self.spec_tokens + j - 1)
                for r, s in enumerate(g.slots) for j in range(span)]

    def _spec_history(self, g: _Group, inputs: list[list[int]]) -> None:
        """Between steps: each history row's scratch rows for the positions it verifies, as its history followed by
        the drafts before each position (so the penalties and bad words of position j see what spec-off would
        have recorded by then). The row's own history is left alone: the kept tokens join it after the step."""
        dst, src, params, drafts = [], [], [], []
        for r, (slot, row) in enumerate(zip(g.slots, inputs)):
            if slot < 0:
                continue
            for j in range(1, len(row)):
                dst.append(self.history.scratch_slot(r * self.spec_tokens + j - 1))
                src.append(slot)
                params.append(g.params[r])
                drafts.append(row[1 : j + 1])
        if dst:
            self.history.copy_rows(dst, src)
            self.history.extend(dst, params, drafts)

    def _step_failed(self, g: _Group, ended: list[str], e: Exception, what: str) -> StepTokens:
        """A step over `g` raised: on a replica rank the replica is broken; otherwise the step may have written part
        of these requests' state, so all of them fail (each to be prefilled again) and leave."""
        if self.lockstep:
            raise ReplicaBroken(f"a {what} step failed on a replica rank: {type(e).__name__}: {e}") from e
        self.failed_steps += 1
        log.exception("%s step over %d request(s) failed; failing them", what, len(g.ids))
        for rid, run in zip(g.ids, g.runs):
            ended.append(rid)
            self._fail(rid, run.req.owner, f"a decode step it was in failed: {type(e).__name__}: {e}", FailureKind.STEP)
        return StepTokens([], [], [])

    def _inject_faults(self, faults: set[str]) -> None:
        if "hang" in faults:
            log.warning("injected fault: the step thread blocks for %.0f s", self.faults.hang_s)
            time.sleep(self.faults.hang_s)
        if "poison" in faults:
            raise InjectedFault("injected fault: this step holds a poisoned request")

    def _check_if_idle(self) -> None:
        """Idle: nothing in flight can hide a leak, and the check costs no latency. A failure is counted and
        logged, never raised into the step or the abort that found the worker idle (that would skip the rest
        of what they do, and the caller's own bookkeeping after them)."""
        if self.check_when_idle and self.idle():
            try:
                self.check_integrity()
            except IntegrityError as e:
                log.error("integrity check failed on an idle decode worker: %s", e)

    def check_integrity(self) -> None:
        """The store's integrity check; every failure counts in `integrity_errors` (and raises)."""
        self.integrity_checks += 1
        try:
            self.store.check_integrity()
        except IntegrityError:
            self.integrity_errors += 1
            raise

    def idle_work(self) -> bool:
        """Work for a step thread with nothing to decode (capturing a bucket a step found uncaptured); True if
        it did some. Nothing here ever runs while a request waits on a step."""
        return self.runner is not None and not self.has_work() and self.runner.idle_work()

    def close(self) -> None:
        """Release what the store holds outside Python's reach (pinned host memory)."""
        self.store.close()

    def stats(self) -> dict:
        out = {"running": len(self.running), "waiting": len(self.waiting) + len(self.arrivals), "reserved": len(self.reserved),
               "paused": len(self.paused),
               "steps": self.steps, "tokens_out": self.tokens_out, "failed_steps": self.failed_steps,
               "integrity_checks": self.integrity_checks, "integrity_errors": self.integrity_errors}
        if self.runner is not None:
            out["step"] = self.runner.stats()
        if self.spec_tokens:
            out["speculation"] = {"max_draft_tokens": self.spec_tokens, "steps": self.spec_steps,
                                  "acceptance_length": round(self.spec_kept / self.spec_rows, 4) if self.spec_rows else None,
                                  "draft_choices": {str(b): c for b, c in self.policy.choices.items()}}
        out.update(self.store.stats())
        return out
