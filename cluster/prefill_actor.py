"""The prefill worker behind a Ray actor: prefill a request, then hand its layout to decode itself.

`prefill(request, target)` runs the prompt on the step thread, samples the first token and, unless that
token ends the request, calls the target decode actor's `admit` with the layout as an argument — the one
hop of the handoff — and returns the first token once the decode actor holds the request. Nothing here
keeps layouts in a table: the layout is an argument of that call, and Ray frees it when the call is done
(on every path: success, refusal, a dead decode actor, the caller cancelling). The layout moves as one
contiguous buffer (`cachetier.layout.pack_layout`), packed on the step thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from cachetier.layout import layout_format, pack_layout
from cluster.protocol import COLLECTIVE_TRANSPORTS, DecodeTarget, Handoff, PrefillOutcome, StepFailure, WorkerLost
from cluster.steploop import StepThread, resolve
from core.roles import DeadlineConfig, FaultConfig, PrefillConfig, StubConfig
from core.types import DeadlineExceeded, HisparseError

log = logging.getLogger(__name__)
ACTOR_GONE = (RayActorError, ActorDiedError, ActorUnavailableError)


def load_model_for_actor(model_spec: str, num_threads: int, stub: StubConfig | None = None):
    import torch

    from model.builtin import resolve_model_dir
    from model.loader import load_model

    torch.set_num_threads(max(1, num_threads))
    model = load_model(resolve_model_dir(model_spec))
    if stub is not None:
        from model.stub import StubModel

        return StubModel(model, stub)
    return model


class PrefillActor:
    def __init__(self, model_spec: str, config: PrefillConfig, name: str, num_threads: int = 1,
                 eos_ids: tuple[int, ...] | None = None, deadlines: DeadlineConfig | None = None,
                 transport: str = "object_store", faults: FaultConfig | None = None, stub: StubConfig | None = None) -> None:
        from prefill.worker import PrefillWorker

        model = load_model_for_actor(model_spec, num_threads, stub)
        self.name = name
        self.config = config
        self.deadlines = deadlines or DeadlineConfig()
        self.transport = transport
        self.faults = faults or FaultConfig()
        self.worker = PrefillWorker(model, config, eos_ids=eos_ids)
        self.format = layout_format(model.cfg, model.dtype)
        self.futures: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self.in_handoff: dict[str, int] = {}
        self.exports: dict[str, object] = {}
        self.handoffs = 0
        self.bytes_sent = 0
        self._snapshot = {"queued_tokens": 0, "pending": 0, "tokens_in": 0, "progress": {}}
        self._locks: dict[str, asyncio.Lock] = {}
        self.thread = StepThread(f"prefill-{name}", self.worker.has_work, self._step)

    def _step(self) -> None:
        results = self.worker.step()
        for res in results:
            packed = None
            if res.finish_reason is None:  # it goes on to decode: pack here, off the event loop
                packed = pack_layout(res.layout, self.format)
                if self.transport != "object_store":
                    import torch

                    packed.buffer = torch.from_numpy(packed.buffer)  # tensor transports move torch tensors
            res.layout = None
            self._settle(res.request_id, value=(res, packed))
        for f in self.worker.take_failures():
            self._settle(f.request_id, error=StepFailure(f.message))
        self._refresh()

    def _refresh(self) -> None:
        """Publish the queue for `stats` (step thread only; read without waiting for a step)."""
        w = self.worker
        self._snapshot = {"queued_tokens": w.queued_tokens(), "pending": len(w.pending), "tokens_in": w.tokens_in,
                          "progress": w.progress()}

    def _abort_now(self, request_id: str) -> None:
        self.worker.abort(request_id)
        self.futures.pop(request_id, None)
        self._refresh()

    def _settle(self, rid: str, value=None, error: BaseException | None = None) -> None:
        loop, fut = self.futures.pop(rid, (None, None))
        if fut is not None:
            resolve(loop, fut, value, error)

    async def ready(self) -> dict:
        return {"name": self.name, "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "layout_format": self.format}

    async def prefill(self, req, target: DecodeTarget | None = None) -> PrefillOutcome:
        """Prefill `req`; unless its first token ends it, hand it to `target` and return once decode holds it."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def submit() -> None:
            try:
                self.worker.submit(req)
                self.futures[req.request_id] = (loop, fut)
                self._refresh()
            except BaseException as e:
                resolve(loop, fut, error=e)

        self.thread.call(submit)
        try:
            res, packed = await fut
        except asyncio.CancelledError:  # the caller left while the prompt was being prefilled
            self.thread.call(lambda: self._abort_now(req.request_id))
            raise
        out = PrefillOutcome(req.request_id, res.first_token, res.finish_reason, res.prompt_logprobs, res.prompt_len, False)
        if res.finish_reason is not None or target is None:
            return out
        h = Handoff(req.request_id, res.first_token, res.sampling, res.seed, res.num_generated, target.owner, self.format,
                    packed.tensor_bytes, solo=req.solo, fault=self.faults.tag(req.prompt_token_ids))
        t0 = time.perf_counter()
        self.in_handoff[req.request_id] = packed.tensor_bytes
        try:
            await asyncio.wait_for(self._send(target, h, packed), self.deadlines.handoff_timeout_s)
        except ACTOR_GONE as e:
            raise WorkerLost(f"decode actor {target.name} was lost while taking over {req.request_id}: "
                             f"{type(e).__name__}") from None
        except asyncio.TimeoutError:
            raise DeadlineExceeded(f"decode actor {target.name} did not take {req.request_id} within "
                                   f"{self.deadlines.handoff_timeout_s:.0f} s (--handoff-timeout-s)") from None
        finally:
            self.in_handoff.pop(req.request_id, None)
            self.exports.pop(req.request_id, None)
        self.handoffs += 1
        self.bytes_sent += packed.tensor_bytes
        out.handed_off, out.layout_bytes, out.handoff_s = True, packed.tensor_bytes, time.perf_counter() - t0
        return out

    async def _send(self, target: DecodeTarget, h: Handoff, packed) -> None:
        if self.transport == "object_store":
            await target.handle.admit.remote(h, packed)
            return
        # Ray's direct tensor transport moves tensors a method *returns*: export through our own handle.
        me = ray.get_runtime_context().current_actor
        self.exports[h.request_id] = packed
        lock = None
        if self.transport in COLLECTIVE_TRANSPORTS:  # collectives pair sends and receives in order: one at a time per pair
            lock = self._locks.setdefault(target.name, asyncio.Lock())
            await lock.acquire()
        try:
            ref = me.export.options(tensor_transport=self.transport).remote(h.request_id)
            await target.handle.admit.remote(h, ref)
        finally:
            if lock is not None:
                lock.release()

    async def export(self, request_id: str):
        """The packed layout of a request being handed off (only for direct tensor transports)."""
        packed = self.exports.get(request_id)
        if packed is None:
            raise HisparseError(f"no layout of {request_id} is being handed off")
        return packed

    async def abort(self, request_id: str) -> None:
        self.thread.call(lambda: self._abort_now(request_id))

    async def stats(self) -> dict:
        """Queue and progress as of the last step (never waits for a step to end), plus handoffs in flight."""
        return {**self._snapshot, "name": self.name, "held_layouts": len(self.in_handoff), "futures": len(self.futures),
                "held_bytes": sum(self.in_handoff.values()), "handoffs": self.handoffs, "bytes_sent": self.bytes_sent,
                "stalled_s": self.thread.stalled_s()}
