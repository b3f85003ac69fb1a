"""What crosses between a gateway's frontend, the prefill actors and the decode actors.

The request path in messages:
1. frontend -> decode actor `reserve(owner, key, tokens)`: the decode side takes the request's pages at
   its final length before any prefill work is spent (False: no room there now).
2. frontend -> prefill actor `prefill(request, target)`: the prefill actor runs the prompt, samples the
   first token and, unless that ends the request, hands the layout to the target decode actor itself
   with one non-streaming call `admit(handoff, layout)` (the layout travels as an argument through the
   object store); it returns the first token once the decode actor holds the request. With Ray's direct
   tensor transports (nccl, gloo, nixl) only the process that set the transport up may start a transfer,
   so there the frontend moves the layout: `admit(handoff, prefill.export(key))`, then `release(key)`.
3. decode actor -> frontend: one `StepMessage` per poll with all new tokens of that frontend's
   requests since its previous poll (steps merge while a frontend is busy), the failures, and a
   `Report` of the actor's capacity and health. A frontend keeps one poll in flight per decode actor,
   so there is one message per step at most and never one Ray object per token.

Internal request keys are made by the frontend and unique per attempt; a client's request id never
reaches the actors.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from cachetier.geometry import pages_for_request
from cachetier.prefix import PrefixCacheStats
from core.request import Attempt, FailureKind
from core.types import HisparseError, PromptLogprob, SampledToken, TokenEvent

ROLE_PREFILL = "hisparse_prefill"
ROLE_DECODE = "hisparse_decode"
TRANSPORTS = ("object_store", "gloo", "nccl", "nixl")
COLLECTIVE_TRANSPORTS = {"gloo": "torch_gloo", "nccl": "nccl"}
NAMESPACE = "hisparse"
ACTOR_GONE = (RayActorError, ActorDiedError, ActorUnavailableError)
"""What a call to an actor that died (or cannot be reached) raises."""


class RetryableFailure(HisparseError):
    """An attempt failed for a reason another attempt may not meet; the frontend prefills it again."""

    status = 503
    kind = "service_unavailable"


class WorkerLost(RetryableFailure):
    """A prefill or decode actor the attempt was on died or is stuck in one step."""


class StepFailure(RetryableFailure):
    """The attempt was in a step that raised; it runs in steps of its own from then on."""


class RequestGone(RetryableFailure):
    """The decode side no longer holds the attempt (its reservation lapsed, or its layout failed to write)."""


def failure_error(kind: FailureKind, message: str) -> RetryableFailure:
    """The error a decode actor's reported failure (`decode.worker.Failure.kind`) becomes on the frontend."""
    return StepFailure(message) if FailureKind(kind) is FailureKind.STEP else RequestGone(message)


@dataclass
class DecodeTarget:
    """The decode actor that reserved a request's pages, and who collects its tokens."""

    handle: Any
    name: str
    owner: str
    held_tokens: int = 0
    """Tokens at the start of the context whose classical entries the decode actor kept from an earlier turn: the
    handoff leaves them out (`cachetier.retention`)."""


@dataclass
class Handoff:
    """A prefilled attempt as the decode actor receives it (the layout travels beside it)."""

    attempt: Attempt
    first_token: SampledToken
    num_generated: int
    layout_format: str
    layout_bytes: int
    """Bytes of the layout's tensors as the prefill side packed them; the decode side checks them."""

    @property
    def request_id(self) -> str:
        return self.attempt.key


@dataclass
class PrefillOutcome:
    """What a prefill call returns to the frontend."""

    key: str
    first_token: SampledToken | None
    finish_reason: str | None
    prompt_logprobs: list[PromptLogprob] | None
    prompt_len: int
    handed_off: bool
    """The decode actor holds the request (it was not finished by its first token)."""
    layout_bytes: int = 0
    handoff_s: float = 0.0
    """From the layout being packed to the decode actor's acknowledgement."""
    awaiting_export: Handoff | None = None
    """Direct tensor transports only: the layout waits in the prefill actor for the caller to move it
    (`export` into the decode actor's `admit`, then `release`); this is the handoff to pass along."""


@dataclass(frozen=True, kw_only=True)
class ActorInfo:
    """What an actor says of itself when it is ready (`ready`)."""

    name: str
    node_id: str
    pid: int
    layout_format: str
    """The layout format it reads or writes (`cachetier.layout.layout_format`): prefill and decode must agree."""
    describe: str
    """Device, dtype, KV format (and decode mode): what the start-up log prints for it."""
    replica: str | None = None
    """The layout of the replica it is a rank of (`core.parallel`); None for a whole-model actor."""
    rank: int | None = None
    replica_group: str | None = None
    """The replica's placement group: ranks that share it live and die together."""


@dataclass(frozen=True)
class Capacity:
    """A decode actor's fixed geometry, as routing needs it."""

    num_pages: int
    group_pages: int
    block_tokens: int
    max_running: int
    """Most requests it holds at once (reserved, arriving and running)."""
    keeps: bool = False
    """It keeps finished requests' prompt pages for follow-up turns (`--retain-bytes`): routing sends a prompt that
    extends one back there, with its page keys (`cachetier.retention`)."""
    shares: bool = False
    """Its running requests hold the full pages their contexts share once (`--share-prefixes`): routing sends each
    prompt's page keys, and prefers the actor where a prompt with the same first pages was placed
    (`cachetier.sharing`)."""

    @property
    def takes_keys(self) -> bool:
        """Whether its reservations take the context's page keys (it matches them against pages it holds)."""
        return self.keeps or self.shares

    def pages_for(self, reserve_tokens: int) -> int:
        """Pages a request of this final length takes here (`cachetier.geometry.pages_for_request`)."""
        return pages_for_request(self.group_pages, self.block_tokens, reserve_tokens)

    def never_fits(self, reserve_tokens: int) -> bool:
        return self.pages_for(reserve_tokens) > self.num_pages


@dataclass(frozen=True, kw_only=True)
class DecodeInfo(ActorInfo):
    capacity: Capacity


@dataclass(frozen=True, kw_only=True)
class PrefillInfo(ActorInfo):
    prefix_page_tokens: int | None
    """Tokens per prefix-cache page; None without the prefix cache."""
    prefix_affinity_slack: int
    prefix_pages: tuple
    """Page keys its prefix cache holds (its disk tier's, at start): seeds prefix-affinity routing."""


def _pick(cls, values: dict, **extra):
    """An instance of dataclass `cls` from the keys of `values` it has fields for (a worker's own stats dict)."""
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names}, **extra)


@dataclass(frozen=True, kw_only=True)
class DecodeStats:
    """A decode actor's counters: its worker's, its tier's and its own."""

    name: str = ""
    running: int = 0
    waiting: int = 0
    reserved: int = 0
    steps: int = 0
    tokens_out: int = 0
    failed_steps: int = 0
    integrity_checks: int = 0
    integrity_errors: int = 0
    """Every failed integrity check (idle checks and asked-for ones)."""
    offload: bool = False
    device_bytes_used: int = 0
    device_bytes_total: int = 0
    host_bytes_used: int = 0
    host_bytes_total: int = 0
    pages_free: int = 0
    pages_total: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    resident_requests: int = 0
    """With `--resident on`: requests whose C4 entries are all on the device now (`cachetier.residency`)."""
    promotions: int = 0
    demotions: int = 0
    """Requests grown resident and shrunk back to their hot buffers, since start."""
    kept_requests: int = 0
    """With `--retain-bytes`: finished requests whose prompt pages it keeps for a follow-up turn now."""
    kept_bytes: int = 0
    kept_reused: int = 0
    kept_reused_pages: int = 0
    """Reservations that took a kept entry over, and the pages their handoffs left out, since start."""
    kept_evicted: int = 0
    shared_pages_now: int = 0
    """With `--share-prefixes`: full context pages its running requests hold once now (`cachetier.sharing`)."""
    share_shared_pages: int = 0
    share_shared_at_fill: int = 0
    """References to a shared page taken at reservation (the handoff left it out) and when a layout was written,
    since start."""
    handoffs: int = 0
    handoff_bytes: int = 0
    subscribers: int = 0
    owners: int = 0
    """Requests it routes output for (zero when idle)."""
    dropped_subscribers: int = 0
    step: Any = None
    """How its decode step runs (`decode.runner.StepStats`)."""
    speculation: dict | None = None
    """With speculative decoding on: draft tokens, speculative steps, acceptance length, the draft counts chosen."""

    @classmethod
    def of(cls, worker_stats: dict, **actor: Any) -> DecodeStats:
        return _pick(cls, worker_stats, **actor)


SUMMED_DECODE = ("running", "waiting", "reserved", "device_bytes_used", "device_bytes_total", "host_bytes_used",
                 "host_bytes_total", "hits", "misses", "bytes_h2d", "failed_steps", "integrity_errors", "integrity_checks",
                 "kept_requests", "kept_bytes", "kept_reused", "kept_reused_pages", "kept_evicted")
"""The decode counters a frontend reports summed over its actors."""


@dataclass(frozen=True, kw_only=True)
class PrefillStats:
    """A prefill actor's queue and counters as of its last step (it never waits for a step to end)."""

    name: str = ""
    queued_tokens: int = 0
    pending: int = 0
    tokens_in: int = 0
    """Prompt tokens computed (those resumed from the prefix cache are not)."""
    progress: dict | None = None
    """Request key -> (tokens done, tokens in all) of every queued request."""
    prefix_cache: PrefixCacheStats | None = None
    futures: int = 0
    held_layouts: int = 0
    held_bytes: int = 0
    handoffs: int = 0
    bytes_sent: int = 0
    stalled_s: float = 0.0


@dataclass
class Report:
    """A decode actor's capacity and health, sent with every message."""

    name: str
    pages_free: int
    pages_total: int
    host_blocks_free: int
    running: int
    waiting: int
    reserved: int
    stalled_s: float
    """Seconds the step thread has had work without finishing a step (0 when it keeps up or idles)."""
    stats: DecodeStats | None = None
    """The worker's and tier's counters, refreshed at most once a second."""


@dataclass(slots=True)
class Delta:
    """New tokens of one request since the previous message: consecutive, from `first_index` on."""

    first_index: int
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list | None
    finish_reason: str | None = None

    def events(self, request_id: str) -> list[TokenEvent]:
        """The token events this delta holds, as `request_id`'s."""
        first, ids, lps, tops, reason = self.first_index, self.token_ids, self.logprobs, self.top_logprobs, self.finish_reason
        last = len(ids) - 1
        if lps is None:
            return [TokenEvent(request_id, first + i, SampledToken(tok), reason if i == last else None)
                    for i, tok in enumerate(ids)]
        return [TokenEvent(request_id, first + i, SampledToken(tok, lps[i], tops[i]), reason if i == last else None)
                for i, tok in enumerate(ids)]


class Dropped(NamedTuple):
    """A request a decode actor dropped, and why."""

    message: str
    kind: FailureKind


@dataclass
class StepMessage:
    """New output of one frontend's requests on one decode actor since its previous poll."""

    seq: int
    deltas: dict[str, Delta]
    failures: dict[str, Dropped]
    """Requests the actor dropped (see `failure_error`)."""
    report: Report | None = None

    @property
    def empty(self) -> bool:
        return not self.deltas and not self.failures


class Outbox:
    """One subscriber's pending output on a decode actor: the step thread adds, the poll takes.

    Everything added between two takes merges into one message (tokens appended per request, the last
    finish reason kept), so a subscriber that lags costs one bigger message, never a queue of small ones.
    """

    def __init__(self, max_pending_tokens: int = 1 << 20) -> None:
        self._lock = threading.Lock()
        self._deltas: dict[str, Delta] = {}
        self._failures: dict[str, Dropped] = {}
        self._tokens = 0
        self.max_pending_tokens = max_pending_tokens
        self.seq = 0

    def add(self, events: list[TokenEvent], failures: dict[str, Dropped] | None = None) -> None:
        with self._lock:
            for ev in events:
                d = self._deltas.get(ev.request_id)
                if d is None:
                    with_lp = ev.token.logprob is not None
                    d = self._deltas[ev.request_id] = Delta(ev.index, [], [] if with_lp else None, [] if with_lp else None)
                d.token_ids.append(ev.token.token_id)
                if d.logprobs is not None:
                    d.logprobs.append(ev.token.logprob)
                    d.top_logprobs.append(ev.token.top_logprobs)
                d.finish_reason = ev.finish_reason
            self._tokens += len(events)
            if failures:
                self._failures.update(failures)

    @property
    def overflowing(self) -> bool:
        return self._tokens > self.max_pending_tokens

    def take(self, report: Report | None) -> StepMessage:
        with self._lock:
            self.seq += 1
            msg = StepMessage(self.seq, self._deltas, self._failures, report)
            self._deltas, self._failures, self._tokens = {}, {}, 0
        return msg

    def pending(self) -> bool:
        return bool(self._deltas or self._failures)
