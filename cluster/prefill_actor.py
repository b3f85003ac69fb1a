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
import dataclasses
import logging
import os
import time

import ray

from cachetier.layout import layout_format, pack_layout, without_prefix
from cluster.describe import describe_worker
from cluster.protocol import ACTOR_GONE, DecodeTarget, Handoff, PrefillInfo, PrefillOutcome, PrefillStats, StepFailure, WorkerLost
from cluster.replica import ReplicaRank
from cluster.steploop import StepThread, resolve
from core.configs import DeadlineConfig, FaultConfig, PrefillConfig, StubConfig
from core.request import Attempt
from core.types import DeadlineExceeded, HisparseError

log = logging.getLogger(__name__)


def load_model_for_actor(model_spec: str, num_threads: int, stub: StubConfig | None = None, weights: str = "packed",
                         kv_format: str = "auto", shard=None, dtype: str = "auto", mtp: bool = False):
    """The actor's model, on the device this actor was given (Ray shows an actor only the GPUs it reserved:
    CUDA when present) in the serving dtype (`core.device.serving_dtype`)."""
    import torch

    from core import device
    from core.parallel import WHOLE
    from model.builtin import resolve_model_dir
    from model.loader import load_model

    torch.set_num_threads(max(1, num_threads))
    dev = device.current()
    dt = device.serving_dtype(dtype, dev.kind)
    device.configure_math(dev.kind)
    model = load_model(resolve_model_dir(model_spec), dtype=dt, device=dev.torch_device, weights=weights,
                       kv_format=kv_format, shard=shard or WHOLE, mtp=mtp)
    if stub is not None:
        from model.stub import StubModel

        return StubModel(model, stub)
    return model


def grammar_engine(model_spec: str, model, eos_ids: tuple[int, ...] | None):
    """A worker's grammar engine over the model directory's tokenizer (None when it has none)."""
    from model.builtin import resolve_model_dir
    from model.grammar import GrammarEngine

    stops = model.cfg.eos_token_ids if eos_ids is None else eos_ids
    return GrammarEngine.for_model_dir(resolve_model_dir(model_spec), model.cfg.vocab_size, stops)


class PrefillActor(ReplicaRank):
    def __init__(self, model_spec: str, config: PrefillConfig, name: str, num_threads: int = 1,
                 eos_ids: tuple[int, ...] | None = None, deadlines: DeadlineConfig | None = None,
                 transport: str = "object_store", faults: FaultConfig | None = None, stub: StubConfig | None = None,
                 weights: str = "packed", kv_format: str = "auto", layout: str | None = None, rank: int = 0,
                 dtype: str = "auto") -> None:
        shard = self._init_rank(layout, rank)
        if self.layout is not None and stub is not None:
            raise HisparseError("a stand-in prefill (--stub-prefill-ms) runs no model, so it cannot be split over a replica")
        pc = config.prefix_cache
        if pc.disk_enabled:  # one directory per actor: two actors never write the same files
            config = dataclasses.replace(config, prefix_cache=dataclasses.replace(
                pc, directory=os.path.join(pc.directory, name)))
        self.name = name
        self.config = config
        self.deadlines = deadlines or DeadlineConfig()
        self.transport = transport
        self.faults = faults or FaultConfig()
        self.futures: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self.in_handoff: dict[str, int] = {}
        self.exports: dict[str, tuple[object, float]] = {}  # direct tensor transports: layouts waiting to be moved
        self.skip: dict[str, int] = {}
        """Tokens whose classical entries the target decode actor kept from an earlier turn, per request: its handoff
        leaves them out (`cachetier.layout.without_prefix`). Set on the loop before the request reaches the step thread."""
        self.handoffs = 0
        self.bytes_sent = 0
        self._snapshot = PrefillStats(name=name)

        def build() -> None:  # on the step thread, which does all of this actor's device work
            from prefill.worker import PrefillWorker

            self.model = load_model_for_actor(model_spec, num_threads, stub, weights, kv_format, shard=shard, dtype=dtype)
            self.worker = PrefillWorker(self.model, config, eos_ids=eos_ids, grammar=grammar_engine(model_spec, self.model, eos_ids))
            self.format = layout_format(self.model.cfg, self.model.dtype)

        self.thread = StepThread(f"prefill-{name}", self._has_work, self._step, setup=build)
        log.info("prefill actor %s: %s", name, describe_worker(self.model))

    def _step(self) -> None:
        try:
            results = self._run_step(self.worker.step)
        except Exception as e:  # past the worker's own handling: every request it held may be half done
            log.exception("a prefill step failed; failing the %d request(s) it held", len(self.worker.pending))
            for key in list(self.worker.pending):
                self.worker.abort(key)
                self._settle(key, error=StepFailure(f"a prefill step it was in failed: {type(e).__name__}: {e}"))
            self._refresh()
            return
        if self.worker.tp_role == "follower":  # its leader answers for the group; this rank only computes
            self.worker.take_failures()
            self._refresh()
            return
        for res in results:
            packed = None
            try:
                if res.finish_reason is None:  # it goes on to decode: pack here, off the event loop
                    packed = pack_layout(without_prefix(res.layout, self.model.cfg, self.skip.pop(res.key, 0)), self.format)
                    if self.transport != "object_store":
                        import torch

                        packed.buffer = torch.from_numpy(packed.buffer)  # tensor transports move torch tensors
            except Exception as e:  # this request cannot be handed on: it fails (and may be retried), the others go on
                log.exception("packing the layout of %s failed", res.key)
                self._settle(res.key, error=StepFailure(f"packing its layout failed: {type(e).__name__}: {e}"))
                continue
            finally:
                res.layout = None
                self.skip.pop(res.key, None)
            self._settle(res.key, value=(res, packed))
        for f in self.worker.take_failures():
            self._settle(f.request_id, error=StepFailure(f.message))
        self._refresh()

    def _refresh(self) -> None:
        """Publish the queue for `stats` (step thread only; read without waiting for a step)."""
        w = self.worker
        self._snapshot = PrefillStats(
            name=self.name, queued_tokens=w.queued_tokens(), pending=len(w.pending), tokens_in=w.tokens_in,
            progress={g.request_id: (g.done_tokens, g.total_tokens) for g in w.progress()},
            prefix_cache=w.prefix_cache.stats() if w.prefix_cache is not None else None)

    def _abort_now(self, request_id: str) -> None:
        self.worker.abort(request_id)
        self.futures.pop(request_id, None)
        self._refresh()

    def _settle(self, rid: str, value=None, error: BaseException | None = None) -> None:
        loop, fut = self.futures.pop(rid, (None, None))
        if fut is not None:
            resolve(loop, fut, value, error)

    async def ready(self) -> PrefillInfo:
        await self._joined.wait()  # a replica rank serves only once its replica is whole
        cache = self.worker.prefix_cache
        return PrefillInfo(name=self.name, node_id=ray.get_runtime_context().get_node_id(), pid=os.getpid(),
                           layout_format=self.format, describe=describe_worker(self.model),
                           prefix_page_tokens=cache.page if cache is not None else None,
                           prefix_affinity_slack=self.config.prefix_cache.affinity_slack_tokens,
                           prefix_pages=tuple(cache.held_pages()) if cache is not None else (), **self._rank_info())

    async def prefill(self, req: Attempt, target: DecodeTarget | None = None) -> PrefillOutcome:
        """Prefill `req`; unless its first token ends it, hand it to `target` and return once decode holds it."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def submit() -> None:
            try:
                self.worker.submit(req)
                self.futures[req.key] = (loop, fut)
                self._refresh()
            except BaseException as e:
                resolve(loop, fut, error=e)

        if target is not None and target.held_tokens:
            self.skip[req.key] = target.held_tokens
        self.thread.call(submit)
        try:
            res, packed = await fut
        except asyncio.CancelledError:  # the caller left while the prompt was being prefilled
            self.thread.call(lambda: self._abort_now(req.key))
            raise
        finally:
            self.skip.pop(req.key, None)
        out = PrefillOutcome(req.key, res.first_token, res.finish_reason, res.prompt_logprobs, res.prompt_len, False)
        if res.finish_reason is not None or target is None:
            return out
        attempt = dataclasses.replace(req, owner=target.owner, fault=self.faults.tag(req.prompt_token_ids)).stripped()
        h = Handoff(attempt, res.first_token, res.num_generated, self.format, packed.tensor_bytes)
        if self.transport != "object_store":  # the caller moves it: see `export`
            self.exports[req.key] = (packed, time.monotonic() + self.deadlines.handoff_timeout_s)
            self._sweep_exports()
            out.awaiting_export, out.layout_bytes = h, packed.tensor_bytes
            return out
        t0 = time.perf_counter()
        self.in_handoff[req.key] = packed.tensor_bytes
        try:
            await asyncio.wait_for(target.handle.admit.remote(h, packed), self.deadlines.handoff_timeout_s)
        except ACTOR_GONE as e:
            raise WorkerLost(f"decode actor {target.name} was lost while taking over {req.key}: "
                             f"{type(e).__name__}") from None
        except asyncio.TimeoutError:
            raise DeadlineExceeded(f"decode actor {target.name} did not take {req.key} within "
                                   f"{self.deadlines.handoff_timeout_s:.0f} s (--handoff-timeout-s)") from None
        finally:
            self.in_handoff.pop(req.key, None)
        self.handoffs += 1
        self.bytes_sent += packed.tensor_bytes
        out.handed_off, out.layout_bytes, out.handoff_s = True, packed.tensor_bytes, time.perf_counter() - t0
        return out

    async def export(self, request_id: str):
        """The packed layout waiting for a direct tensor transport (the caller passes this call's result on)."""
        held = self.exports.get(request_id)
        if held is None:
            raise HisparseError(f"the layout of {request_id} is no longer here (released, or not moved within "
                                f"{self.deadlines.handoff_timeout_s:.0f} s, --handoff-timeout-s)")
        self.handoffs += 1
        self.bytes_sent += held[0].tensor_bytes
        return held[0]

    async def release(self, request_id: str) -> None:
        """The caller is done moving a layout (or gave up on it)."""
        self.exports.pop(request_id, None)

    def _sweep_exports(self) -> None:
        """Layouts nobody moved within the handoff deadline are dropped (the caller died between the calls)."""
        now = time.monotonic()
        for rid in [r for r, (_, deadline) in self.exports.items() if deadline < now]:
            del self.exports[rid]

    async def abort(self, request_id: str) -> None:
        self.exports.pop(request_id, None)
        self.thread.call(lambda: self._abort_now(request_id))

    async def stats(self) -> PrefillStats:
        """Queue and progress as of the last step (never waits for a step to end), plus handoffs in flight."""
        self._sweep_exports()
        return dataclasses.replace(
            self._snapshot, held_layouts=len(self.in_handoff) + len(self.exports), futures=len(self.futures),
            held_bytes=sum(self.in_handoff.values()) + sum(p.tensor_bytes for p, _ in self.exports.values()),
            handoffs=self.handoffs, bytes_sent=self.bytes_sent, stalled_s=self.thread.stalled_s())
