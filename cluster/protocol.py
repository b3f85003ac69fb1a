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
from dataclasses import dataclass, field
from typing import Any

from core.types import HisparseError, PromptLogprob, SampledToken, SamplingParams, TokenEvent

ROLE_PREFILL = "hisparse_prefill"
ROLE_DECODE = "hisparse_decode"
TRANSPORTS = ("object_store", "gloo", "nccl", "nixl")
COLLECTIVE_TRANSPORTS = {"gloo": "torch_gloo", "nccl": "nccl"}
NAMESPACE = "hisparse"


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


def failure_error(kind: str, message: str) -> RetryableFailure:
    """The error a decode actor's reported failure (`decode.worker.Failure.kind`) becomes on the frontend."""
    return StepFailure(message) if kind == "step" else RequestGone(message)


@dataclass
class DecodeTarget:
    """The decode actor that reserved a request's pages, and who collects its tokens."""

    handle: Any
    name: str
    owner: str


@dataclass
class Handoff:
    """A prefilled request as the decode actor receives it (the layout travels beside it)."""

    request_id: str
    first_token: SampledToken
    sampling: SamplingParams
    seed: int
    num_generated: int
    owner: str
    layout_format: str
    layout_bytes: int
    """Bytes of the layout's tensors as the prefill side packed them; the decode side checks them."""
    solo: bool = False
    fault: str | None = None


@dataclass
class PrefillOutcome:
    """What a prefill call returns to the frontend."""

    request_id: str
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
    stats: dict = field(default_factory=dict)
    """The worker's and tier's counters, refreshed at most once a second."""


@dataclass
class StepMessage:
    """New output of one frontend's requests on one decode actor since its previous poll."""

    seq: int
    deltas: dict[str, list]
    """key -> [first token index, token ids, logprobs or None, top logprobs or None, finish reason or None]."""
    failures: dict[str, tuple[str, str]]
    """key -> (message, kind): requests the actor dropped (see `failure_error`)."""
    report: Report | None = None

    @property
    def empty(self) -> bool:
        return not self.deltas and not self.failures


def delta_events(request_id: str, delta: list) -> list[TokenEvent]:
    """The token events one delta holds, as `request_id`'s."""
    first, ids, lps, tops, reason = delta
    last = len(ids) - 1
    if lps is None:
        return [TokenEvent(request_id, first + i, SampledToken(tok), reason if i == last else None) for i, tok in enumerate(ids)]
    return [TokenEvent(request_id, first + i, SampledToken(tok, lps[i], tops[i]), reason if i == last else None)
            for i, tok in enumerate(ids)]


class Outbox:
    """One subscriber's pending output on a decode actor: the step thread adds, the poll takes.

    Everything added between two takes merges into one message (tokens appended per request, the last
    finish reason kept), so a subscriber that lags costs one bigger message, never a queue of small ones.
    """

    def __init__(self, max_pending_tokens: int = 1 << 20) -> None:
        self._lock = threading.Lock()
        self._deltas: dict[str, list] = {}
        self._failures: dict[str, tuple[str, str]] = {}
        self._tokens = 0
        self.max_pending_tokens = max_pending_tokens
        self.seq = 0

    def add(self, events: list[TokenEvent], failures: dict[str, tuple[str, str]] | None = None) -> None:
        with self._lock:
            for ev in events:
                d = self._deltas.get(ev.request_id)
                if d is None:
                    with_lp = ev.token.logprob is not None
                    d = self._deltas[ev.request_id] = [ev.index, [], [] if with_lp else None, [] if with_lp else None, None]
                d[1].append(ev.token.token_id)
                if d[2] is not None:
                    d[2].append(ev.token.logprob)
                    d[3].append(ev.token.top_logprobs)
                d[4] = ev.finish_reason
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
