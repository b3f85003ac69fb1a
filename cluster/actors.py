"""Ray actors around the two workers.

Each actor owns its worker on one *step thread* that runs steps back to back while there is work
and sleeps on an event when there is none; the actor's asyncio loop only moves requests in and
tokens out (through thread-safe queues), so streaming never polls. Requests reach the step thread
as commands, so the worker itself is never touched by two threads.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import ray

from cachetier.layout import KVLayout
from cachetier.store import IntegrityError
from cluster.handoff import Handoff, Received
from core.roles import PrefillConfig, TierConfig
from core.types import HisparseError, TokenEvent

log = logging.getLogger(__name__)


def _load(model_spec: str, num_threads: int):
    import torch

    from model.builtin import resolve_model_dir
    from model.loader import load_model

    torch.set_num_threads(max(1, num_threads))
    return load_model(resolve_model_dir(model_spec))


class _StepThread:
    """Runs `step()` whenever there is work; executes commands between steps."""

    def __init__(self, name: str, has_work: Callable[[], bool], step: Callable[[], None]) -> None:
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        self._has_work, self._step = has_work, step
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def call(self, fn: Callable[[], Any]) -> None:
        self.commands.put(fn)
        self.wake.set()

    def _run(self) -> None:
        while True:
            while True:
                try:
                    fn = self.commands.get_nowait()
                except queue.Empty:
                    break
                try:
                    fn()
                except BaseException as e:  # a command's failure goes back through its own future
                    log.exception("command failed: %s", e)
            if self._has_work():
                self._step()
                continue
            self.wake.wait(timeout=1.0)
            self.wake.clear()


async def _on_thread(thread: _StepThread, fn: Callable[[], Any]):
    """Run `fn` on the step thread between steps (the worker is never touched by two threads)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def run() -> None:
        try:
            _resolve(loop, fut, fn())
        except BaseException as e:
            _resolve(loop, fut, error=e)

    thread.call(run)
    return await fut


def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, value=None, error: BaseException | None = None) -> None:
    def done() -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)

    loop.call_soon_threadsafe(done)


class PrefillActor:
    """Prefill worker behind an actor: `prefill(request)` returns a `Handoff` with the layout in the object store."""

    def __init__(self, model_spec: str, config: PrefillConfig, name: str, num_threads: int = 1) -> None:
        from prefill.worker import PrefillWorker

        self.name = name
        self.config = config
        self.worker = PrefillWorker(_load(model_spec, num_threads), config)
        self.futures: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self.held: dict[str, tuple[Any, float, int]] = {}
        self.freed_by_lease = 0
        self.bytes_sent = 0
        self.thread = _StepThread(f"prefill-{name}", self.worker.has_work, self._step)
        self._sweeper: asyncio.Task | None = None

    def _step(self) -> None:
        try:
            results = self.worker.step()
        except BaseException as e:
            log.exception("prefill step failed")
            for rid in list(self.worker.pending):
                self.worker.abort(rid)
                loop, fut = self.futures.pop(rid, (None, None))
                if fut is not None:
                    _resolve(loop, fut, error=e)
            return
        for res in results:
            loop, fut = self.futures.pop(res.request_id, (None, None))
            if fut is not None:
                _resolve(loop, fut, value=res)

    async def ready(self) -> dict:
        return {"name": self.name, "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    async def prefill(self, req) -> Handoff:
        loop = asyncio.get_running_loop()
        if self._sweeper is None:
            self._sweeper = loop.create_task(self._sweep_leases())
        fut = loop.create_future()

        def submit() -> None:
            try:
                self.worker.submit(req)
                self.futures[req.request_id] = (loop, fut)
            except BaseException as e:
                _resolve(loop, fut, error=e)

        self.thread.call(submit)
        try:
            res = await fut
        except asyncio.CancelledError:
            self.thread.call(lambda: (self.worker.abort(req.request_id), self.futures.pop(req.request_id, None)))
            raise
        nbytes = res.layout.total_bytes()
        self.held[req.request_id] = (res.layout, time.monotonic() + self.config.layout_lease_s, nbytes)
        return Handoff(
            request_id=req.request_id, first_token=res.first_token, sampling=res.sampling, seed=res.seed,
            prompt_len=res.prompt_len, num_generated=res.num_generated, layout_tokens=res.layout.num_tokens,
            layout_bytes=nbytes, source=ray.get_runtime_context().current_actor, prefill_actor=self.name,
        )

    async def export(self, request_id: str) -> KVLayout:
        """The held layout, as this call's return value (moved by the object store or a tensor transport)."""
        held = self.held.get(request_id)
        if held is None:
            raise HisparseError(f"the layout of {request_id} is no longer held (lease of {self.config.layout_lease_s:.0f} s "
                                "expired or already released)")
        self.bytes_sent += held[2]
        return held[0]

    async def release(self, request_id: str) -> bool:
        """The decode side has the layout: drop this actor's hold on it."""
        return self.held.pop(request_id, None) is not None

    async def abort(self, request_id: str) -> None:
        self.held.pop(request_id, None)
        self.thread.call(lambda: (self.worker.abort(request_id), self.futures.pop(request_id, None)))

    async def _sweep_leases(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.config.layout_lease_s / 4))
            now = time.monotonic()
            for rid in [r for r, (_, deadline, _) in self.held.items() if deadline < now]:
                self.held.pop(rid, None)
                self.freed_by_lease += 1
                log.warning("layout of %s was not picked up within %.0f s; freed", rid, self.config.layout_lease_s)

    async def stats(self) -> dict:
        queued, pending, tokens_in = await _on_thread(
            self.thread, lambda: (self.worker.queued_tokens(), len(self.worker.pending), self.worker.tokens_in))
        return {"name": self.name, "queued_tokens": queued, "pending": pending, "tokens_in": tokens_in,
                "held_layouts": len(self.held), "held_bytes": sum(n for _, _, n in self.held.values()),
                "freed_by_lease": self.freed_by_lease, "bytes_sent": self.bytes_sent}


class DecodeActor:
    """Decode worker behind an actor: `generate(handoff)` streams the request's tokens as they come."""

    def __init__(self, model_spec: str, tier: TierConfig, name: str, num_threads: int = 1) -> None:
        from cachetier.store import TieredStore
        from decode.worker import DecodeWorker

        model = _load(model_spec, num_threads)
        self.name = name
        self.store = TieredStore(model.cfg, tier, dtype=model.dtype, device=model.device)
        self.worker = DecodeWorker(model, self.store, max_running=tier.max_running)
        self.streams: dict[str, asyncio.Queue] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.bytes_received: dict[str, int] = {}
        self.handoff_s: dict[str, float] = {}
        self.integrity_errors = 0
        self.thread = _StepThread(f"decode-{name}", self.worker.has_work, self._step)

    def _emit(self, rid: str, item) -> None:
        def put() -> None:
            q = self.streams.get(rid)
            if q is not None:
                q.put_nowait(item)

        if self.loop is not None:
            self.loop.call_soon_threadsafe(put)

    def _step(self) -> None:
        try:
            events = self.worker.step()
        except IntegrityError as e:  # the idle integrity check failed: count it, keep serving
            self.integrity_errors += 1
            log.error("integrity check failed on an idle decode worker: %s", e)
            return
        except BaseException as e:
            log.exception("decode step failed; failing its requests")
            for rid in list(self.worker.running) + [r.request_id for r in self.worker.waiting]:
                self.worker.abort(rid)
                self._emit(rid, e)
            return
        for ev in events:
            self._emit(ev.request_id, ev)

    async def ready(self) -> dict:
        return {"name": self.name, "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "geometry": self.store.geo.describe()}

    async def generate(self, h: Handoff, layout: KVLayout) -> AsyncIterator[TokenEvent]:
        """Stream the tokens of a handed-off request; Ray has fetched `layout` (an export's result) already."""
        from decode.worker import DecodeRequest

        self.loop = asyncio.get_running_loop()
        rid = h.request_id
        self.handoff_s[rid] = max(0.0, time.time() - h.sent_at) if h.sent_at else 0.0
        got = layout.total_bytes()
        self.bytes_received[rid] = got
        if got != h.layout_bytes:
            raise HisparseError(f"layout of {rid} arrived with {got} bytes, {h.layout_bytes} were sent")
        if h.source is not None:
            h.source.release.remote(rid)
        yield Received(rid, got)
        q: asyncio.Queue = asyncio.Queue()
        self.streams[rid] = q
        req = DecodeRequest(rid, layout, h.first_token, h.sampling, h.seed, h.num_generated)
        del layout

        def submit() -> None:
            try:
                self.worker.submit(req)
            except BaseException as e:
                self._emit(rid, e)

        self.thread.call(submit)
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    finished = True
                    return
        finally:
            self.streams.pop(rid, None)
            if not finished:  # the consumer went away or failed: stop decoding it, free both tiers
                self.thread.call(lambda: self.worker.abort(rid))

    async def abort(self, request_id: str) -> bool:
        return await _on_thread(self.thread, lambda: self.worker.abort(request_id))

    async def stats(self) -> dict:
        """Worker and tier numbers, read on the step thread between steps."""
        st = await _on_thread(self.thread, self.worker.stats)
        st.update(name=self.name, integrity_errors=self.integrity_errors,
                  handoff_bytes=sum(self.bytes_received.values()), handoffs=len(self.bytes_received))
        return st

    async def check_integrity(self) -> bool:
        await _on_thread(self.thread, self.worker.check_integrity)
        return True

    async def handoff_record(self, request_id: str) -> dict:
        return {"bytes": self.bytes_received.get(request_id), "seconds": self.handoff_s.get(request_id)}
