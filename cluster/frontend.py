"""A gateway process's client of the cluster: admission, routing, the handoff, output, failover.

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
from dataclasses import dataclass, field

import ray

from cachetier.geometry import pages_for_request
from cluster.affinity import PrefixAffinity
from cluster.prefill_actor import ACTOR_GONE
from cluster.protocol import (
    COLLECTIVE_TRANSPORTS,
    NAMESPACE,
    DecodeTarget,
    PrefillOutcome,
    Report,
    RetryableFailure,
    StepFailure,
    StepMessage,
    WorkerLost,
    delta_events,
    failure_error,
)
from core.roles import POLL_INTERVAL_S, DeadlineConfig
from core.types import (
    CapacityError,
    DeadlineExceeded,
    GenerateRequest,
    NeverFitsError,
    PromptLogprob,
    RequestFailed,
    TokenEvent,
    WorkerUnavailable,
)
from prefill.worker import PrefillRequest

log = logging.getLogger(__name__)
PREFIX_SUMS = ("lookups", "prompt_tokens", "hit_tokens", "nodes", "state_snapshots", "host_seg_bytes", "host_state_bytes",
               "disk_seg_bytes", "disk_state_bytes", "state_bytes_every_page", "evictions", "disk_drops", "disk_reads",
               "disk_writes", "disk_read_bytes", "disk_write_bytes", "disk_errors", "disk_read_errors", "disk_write_errors",
               "host_pages", "disk_pages")
"""Prefix-cache numbers summed over the prefill actors for /metrics."""


@dataclass
class Output:
    """What a request produced since the caller last looked: tokens in order, and once the prompt's scores."""

    events: list[TokenEvent]
    prompt_logprobs: list[PromptLogprob] | None = None


class Collector:
    """One attempt's output on this side: tokens by index (in order, whatever order they arrive in), or a failure."""

    def __init__(self, key: str, request_id: str, first_index: int) -> None:
        self.key, self.request_id = key, request_id
        self.next_index = first_index
        self.ready: list[TokenEvent] = []
        self.early: dict[int, TokenEvent] = {}
        self.error: BaseException | None = None
        self.wake = asyncio.Event()

    def put(self, events: list[TokenEvent]) -> None:
        """Events of this request (indices consecutive), in whatever order batches arrive."""
        if events and events[0].index == self.next_index and not self.early:  # the usual case: next in line
            self.ready += events
            self.next_index += len(events)
            self.wake.set()
            return
        for ev in events:
            if ev.index >= self.next_index:  # below it: already delivered
                self.early[ev.index] = ev
        self._drain()

    def delivered(self, index: int) -> None:
        """Tokens before `index` reached the caller another way (the first token comes from prefill)."""
        self.next_index = max(self.next_index, index)
        self._drain()

    def _drain(self) -> None:
        while self.next_index in self.early:
            self.ready.append(self.early.pop(self.next_index))
            self.next_index += 1
        if self.ready:
            self.wake.set()

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self.wake.set()

    async def take(self, timeout_s: float) -> list[TokenEvent]:
        """Everything ready (at least one token), or the failure; `DeadlineExceeded` after `timeout_s` of silence."""
        if not self.ready and self.error is None:
            self.wake.clear()
            timer = asyncio.get_running_loop().call_later(timeout_s, self.wake.set)  # cheaper than wait_for's task
            try:
                await self.wake.wait()
            finally:
                timer.cancel()
            if not self.ready and self.error is None:
                raise DeadlineExceeded(f"no token for {timeout_s:.0f} s (--token-timeout-s)")
        if self.ready:
            out, self.ready = self.ready, []
            return out
        raise self.error


@dataclass
class Member:
    """One actor as this frontend sees it."""

    handle: object
    name: str
    info: dict
    alive: bool = True
    hung: bool = False
    report: Report | None = None
    stats: dict = field(default_factory=dict)
    keys: set[str] = field(default_factory=set)
    """Keys of this frontend's attempts on the actor (decode: reserved or running; prefill: in prefill)."""
    load: dict[str, int] = field(default_factory=dict)
    """Prefill: prompt tokens this frontend has in flight there, per key."""
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the actor dies or hangs (wakes the attempts waiting on it)."""
    orphans: set[str] = field(default_factory=set)
    """Keys moved away when the actor looked dead: if it was only unreachable, they are aborted when it answers."""
    dead_group: str | None = None
    """The replica (placement group) this member was lost with: it rejoins only as a rank of a new one."""
    pending_pages: int = 0
    """Decode: pages this frontend is reserving there right now (not yet in its report), so that requests
    arriving together spread over equally free actors instead of all asking the first."""

    @property
    def usable(self) -> bool:
        return self.alive and not self.hung


class Frontend:
    def __init__(self, prefill: list[tuple[object, dict]], decode: list[tuple[object, dict]],
                 deadlines: DeadlineConfig | None = None, frontend_id: str | None = None, transport: str = "object_store") -> None:
        self.id = frontend_id or uuid.uuid4().hex[:12]
        self.deadlines = deadlines or DeadlineConfig()
        self.transport = transport
        self._pair_locks: dict[tuple[str, str], asyncio.Lock] = {}
        self.prefill = [Member(h, i["name"], i) for h, i in prefill]
        page = next((i.get("prefix_page_tokens") for _, i in prefill if i.get("prefix_page_tokens")), None)
        slack = next((i.get("prefix_affinity_slack") for _, i in prefill if i.get("prefix_affinity_slack") is not None), 0)
        self.affinity = PrefixAffinity(page, slack) if page and len(prefill) > 1 else None
        """Prefix-affinity routing, when the prefill actors cache prefixes and there is a choice."""
        if self.affinity is not None:
            for m in self.prefill:  # what their disk tiers kept from an earlier run
                self.affinity.seed(m.name, m.info.get("prefix_pages") or [])
        self.decode = [Member(h, i["name"], i) for h, i in decode]
        self.collectors: dict[str, Collector] = {}
        self.retries = {"prefill": 0, "decode": 0}
        self.handoffs: deque[tuple[int, float]] = deque(maxlen=10_000)
        """(layout bytes, seconds) of recent handoffs, as the prefill actors measured them."""
        self.waiting = 0
        self._room = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._running = False
        self._ids = itertools.count()

    # lifecycle -----------------------------------------------------------------------------------

    async def start(self) -> None:
        if not self._tasks:
            self._running = True
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._poll_decode(m)) for m in self.decode]
            self._tasks.append(loop.create_task(self._watch_prefill()))

    async def stop(self) -> None:
        self._running = False  # the loops also check this: a cancel that lands as a wait ends can be swallowed
        for t in self._tasks:
            t.cancel()
        await asyncio.wait(self._tasks, timeout=10.0)
        self._tasks = []
        for m in self.decode:
            if m.keys and m.alive:
                m.handle.abort.remote(list(m.keys))

    def ready(self) -> bool:
        return any(m.usable for m in self.decode) and any(m.usable for m in self.prefill)

    def new_request_id(self) -> str:
        """A server-side request id, unique across this frontend's lifetime (clients' ids are never keys)."""
        return f"{self.id}-{next(self._ids)}"

    # the poll loops ------------------------------------------------------------------------------

    async def _poll_decode(self, m: Member) -> None:
        while self._running:
            if not m.alive:
                await self._rejoin(m)
                continue
            try:
                msg = await asyncio.wait_for(_await(m.handle.poll.remote(self.id)), POLL_INTERVAL_S + 30.0)
            except ACTOR_GONE as e:
                self._lose(m, f"decode actor {m.name} died ({type(e).__name__})", dead=True)
                continue
            except asyncio.TimeoutError:
                continue  # busy, not dead: its report says whether it is stuck
            self._deliver(m, msg)

    async def _rejoin(self, m: Member) -> None:
        """Wait for Ray to restart a dead actor; it rejoins routing once it answers."""
        try:
            info = await asyncio.wait_for(_await(m.handle.ready.remote()), 10.0)
        except (*ACTOR_GONE, asyncio.TimeoutError):
            await asyncio.sleep(0.5)
            await self._refresh_handle(m)
            return
        if m.dead_group is not None and info.get("replica_group") == m.dead_group:
            await asyncio.sleep(0.5)  # a rank of the replica being torn down still answers: wait for the new one
            await self._refresh_handle(m)
            return
        m.info, m.dead_group = info, None
        log.info("%s answers again; it rejoins", m.name)
        if self.affinity is not None and any(x is m for x in self.prefill):
            self.affinity.seed(m.name, m.info.get("prefix_pages") or [])
        m.alive, m.hung, m.report = True, False, None
        m.lost = asyncio.Event()
        if m.orphans:  # a restarted actor has none of them; one that was only unreachable must drop them
            m.handle.abort.remote(list(m.orphans))
            m.orphans = set()
        self._room.set()  # requests waiting for a live actor go on

    @staticmethod
    async def _refresh_handle(m: Member) -> None:
        """A replica's ranks are rebuilt as new actors under the same names: look the name up again."""
        try:
            handle = await asyncio.to_thread(ray.get_actor, m.name, namespace=NAMESPACE)
        except ValueError:  # no actor of that name (yet)
            return
        if handle._actor_id != m.handle._actor_id:
            log.info("%s is a new actor now; following it", m.name)
            m.handle = handle

    def _deliver(self, m: Member, msg: StepMessage) -> None:
        for key, delta in msg.deltas.items():
            col = self.collectors.get(key)
            if col is not None:
                col.put(delta_events(col.request_id, delta))
            if delta[4] is not None:
                m.keys.discard(key)
        for key, (message, kind) in msg.failures.items():
            m.keys.discard(key)
            col = self.collectors.get(key)
            if col is not None:
                col.fail(failure_error(kind, message))
        before = m.report
        m.report = msg.report
        if msg.report is not None:
            m.stats = msg.report.stats or m.stats
            hung = msg.report.stalled_s > self.deadlines.step_hang_s
            if hung and not m.hung:
                self._lose(m, f"decode actor {m.name} is stuck in one step for {msg.report.stalled_s:.0f} s", dead=False)
            elif not hung and m.hung:
                log.info("%s makes progress again; it rejoins", m.name)
                m.hung = False
                m.lost = asyncio.Event()
            if before is None or msg.report.pages_free > before.pages_free or msg.report.running < before.running:
                self._room.set()

    def _lose(self, m: Member, why: str, dead: bool) -> None:
        """An actor died or hung: its attempts fail over (a hung one is also told to drop them)."""
        if dead:
            m.alive = False
            m.dead_group = m.info.get("replica_group")
            if self.affinity is not None:  # a restarted actor starts with an empty cache (or only its disk tier)
                self.affinity.forget(m.name)
        else:
            m.hung = True
        log.warning("%s; moving %d request(s) of this gateway elsewhere", why, len(m.keys))
        m.lost.set()
        keys, m.keys = list(m.keys), set()
        for key in keys:
            col = self.collectors.get(key)
            if col is not None:
                col.fail(WorkerLost(why))
        if dead:
            m.orphans |= set(keys)
        elif keys:
            m.handle.abort.remote(keys)
        group = m.info.get("replica_group")
        if dead and group is not None:  # a replica is rebuilt whole: its other ranks are going too
            for other in (*self.prefill, *self.decode):
                if other is not m and other.alive and other.info.get("replica_group") == group:
                    self._lose(other, f"{other.name} goes down with its replica", dead=True)

    async def _watch_prefill(self) -> None:
        while self._running:
            await asyncio.gather(*(self._refresh_prefill(m) for m in self.prefill), return_exceptions=True)
            await asyncio.sleep(POLL_INTERVAL_S)

    async def _refresh_prefill(self, m: Member) -> None:
        if not m.alive:
            await self._rejoin(m)
            return
        try:
            m.stats = await asyncio.wait_for(_await(m.handle.stats.remote()), 10.0)
        except ACTOR_GONE:
            self._lose(m, f"prefill actor {m.name} died", dead=True)
            return
        except asyncio.TimeoutError:
            return
        hung = m.stats.get("stalled_s", 0.0) > self.deadlines.step_hang_s
        if hung and not m.hung:
            self._lose(m, f"prefill actor {m.name} is stuck in one step for {m.stats['stalled_s']:.0f} s", dead=False)
        elif not hung and m.hung:
            m.hung = False
            m.lost = asyncio.Event()

    # admission -----------------------------------------------------------------------------------

    @staticmethod
    def pages_needed(m: Member, reserve_tokens: int) -> int:
        g = m.info["geometry"]
        return pages_for_request(g["group_pages"], g["block_tokens"], reserve_tokens)

    def check_admissible(self, req: GenerateRequest) -> None:
        """Refuse (400) a request no decode actor could hold even when empty."""
        reserve = len(req.prompt_token_ids) + req.sampling.max_tokens
        if req.sampling.max_tokens and self.decode and all(self.pages_needed(m, reserve) > m.info["geometry"]["num_pages"]
                                                           for m in self.decode):
            g = self.decode[0].info["geometry"]
            raise NeverFitsError(
                f"prompt + max_tokens = {reserve} tokens need {self.pages_needed(self.decode[0], reserve)} KV pages, more "
                f"than a decode worker holds ({g['num_pages']} pages of {g['block_tokens']} tokens); lower max_tokens or "
                "shorten the prompt", param="max_tokens")

    def _might_fit(self, m: Member, pages: int) -> bool:
        r = m.report
        return r is None or (r.pages_free >= pages and r.running + r.reserved < m.info["geometry"].get("max_running", 1 << 30))

    async def _reserve(self, key: str, reserve_tokens: int, exclude: set[str]) -> Member:
        """Reserve pages on a decode actor, waiting in the bounded queue for room (503 past the deadline)."""
        if self.waiting >= self.deadlines.max_queued_requests:
            raise CapacityError(f"{self.waiting} requests already wait for decode capacity; retry shortly",
                                retry_after_s=min(self.deadlines.queue_timeout_s, 5.0))
        deadline = time.monotonic() + self.deadlines.queue_timeout_s
        self.waiting += 1
        try:
            while True:
                live = [m for m in self.decode if m.usable and m.name not in exclude] or [m for m in self.decode if m.usable]
                self._room.clear()
                fits = [m for m in live if self._might_fit(m, self.pages_needed(m, reserve_tokens))]
                for m in sorted(fits, key=lambda m: m.pending_pages - (m.report.pages_free if m.report else 0)):
                    pages = self.pages_needed(m, reserve_tokens)
                    m.pending_pages += pages
                    try:
                        ok, m.report = await _await(m.handle.reserve.remote(self.id, key, reserve_tokens))
                    except ACTOR_GONE:
                        self._lose(m, f"decode actor {m.name} died", dead=True)
                        continue
                    finally:
                        m.pending_pages -= pages
                    if ok:
                        m.keys.add(key)
                        return m
                left = deadline - time.monotonic()
                if left <= 0:
                    if not live:  # dead or stuck, and none came back in time (Ray restarts dead ones)
                        raise WorkerUnavailable(f"no decode actor is alive (none came back within "
                                                f"{self.deadlines.queue_timeout_s:.0f} s, --queue-timeout-s); retry later")
                    raise CapacityError(f"no decode actor had room within {self.deadlines.queue_timeout_s:.0f} s "
                                        "(--queue-timeout-s); retry shortly", retry_after_s=2.0)
                try:
                    await asyncio.wait_for(self._room.wait(), min(left, POLL_INTERVAL_S))
                except asyncio.TimeoutError:
                    pass
        finally:
            self.waiting -= 1

    async def _pick_prefill(self, preq: PrefillRequest | None = None) -> Member:
        """The usable prefill actor holding the longest prefix of the prompt (within the load cap), else the least
        loaded; waits (up to the queue deadline) while all are restarting."""
        deadline = time.monotonic() + self.deadlines.queue_timeout_s
        while True:
            live = [m for m in self.prefill if m.usable]
            if live:
                loads = {m.name: sum(m.load.values()) + m.stats.get("queued_tokens", 0) for m in live}
                if self.affinity is not None and preq is not None:
                    name = self.affinity.pick(loads, list(preq.prompt_token_ids) + list(preq.resume_tokens[:-1]))
                    return next(m for m in live if m.name == name)
                return min(live, key=lambda m: loads[m.name])
            if time.monotonic() >= deadline:
                raise WorkerUnavailable(f"no prefill actor is alive (none came back within "
                                        f"{self.deadlines.queue_timeout_s:.0f} s, --queue-timeout-s); retry later")
            await asyncio.sleep(0.2)

    async def _run_prefill(self, preq: PrefillRequest, target: DecodeTarget | None) -> PrefillOutcome:
        m = await self._pick_prefill(preq)
        out = await self._prefill_on(m, preq, target)
        if out.awaiting_export is not None:
            await self._move_layout(m, target, out)
        return out

    async def _move_layout(self, pm: Member, target: DecodeTarget, out: PrefillOutcome) -> None:
        """Direct tensor transports: start the transfer here, the process that set the transport up."""
        key = out.request_id
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

    async def _prefill_on(self, m: Member, preq: PrefillRequest, target: DecodeTarget | None) -> PrefillOutcome:
        m.load[preq.request_id] = len(preq.prompt_token_ids) + len(preq.resume_tokens)
        ref = m.handle.prefill.remote(preq, target)
        call = asyncio.ensure_future(_await(ref))
        lost = asyncio.ensure_future(m.lost.wait())
        try:
            done, _ = await asyncio.wait({call, lost}, timeout=self.deadlines.prefill_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if call in done:
                try:
                    return call.result()
                except ACTOR_GONE as e:
                    self._lose(m, f"prefill actor {m.name} died ({type(e).__name__})", dead=True)
                    raise WorkerLost(f"prefill actor {m.name} was lost") from None
            ray.cancel(ref)
            m.handle.abort.remote(preq.request_id)
            if lost in done:
                raise WorkerLost(f"prefill actor {m.name} was lost")
            raise DeadlineExceeded(f"prefill took longer than {self.deadlines.prefill_timeout_s:.0f} s (--prefill-timeout-s)")
        except asyncio.CancelledError:  # the caller left while the prompt was being prefilled
            ray.cancel(ref)
            raise
        finally:
            call.cancel()
            lost.cancel()
            m.load.pop(preq.request_id, None)

    # a request -----------------------------------------------------------------------------------

    async def generate(self, req: GenerateRequest, seed: int) -> AsyncIterator[Output]:
        """Output of `req` as it is produced (token 0 comes from prefill, the rest from decode). Closing the
        iterator early stops the request everywhere."""
        self.check_admissible(req)
        sp = req.sampling
        generated: list[int] = []
        exclude: set[str] = set()
        solo, failures = False, 0
        for attempt in itertools.count():
            key = f"{req.request_id}.{attempt}"
            col = self.collectors[key] = Collector(key, req.request_id, len(generated))
            dm: Member | None = None
            release = True  # whether the decode side may still hold something of this attempt when it ends
            try:
                if sp.max_tokens > 0:
                    dm = await self._reserve(key, len(req.prompt_token_ids) + sp.max_tokens, exclude)
                target = DecodeTarget(dm.handle, dm.name, self.id) if dm is not None else None
                preq = PrefillRequest(key, tuple(req.prompt_token_ids), sp, seed, tuple(generated), solo)
                out = await self._run_prefill(preq, target)
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
                        release = False  # finished on the decode side, which freed it already
                    yield Output(events)
                    if not release:
                        return
            except RetryableFailure as e:
                failures += 1
                solo = solo or isinstance(e, StepFailure)
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
        dec = [m.stats for m in self.decode if m.stats]
        keys = ("running", "waiting", "reserved", "device_bytes_used", "device_bytes_total", "host_bytes_used",
                "host_bytes_total", "hits", "misses", "bytes_h2d", "failed_steps", "integrity_errors", "integrity_checks")
        out = {k: sum(s.get(k, 0) for s in dec) for k in keys}
        out["held_layouts"] = sum(m.stats.get("held_layouts", 0) for m in self.prefill)
        out["tables"] = {  # per-request bookkeeping everywhere: back to zero whenever nothing is in flight
            "frontend_collectors": len(self.collectors), "frontend_keys": sum(len(m.keys) for m in self.decode),
            "frontend_prefill_loads": sum(len(m.load) for m in self.prefill),
            "decode_owners": sum(s.get("owners", 0) for s in dec),
            "prefill_pending": sum(m.stats.get("pending", 0) + m.stats.get("futures", 0) for m in self.prefill),
        }
        out["handoff_bytes"] = sum(m.stats.get("bytes_sent", 0) for m in self.prefill)
        out["router_waiting"] = self.waiting
        out["decode_alive"] = sum(m.usable for m in self.decode)
        out["prefill_alive"] = sum(m.usable for m in self.prefill)
        out["retries"] = dict(self.retries)
        out["prefill_queued_tokens"] = sum(m.stats.get("queued_tokens", 0) for m in self.prefill)
        out["prefill_progress"] = {rid: p for m in self.prefill for rid, p in m.stats.get("progress", {}).items()}
        if self.affinity is not None:
            out["prefix_routing"] = dict(self.affinity.count)
        out["prefill_tokens_computed"] = sum(m.stats.get("tokens_in", 0) for m in self.prefill)
        caches = [m.stats["prefix_cache"] for m in self.prefill if m.stats.get("prefix_cache")]
        if caches:
            out["prefix_cache"] = {k: sum(c[k] for c in caches) for k in PREFIX_SUMS}
            out["prefix_cache"]["page_tokens"] = max(c["page_tokens"] for c in caches)
        return out


async def _await(ref):
    return await ref
