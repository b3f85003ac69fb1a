"""The decode worker: admission under a device budget and continuous batching, as a plain class.

Requests arrive prefilled (a layout, the first token, sampling params). Between steps, waiting
requests are admitted in arrival order while the store has room; each step decodes one token for
every running request; finished and aborted requests leave and return their memory at once.

Growth policy: **reserve**. Admission reserves the blocks a request needs at its final length
(prompt + max_tokens), so an admitted request never stalls or has to be preempted mid-stream. In a
PD split a preempted request would have to be prefilled again on the other side, which costs far
more than the capacity the reservation holds back; and the reservation is returned the moment a
request stops early.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from cachetier.layout import KVLayout
from cachetier.store import KVStore
from core.types import SampledToken, SamplingParams, TokenEvent, finish_reason
from model.model import V4Model
from model.sampling import sample

log = logging.getLogger(__name__)


@dataclass
class DecodeRequest:
    """A prefilled request handed to decode."""

    request_id: str
    layout: KVLayout
    first_token: SampledToken
    sampling: SamplingParams
    seed: int
    num_generated: int = 1
    """Tokens already generated (the first token included); more than 1 when a request is re-prefilled."""

    @property
    def reserve_tokens(self) -> int:
        return self.layout.num_tokens + self.sampling.max_tokens - self.num_generated + 1


@dataclass
class _Running:
    req: DecodeRequest
    last_token: int
    num_generated: int


class DecodeWorker:
    def __init__(self, model: V4Model, store: KVStore, max_running: int = 64, eos_ids: tuple[int, ...] | None = None,
                 check_when_idle: bool = True) -> None:
        self.model = model
        self.store = store
        self.max_running = max_running
        self.eos_ids = model.cfg.eos_token_ids if eos_ids is None else eos_ids
        self.waiting: deque[DecodeRequest] = deque()
        self.running: dict[str, _Running] = {}
        self.steps = 0
        self.tokens_out = 0
        self.check_when_idle = check_when_idle
        self.integrity_checks = 0

    # requests in and out -------------------------------------------------------------------------

    def submit(self, req: DecodeRequest) -> None:
        """Queue a prefilled request; raises `NeverFitsError` if no budget could ever hold it."""
        self.store.check_fits_ever(req.request_id, req.reserve_tokens)
        self.waiting.append(req)

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is; its memory in both tiers returns at once."""
        if request_id in self.running:
            del self.running[request_id]
            self.store.free(request_id)
            if self.check_when_idle and not self.running and not self.waiting:
                self.check_integrity()
            return True
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                return True
        return False

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            if not self.store.fits(req.reserve_tokens):
                break  # arrival order: nobody jumps the queue
            self.waiting.popleft()
            self.store.admit(req.request_id, req.layout, req.reserve_tokens)
            self.running[req.request_id] = _Running(req, req.first_token.token_id, req.num_generated)

    # the step ------------------------------------------------------------------------------------

    def step(self) -> list[TokenEvent]:
        """Admit what fits, decode one token for every running request; returns the new tokens."""
        self._admit()
        if not self.running:
            return []
        ids = list(self.running)
        runs = [self.running[i] for i in ids]
        logits = self.model.decode_step(self.store.batch(ids), [r.last_token for r in runs])
        toks = sample(logits, [r.req.sampling for r in runs], [r.req.seed for r in runs], [r.num_generated for r in runs])
        events = []
        for rid, run, tok in zip(ids, runs, toks):
            run.num_generated += 1
            run.last_token = tok.token_id
            reason = finish_reason(tok.token_id, run.num_generated, run.req.sampling, self.eos_ids)
            events.append(TokenEvent(rid, run.num_generated - 1, tok, reason))
            if reason is not None:
                del self.running[rid]
                self.store.free(rid)
        self.steps += 1
        self.tokens_out += len(events)
        if self.check_when_idle and not self.running and not self.waiting:
            self.check_integrity()  # idle: nothing in flight can hide a leak, and the check costs no latency
        return events

    def check_integrity(self) -> None:
        self.store.check_integrity()
        self.integrity_checks += 1

    def stats(self) -> dict:
        out = {"running": len(self.running), "waiting": len(self.waiting), "steps": self.steps, "tokens_out": self.tokens_out,
               "integrity_checks": self.integrity_checks}
        out.update(self.store.stats())
        return out
