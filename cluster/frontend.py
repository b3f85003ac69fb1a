"""A gateway process's client of the cluster: the attempt and failover loop over its parts.

The parts, each in its own module: `cluster.outputs` (collectors of decode output), `cluster.membership`
(which actors are usable: poll loops, loss, hang, rejoin), `cluster.placement` (the admission check, the
decode reservation and its queue, the prefill choice). This module composes them and runs requests.

Each gateway process runs one `Frontend` with its own id. Per request (`generate`):
1. capacity first: the decode actor with the most free pages (by its latest report) that fits the
   request at its final length reserves its pages (`reserve`); with no room anywhere the request waits
   in one bounded queue until a report shows room, and past `queue_timeout_s` fails with 503 before
   any token exists;
2. the least loaded prefill actor prefills it and hands the layout straight to that decode actor
   (see `cluster.prefill_actor`), returning the first token;
3. the rest arrives through this frontend's one poll loop per decode actor (`cluster.decode_actor`):
   each message holds every new token of this frontend's requests on that actor, demultiplexed here
   into per-request `Collector`s, which merge what is pending for a consumer that lags.

Failures: a lost or hung worker, a failed step or a lapsed reservation fail the attempt; the request
is prefilled again (prompt + tokens so far, so nothing is lost or repeated and greedy/seeded output is
unchanged) on another decode actor, at most `max_request_retries` times; a request that was in a failed
step is run on its own from then on. Every attempt gets a fresh internal key, and every path out of an
attempt releases what it holds on both sides (reservation, prefill, decode).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator

import ray

from cluster.affinity import PrefixAffinity
from cluster.membership import Member, Membership, _await
from cluster.outputs import Collectors, Output
from cluster.placement import Placement
from cluster.protocol import (
    ACTOR_GONE,
    COLLECTIVE_TRANSPORTS,
    SUMMED_DECODE,
    DecodeInfo,
    DecodeTarget,
    PrefillInfo,
    PrefillOutcome,
    RetryableFailure,
    StepFailure,
    WorkerLost,
)
from core.configs import DeadlineConfig
from core.request import Attempt, Request
from core.types import DeadlineExceeded, RequestFailed, TokenEvent, WorkerUnavailable

__all__ = ["Frontend", "Output"]

log = logging.getLogger(__name__)
PREFIX_SUMS = ("lookups", "prompt_tokens", "hit_tokens", "nodes", "state_snapshots", "host_seg_bytes", "host_state_bytes",
               "disk_seg_bytes", "disk_state_bytes", "state_bytes_every_page", "evictions", "disk_drops", "disk_reads",
               "disk_writes", "disk_read_bytes", "disk_write_bytes", "disk_errors", "disk_read_errors", "disk_write_errors",
               "host_pages", "disk_pages")
"""Prefix-cache numbers summed over the prefill actors for /metrics."""


class Frontend:
    def __init__(self, prefill: list[tuple[object, PrefillInfo]], decode: list[tuple[object, DecodeInfo]],
                 deadlines: DeadlineConfig | None = None, frontend_id: str | None = None, transport: str = "object_store") -> None:
        self.id = frontend_id or uuid.uuid4().hex[:12]
        self.deadlines = deadlines or DeadlineConfig()
        self.transport = transport
        self._pair_locks: dict[tuple[str, str], asyncio.Lock] = {}
        page = next((i.prefix_page_tokens for _, i in prefill if i.prefix_page_tokens), None)
        slack = next((i.prefix_affinity_slack for _, i in prefill), 0)
        self.affinity = PrefixAffinity(page, slack) if page and len(prefill) > 1 else None
        """Prefix-affinity routing, when the prefill actors cache prefixes and there is a choice."""
        if self.affinity is not None:
            for _, i in prefill:  # what their disk tiers kept from an earlier run
                self.affinity.seed(i.name, list(i.prefix_pages))
        self.collectors = Collectors()
        room = asyncio.Event()
        keyed = [i.capacity.block_tokens for _, i in decode if i.capacity.takes_keys]
        self.kept = PrefixAffinity(keyed[0], 0) if keyed else None
        """Page-key routing: the page keys of prompts that finished on each decode actor that keeps them, and of those
        placed on one that shares pages among its running requests."""
        self.members = Membership([Member(h, i.name, i) for h, i in prefill], [Member(h, i.name, i) for h, i in decode],
                                  self.deadlines, self.id, self.collectors, room, self.affinity, self.kept)
        self.placement = Placement(self.members, self.deadlines, room, self.affinity, self.kept)
        self.prefill, self.decode = self.members.prefill, self.members.decode
        self.retries = {"prefill": 0, "decode": 0}
        self.handoffs: deque[tuple[int, float]] = deque(maxlen=10_000)
        """(layout bytes, seconds) of recent handoffs, as the prefill actors measured them."""
        self._ids = itertools.count()

    # lifecycle -----------------------------------------------------------------------------------

    async def start(self) -> None:
        self.members.start()

    async def stop(self) -> None:
        await self.members.stop()
        for m in self.decode:
            if m.keys and m.alive:
                m.handle.abort.remote(list(m.keys))

    def ready(self) -> bool:
        return any(m.usable for m in self.decode) and any(m.usable for m in self.prefill)

    def new_request_id(self) -> str:
        """A server-side request id, unique across this frontend's lifetime (clients' ids are never keys)."""
        return f"{self.id}-{next(self._ids)}"

    @property
    def waiting(self) -> int:
        """Requests of this frontend waiting for decode capacity."""
        return self.placement.waiting

    def check_admissible(self, req: Request) -> None:
        """Refuse (400) a request no decode actor could hold even when empty (`Placement.check_admissible`)."""
        self.placement.check_admissible(req)

    # an attempt's parts ----------------------------------------------------------------------------

    async def _run_prefill(self, attempt: Attempt, target: DecodeTarget | None) -> PrefillOutcome:
        m = await self.placement.pick_prefill(attempt)
        out = await self._prefill_on(m, attempt, target)
        if out.awaiting_export is not None:
            await self._move_layout(m, target, out)
        return out

    async def _move_layout(self, pm: Member, target: DecodeTarget, out: PrefillOutcome) -> None:
        """Direct tensor transports: start the transfer here, the process that set the transport up."""
        key = out.key
        lock = None
        if self.transport in COLLECTIVE_TRANSPORTS:  # collectives pair sends with receives in order: one at a time per pair
            lock = self._pair_locks.setdefault((pm.name, target.name), asyncio.Lock())
            await lock.acquire()
        t0 = time.perf_counter()
        try:
            ref = pm.handle.export.options(tensor_transport=self.transport).remote(key)
            await asyncio.wait_for(_await(target.handle.admit.remote(out.awaiting_export, ref)), self.deadlines.handoff_timeout_s)
        except ACTOR_GONE as e:
            raise WorkerLost(f"an actor was lost while moving the layout of {key}: {type(e).__name__}") from None
        except asyncio.TimeoutError:
            raise DeadlineExceeded(f"the layout of {key} did not move within {self.deadlines.handoff_timeout_s:.0f} s "
                                   "(--handoff-timeout-s)") from None
        finally:
            if lock is not None:
                lock.release()
            pm.handle.release.remote(key)
        out.handed_off, out.handoff_s = True, time.perf_counter() - t0

    async def _prefill_on(self, m: Member, attempt: Attempt, target: DecodeTarget | None) -> PrefillOutcome:
        m.load[attempt.key] = len(attempt.prompt_token_ids) + len(attempt.generated)
        ref = m.handle.prefill.remote(attempt, target)
        call = asyncio.ensure_future(_await(ref))
        lost = asyncio.ensure_future(m.lost.wait())
        try:
            done, _ = await asyncio.wait({call, lost}, timeout=self.deadlines.prefill_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if call in done:
                try:
                    return call.result()
                except ACTOR_GONE as e:
                    self.members.lose(m, f"prefill actor {m.name} died ({type(e).__name__})", dead=True)
                    raise WorkerLost(f"prefill actor {m.name} was lost") from None
            ray.cancel(ref)
            m.handle.abort.remote(attempt.key)
            if lost in done:
                raise WorkerLost(f"prefill actor {m.name} was lost")
            raise DeadlineExceeded(f"prefill took longer than {self.deadlines.prefill_timeout_s:.0f} s (--prefill-timeout-s)")
        except asyncio.CancelledError:  # the caller left while the prompt was being prefilled
            ray.cancel(ref)
            raise
        finally:
            call.cancel()
            lost.cancel()
            m.load.pop(attempt.key, None)

    # a request -----------------------------------------------------------------------------------

    async def generate(self, req: Request) -> AsyncIterator[Output]:
        """Output of `req` as it is produced (token 0 comes from prefill, the rest from decode). Closing the
        iterator early stops the request everywhere."""
        self.check_admissible(req)
        sp = req.sampling
        attempt = Attempt(req, f"{req.request_id}.0", owner=self.id)
        generated: list[int] = []
        exclude: set[str] = set()
        failures = 0
        for n in itertools.count():
            if n:
                attempt = attempt.retry(f"{req.request_id}.{n}", tuple(generated), solo=False)
            key = attempt.key
            col = self.collectors.open(key, req.request_id, len(generated))
            dm: Member | None = None
            release = True  # whether the decode side may still hold something of this attempt when it ends
            try:
                keys, held = (), 0
                if sp.max_tokens > 0:
                    dm, keys, held = await self.placement.reserve(attempt, exclude)
                target = DecodeTarget(dm.handle, dm.name, self.id, held) if dm is not None else None
                out = await self._run_prefill(attempt, target)
                if out.handed_off:
                    self.handoffs.append((out.layout_bytes, out.handoff_s))
                if not generated:
                    events = [TokenEvent(req.request_id, 0, out.first_token, out.finish_reason)] if out.first_token else []
                    generated += [e.token.token_id for e in events]
                    yield Output(events, out.prompt_logprobs)
                col.delivered(len(generated))
                if not out.handed_off:
                    return  # ended by its first token (or nothing to generate): the reservation goes back
                while True:
                    events = await col.take(self.deadlines.token_timeout_s)
                    generated += [e.token.token_id for e in events]
                    if events[-1].finish_reason is not None:
                        release = False  # finished on the decode side, which freed it already (or kept its pages)
                        if keys and dm.info.capacity.keeps:
                            self.kept.record(dm.name, list(keys))
                    yield Output(events)
                    if not release:
                        return
            except RetryableFailure as e:
                failures += 1
                if isinstance(e, StepFailure):  # it runs in steps of its own from now on
                    attempt = attempt.retry(attempt.key, attempt.generated, solo=True)
                if dm is not None:
                    exclude.add(dm.name)
                self.retries["decode" if generated else "prefill"] += 1
                if failures > self.deadlines.max_request_retries:
                    cls = WorkerUnavailable if isinstance(e, WorkerLost) else RequestFailed
                    raise cls(f"the request failed {failures} time(s), more than --max-request-retries "
                              f"{self.deadlines.max_request_retries} allows; last: {e}") from None
                log.warning("attempt %s failed (%s); prefilling %d tokens again", key, e, len(req.prompt_token_ids) + len(generated))
            finally:
                del self.collectors[key]
                if dm is not None:
                    dm.keys.discard(key)
                    if release and dm.alive:
                        dm.handle.abort.remote([key])  # frees its reservation, or stops its decoding

    # numbers -------------------------------------------------------------------------------------

    def stats(self) -> dict:
        """This frontend's view of the cluster for /metrics (one process: not a message)."""
        dec = [m.stats for m in self.decode if m.stats is not None]
        pre = [m.stats for m in self.prefill if m.stats is not None]
        out = {k: sum(getattr(s, k) for s in dec) for k in SUMMED_DECODE}
        out["held_layouts"] = sum(s.held_layouts for s in pre)
        out["tables"] = {  # per-request bookkeeping everywhere: back to zero whenever nothing is in flight
            "frontend_collectors": len(self.collectors), "frontend_keys": sum(len(m.keys) for m in self.decode),
            "frontend_prefill_loads": sum(len(m.load) for m in self.prefill),
            "decode_owners": sum(s.owners for s in dec),
            "prefill_pending": sum(s.pending + s.futures for s in pre),
        }
        out["handoff_bytes"] = sum(s.bytes_sent for s in pre)
        out["router_waiting"] = self.waiting
        out["decode_alive"] = sum(m.usable for m in self.decode)
        out["prefill_alive"] = sum(m.usable for m in self.prefill)
        out["retries"] = dict(self.retries)
        out["member_errors"] = sum(m.errors for m in (*self.prefill, *self.decode))
        out["prefill_queued_tokens"] = sum(s.queued_tokens for s in pre)
        out["prefill_progress"] = {rid: p for s in pre for rid, p in (s.progress or {}).items()}
        if self.affinity is not None:
            out["prefix_routing"] = dict(self.affinity.count)
        out["prefill_tokens_computed"] = sum(s.tokens_in for s in pre)
        caches = [s.prefix_cache for s in pre if s.prefix_cache is not None]
        if caches:
            out["prefix_cache"] = {k: sum(getattr(c, k) for c in caches) for k in PREFIX_SUMS}
            out["prefix_cache"]["page_tokens"] = max(c.page_tokens for c in caches)
        return out
