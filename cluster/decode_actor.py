"""The decode worker behind a Ray actor: reservations, layouts arriving by call, output by poll.

- `reserve(owner, key, tokens)` holds a request's pages before its prefill (answered at once, from the
  actor's event loop; the worker's reservations are thread-safe);
- `admit(handoff, layout)` is called by a prefill actor with the layout as an argument; the request is
  queued for the step thread, which writes arrivals in batches between steps;
- `poll(owner)` returns everything new for that owner (a gateway's frontend) since its last poll, merged
  into one `StepMessage`, waiting up to `POLL_INTERVAL_S` when there is nothing; the step thread wakes
  the waiting poll once per step, never once per token;
- `abort(keys)` stops requests wherever they are.

A decode actor may be one *rank* of a replica (`layout`, `rank`; see `core.parallel` and
`cluster.replica`): it loads only its shard, joins the replica's process group (`join`), and schedules its
own requests like any decode actor (DP attention). With expert parallelism its step thread runs in
lockstep with the other ranks (`DecodeWorker.join_replica`); a step that fails there ends the process,
and the replica is rebuilt as a whole.

A frontend that stops polling for `subscriber_timeout_s` is dropped and its requests aborted, so a dead
gateway cannot pin memory here. Every reply carries a `Report` (capacity, and how long the step thread
has been inside one step: a hung step thread shows up while this loop still answers).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import ray

from cachetier.layout import layout_format
from cluster.prefill_actor import describe_worker
from cluster.protocol import Capacity, DecodeInfo, DecodeStats, Dropped, Handoff, Outbox, Report, RequestGone, StepMessage
from cluster.replica import ReplicaRank
from cluster.steploop import StepThread, on_thread
from core.configs import POLL_INTERVAL_S, DeadlineConfig, FaultConfig, StepConfig, StubConfig, TierConfig
from core.types import HisparseError

log = logging.getLogger(__name__)



class DecodeActor(ReplicaRank):
    def __init__(self, model_spec: str, tier: TierConfig, name: str, num_threads: int = 1,
                 eos_ids: tuple[int, ...] | None = None, deadlines: DeadlineConfig | None = None,
                 faults: FaultConfig | None = None, stub: StubConfig | None = None, weights: str = "packed",
                 step: StepConfig | None = None, kv_format: str = "auto", layout: str | None = None,
                 rank: int = 0, dtype: str = "auto") -> None:
        shard = self._init_rank(layout, rank)
        if self.layout is not None and stub is not None:
            raise HisparseError("a stand-in step (--stub-step-ms) runs no model, so it cannot be split over a replica")
        self.name = name
        self.deadlines = deadlines or DeadlineConfig()
        self.outboxes: dict[str, Outbox] = {}
        self.waiters: dict[str, asyncio.Event] = {}
        self.last_poll: dict[str, float] = {}
        self.owner_of: dict[str, str] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.handoffs = 0
        self.handoff_bytes = 0
        self.dropped_subscribers = 0
        self._stats: DecodeStats | None = None
        self._sweeper: asyncio.Task | None = None
        self._pending: list[tuple[list, list]] = []
        """Output of finished steps not yet handed to the event loop (step thread only; see `_hand_on`)."""

        def build() -> None:  # on the step thread: the model, the store and the warm-up are all device work
            from cachetier.store import TieredStore
            from cluster.prefill_actor import grammar_engine, load_model_for_actor
            from decode.worker import DecodeWorker

            model = load_model_for_actor(model_spec, num_threads, stub, weights, kv_format, shard=shard, dtype=dtype,
                                         mtp=tier.speculative_tokens > 0)
            self.model = model
            self.store = TieredStore(model.cfg, tier, dtype=model.dtype, device=model.device)
            # a stand-in step writes no KV, so the idle check of what is stored would not hold
            self.worker = DecodeWorker(model, self.store, max_running=tier.max_running, eos_ids=eos_ids, faults=faults,
                                       check_when_idle=stub is None, step_config=step,
                                       grammar=grammar_engine(model_spec, model, eos_ids))
            self.worker.before_forward = self._hand_on
            self.format = layout_format(model.cfg, model.dtype)

        self.thread = StepThread(f"decode-{name}", self._has_work, self._step, self._tick, idle=self._idle, setup=build)
        log.info("decode actor %s: %s", name, describe_worker(self.model, self.worker.runner.mode))

    # the step thread -----------------------------------------------------------------------------

    def _step(self) -> None:
        events = self._run_step(self.worker.step)
        failures = self.worker.take_failures()
        if events or failures:
            self._pending.append((events, failures))
        if not self.worker.running:  # no forward comes next to hand it on: now
            self._hand_on()

    def _hand_on(self) -> None:
        """Pass the output of the steps so far to the event loop, which routes it (step thread).

        Called right before the next forward (`DecodeWorker.before_forward`), so that the routing, the
        poll replies and their serialisation run on the loop while the step thread waits on the forward
        (GIL released) instead of contending with it between steps; a step's tokens go out a few hundred
        microseconds later, and the step-to-step gap keeps only what the next step needs."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        if self.loop is None:
            self._route_all(pending)
        else:
            self.loop.call_soon_threadsafe(self._route_all, pending)

    def _route_all(self, pending) -> None:
        for events, failures in pending:
            self._route(events, failures)

    def _route(self, events, failures) -> None:
        """Put one step's output into its owners' outboxes and wake their polls (one wake per step)."""
        by_owner: dict[str, list] = {}
        for ev in events:
            by_owner.setdefault(self.owner_of.get(ev.request_id, ""), []).append(ev)
            if ev.finish_reason is not None:
                self.owner_of.pop(ev.request_id, None)
        failed: dict[str, dict] = {}
        for f in failures:
            failed.setdefault(f.owner, {})[f.request_id] = Dropped(f.message, f.kind)
            self.owner_of.pop(f.request_id, None)
        for owner in set(by_owner) | set(failed):
            box = self.outboxes.get(owner)
            if box is not None:
                box.add(by_owner.get(owner, []), failed.get(owner))
            ev = self.waiters.get(owner)
            if ev is not None:
                ev.set()

    def _tick(self) -> None:
        self._stats = self._full_stats()

    def _idle(self) -> bool:
        return self.worker.idle_work()

    def _full_stats(self) -> DecodeStats:
        """Worker, tier and actor numbers (step thread only)."""
        return DecodeStats.of(self.worker.stats(), name=self.name, handoffs=self.handoffs, handoff_bytes=self.handoff_bytes,
                              subscribers=len(self.outboxes), owners=len(self.owner_of),
                              dropped_subscribers=self.dropped_subscribers)

    # calls ---------------------------------------------------------------------------------------

    async def ready(self) -> DecodeInfo:
        self.loop = asyncio.get_running_loop()
        await self._joined.wait()  # a replica rank serves only once its replica is whole
        if self._sweeper is None:
            self._sweeper = self.loop.create_task(self._sweep_subscribers())
        g = self.store.geo
        return DecodeInfo(name=self.name, node_id=ray.get_runtime_context().get_node_id(), pid=os.getpid(),
                          layout_format=self.format, describe=describe_worker(self.model, self.worker.runner.mode),
                          capacity=Capacity(g.num_pages, g.group_pages, g.block_tokens, self.worker.max_running,
                                            keeps=self.store.retention.enabled,
                                            shares=self.store.sharing is not None),
                          **self._rank_info())

    def report(self) -> Report:
        cap = self.store.capacity()
        w = self.worker
        return Report(self.name, cap["pages_free"], cap["pages_total"], cap["host_blocks_free"], len(w.running),
                      len(w.waiting) + len(w.arrivals), len(w.reserved), self.thread.stalled_s(), self._stats)

    async def reserve(self, owner: str, key: str, reserve_tokens: int,
                      prefix_keys: tuple[str, ...] = ()) -> tuple[bool, Report, int]:
        """Hold pages for `key` until its layout arrives (or its lease lapses); False if there is no room now.
        `prefix_keys`: its context's page keys; the third value is how many of its first tokens' classical entries
        are kept here from an earlier turn (its handoff leaves them out)."""
        self.loop = asyncio.get_running_loop()
        self.outboxes.setdefault(owner, Outbox())
        self.last_poll.setdefault(owner, time.monotonic())
        ok = self.worker.reserve(key, reserve_tokens, owner, lease_s=self.deadlines.reservation_lease_s,
                                 prefix_keys=tuple(prefix_keys))
        held = 0
        if ok:
            held = self.store.held_tokens(key)
            self.owner_of[key] = owner
            self.thread.wake.set()  # the step thread watches the lease
        return ok, self.report(), held

    async def admit(self, h: Handoff, packed) -> float:
        """A prefilled request for pages reserved earlier; returns once it is queued for the step thread."""
        from decode.worker import DecodeRequest

        if h.layout_format != self.format:
            raise HisparseError(f"layout of {h.request_id} has format {h.layout_format!r} but this decode actor reads "
                                f"{self.format!r}; prefill and decode must serve the same model and dtype")
        if packed.tensor_bytes != h.layout_bytes:
            raise HisparseError(f"layout of {h.request_id} arrived with {packed.tensor_bytes} bytes, {h.layout_bytes} were sent")
        # unpacked on the step thread when it is written: this loop touches no tensor (a layout moved by a
        # tensor transport lives on the device, and every device operation runs on the step thread)
        req = DecodeRequest(h.attempt, h.first_token, h.num_generated, packed=packed)
        if not self.worker.arrive(req):
            raise RequestGone(f"decode actor {self.name} no longer holds pages for {h.request_id} (aborted, or its "
                              f"reservation lapsed after {self.deadlines.reservation_lease_s:.0f} s)")
        self.thread.wake.set()
        self.handoffs += 1
        self.handoff_bytes += h.layout_bytes
        return time.time()

    async def poll(self, owner: str) -> StepMessage:
        """Everything new for `owner` since its last poll; waits up to `POLL_INTERVAL_S` for something."""
        self.loop = asyncio.get_running_loop()
        self.last_poll[owner] = time.monotonic()
        box = self.outboxes.setdefault(owner, Outbox())
        if not box.pending():
            ev = self.waiters.setdefault(owner, asyncio.Event())
            ev.clear()
            try:
                await asyncio.wait_for(ev.wait(), POLL_INTERVAL_S)
            except asyncio.TimeoutError:
                pass
        self.last_poll[owner] = time.monotonic()
        return box.take(self.report())

    async def abort(self, keys: list[str]) -> None:
        """Stop these requests wherever they are (reserved, arriving or running); memory returns at once."""
        def run() -> None:
            for k in keys:
                self.worker.abort(k)
                self.owner_of.pop(k, None)

        self.thread.call(run)

    async def _sweep_subscribers(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for owner, last in list(self.last_poll.items()):
                box = self.outboxes.get(owner)
                silent = now - last > self.deadlines.subscriber_timeout_s
                if not silent and not (box is not None and box.overflowing):
                    continue
                keys = await on_thread(self.thread, lambda o=owner: self.worker.owned_by(o))
                log.warning("frontend %s stopped collecting its output; dropping it and aborting %d request(s)", owner, len(keys))
                await self.abort(keys)
                self.outboxes.pop(owner, None)
                self.waiters.pop(owner, None)
                self.last_poll.pop(owner, None)
                self.dropped_subscribers += 1

    async def pause_step_thread(self, seconds: float) -> None:
        """Fault injection (chaos tests and benchmarks): block the step thread for `seconds`, as a hung step would."""
        self.thread.call(lambda: time.sleep(seconds))

    async def stats(self) -> DecodeStats:
        """Worker, tier and actor numbers, read on the step thread between steps."""
        return await on_thread(self.thread, self._full_stats)

    async def check_integrity(self) -> bool:
        await on_thread(self.thread, self.worker.check_integrity)
        return True
