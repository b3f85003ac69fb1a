"""Which actors a frontend may route to: the poll loops that watch them, loss, hang and rejoin.

One loop per decode actor keeps one `poll` in flight and routes each reply's output into the
frontend's collectors; one loop watches the prefill actors' `stats`. An actor leaves routing when
- it is gone (a call raises `ACTOR_GONE`): Ray restarts it, and it rejoins once it answers `ready`;
- it is hung, by one rule for both roles (`observe`): its step thread has been inside one step longer
  than `step_hang_s` (its own report says so, its event loop still answering), or it has answered
  nothing at all for `step_hang_s` (at least `SILENCE_MIN_S`: a frozen process — SIGSTOP, a debugger, a
  machine swapping — cannot report itself). It rejoins when it answers again and its step thread makes progress.
Either way the attempts this frontend has there fail over at once (`WorkerLost`, retried elsewhere).
A loop never dies: an unexpected error is logged, counted, and the loop goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import ray

from cluster.affinity import PrefixAffinity
from cluster.outputs import Collectors
from cluster.protocol import ACTOR_GONE, NAMESPACE, ActorInfo, DecodeStats, PrefillStats, Report, StepMessage, WorkerLost
from core.configs import POLL_INTERVAL_S, DeadlineConfig

log = logging.getLogger(__name__)

ANSWER_SLACK_S = 2.0
"""How much longer than the poll interval a reply may take before the wait is looked at again."""
SILENCE_MIN_S = 2 * (POLL_INTERVAL_S + ANSWER_SLACK_S)
"""The least silence taken for a frozen actor, whatever `step_hang_s` says: a live actor's reply may take the
poll interval plus the slack, twice over on a loaded machine, before this frontend sees it."""


@dataclass
class Member:
    """One actor as this frontend sees it."""

    handle: object
    name: str
    info: ActorInfo
    alive: bool = True
    hung: bool = False
    report: Report | None = None
    stats: DecodeStats | PrefillStats | None = None
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
    answered_at: float = field(default_factory=time.monotonic)
    """When the actor last answered this frontend (a poll, a stats call)."""
    errors: int = 0
    """Calls to it that failed in a way no rule here expected (logged, counted, and the loop went on)."""

    @property
    def usable(self) -> bool:
        return self.alive and not self.hung


class Membership:
    def __init__(self, prefill: list[Member], decode: list[Member], deadlines: DeadlineConfig, owner: str,
                 collectors: Collectors, room: asyncio.Event, affinity: PrefixAffinity | None,
                 kept: PrefixAffinity | None = None) -> None:
        self.prefill, self.decode = prefill, decode
        self.deadlines, self.owner = deadlines, owner
        self.collectors, self.room, self.affinity = collectors, room, affinity
        self.kept = kept
        """What each decode actor keeps for follow-up turns, as this frontend saw requests finish there."""
        self._tasks: list[asyncio.Task] = []
        self._running = False

    # lifecycle -----------------------------------------------------------------------------------

    def start(self) -> None:
        if self._tasks:
            return
        self._running = True
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._forever(f"poll of {m.name}", lambda m=m: self._poll_decode(m)))
                       for m in self.decode]
        self._tasks.append(loop.create_task(self._forever("prefill watch", self._watch_prefill)))

    async def stop(self) -> None:
        self._running = False  # the loops also check this: a cancel that lands as a wait ends can be swallowed
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=10.0)
        self._tasks = []

    async def _forever(self, what: str, loop_fn: Callable) -> None:
        """Run a watch loop while the frontend runs; one that ends on an error is logged and started again."""
        while self._running:
            try:
                await loop_fn()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("the %s ended on an error; starting it again", what)
                await asyncio.sleep(0.5)

    # the one stall rule ----------------------------------------------------------------------------

    def observe(self, m: Member, stalled_s: float, role: str) -> None:
        """An answer from `m`: it is hung if its step thread has been inside one step past `step_hang_s`,
        and rejoins routing when it is not."""
        m.answered_at = time.monotonic()
        hung = stalled_s > self.deadlines.step_hang_s
        if hung and not m.hung:
            self.lose(m, f"{role} actor {m.name} is stuck in one step for {stalled_s:.0f} s", dead=False)
        elif not hung and m.hung:
            log.info("%s answers and makes progress again; it rejoins", m.name)
            m.hung = False
            m.lost = asyncio.Event()
            if m.orphans:
                m.handle.abort.remote(list(m.orphans))
                m.orphans = set()
            self.room.set()

    def silent(self, m: Member, role: str) -> None:
        """No answer from `m` yet: past `step_hang_s` of silence (at least `SILENCE_MIN_S`) it is hung — a frozen
        process cannot say so itself."""
        quiet = time.monotonic() - m.answered_at
        if quiet > max(self.deadlines.step_hang_s, SILENCE_MIN_S) and m.alive and not m.hung:
            self.lose(m, f"{role} actor {m.name} has answered nothing for {quiet:.0f} s", dead=False)

    # decode ----------------------------------------------------------------------------------------

    async def _poll_decode(self, m: Member) -> None:
        call = None
        while self._running:
            if not m.alive:
                call = None
                await self._rejoin(m)
                continue
            if call is None:
                call = asyncio.ensure_future(_await(m.handle.poll.remote(self.owner)))
            done, _ = await asyncio.wait({call}, timeout=POLL_INTERVAL_S + ANSWER_SLACK_S)
            if not done:  # the same poll stays in flight: a frozen actor's reply, when it comes, is not lost
                self.silent(m, "decode")
                continue
            finished, call = call, None
            try:
                msg = finished.result()
            except ACTOR_GONE as e:
                self.lose(m, f"decode actor {m.name} died ({type(e).__name__})", dead=True)
                continue
            except Exception:
                m.errors += 1
                log.exception("polling decode actor %s failed; polling it again", m.name)
                self.silent(m, "decode")
                await asyncio.sleep(0.5)
                continue
            self._deliver(m, msg)

    def _deliver(self, m: Member, msg: StepMessage) -> None:
        m.keys -= self.collectors.deliver(msg)
        before = m.report
        m.report = msg.report
        if msg.report is None:
            m.answered_at = time.monotonic()
            return
        m.stats = msg.report.stats or m.stats
        self.observe(m, msg.report.stalled_s, "decode")
        if before is None or msg.report.pages_free > before.pages_free or msg.report.running < before.running:
            self.room.set()

    # prefill ---------------------------------------------------------------------------------------

    async def _watch_prefill(self) -> None:
        while self._running:
            await asyncio.gather(*(self._refresh_prefill(m) for m in self.prefill))
            await asyncio.sleep(POLL_INTERVAL_S)

    async def _refresh_prefill(self, m: Member) -> None:
        if not m.alive:
            await self._rejoin(m)
            return
        try:
            m.stats = await asyncio.wait_for(_await(m.handle.stats.remote()), POLL_INTERVAL_S + ANSWER_SLACK_S)
        except ACTOR_GONE:
            self.lose(m, f"prefill actor {m.name} died", dead=True)
            return
        except asyncio.TimeoutError:
            self.silent(m, "prefill")
            return
        except Exception:
            m.errors += 1
            log.exception("asking prefill actor %s for its stats failed", m.name)
            self.silent(m, "prefill")
            return
        self.observe(m, m.stats.stalled_s, "prefill")

    # loss and rejoin -------------------------------------------------------------------------------

    def lose(self, m: Member, why: str, dead: bool) -> None:
        """An actor died or hung: its attempts fail over (a hung one is also told to drop them)."""
        if dead:
            m.alive = False
            m.dead_group = m.info.replica_group
            if self.affinity is not None:  # a restarted actor starts with an empty cache (or only its disk tier)
                self.affinity.forget(m.name)
            if self.kept is not None:  # and a restarted decode actor keeps nothing
                self.kept.forget(m.name)
        else:
            m.hung = True
        log.warning("%s; moving %d request(s) of this gateway elsewhere", why, len(m.keys))
        m.lost.set()
        keys, m.keys = list(m.keys), set()
        self.collectors.fail(keys, WorkerLost(why))
        m.orphans |= set(keys)
        if not dead and keys:
            m.handle.abort.remote(keys)  # a hung actor drops them when it next runs a command
        group = m.info.replica_group
        if dead and group is not None:  # a replica is rebuilt whole: its other ranks are going too
            for other in (*self.prefill, *self.decode):
                if other is not m and other.alive and other.info.replica_group == group:
                    self.lose(other, f"{other.name} goes down with its replica", dead=True)

    async def _rejoin(self, m: Member) -> None:
        """Wait for Ray to restart a dead actor; it rejoins routing once it answers."""
        try:
            info = await asyncio.wait_for(_await(m.handle.ready.remote()), 10.0)
        except (*ACTOR_GONE, asyncio.TimeoutError):
            await asyncio.sleep(0.5)
            await self._refresh_handle(m)
            return
        if m.dead_group is not None and info.replica_group == m.dead_group:
            await asyncio.sleep(0.5)  # a rank of the replica being torn down still answers: wait for the new one
            await self._refresh_handle(m)
            return
        m.info, m.dead_group = info, None
        log.info("%s answers again; it rejoins", m.name)
        if self.affinity is not None and any(x is m for x in self.prefill):
            self.affinity.seed(m.name, list(getattr(info, "prefix_pages", ())))
        m.alive, m.hung, m.report = True, False, None
        m.answered_at = time.monotonic()
        m.lost = asyncio.Event()
        if m.orphans:  # a restarted actor has none of them; one that was only unreachable must drop them
            m.handle.abort.remote(list(m.orphans))
            m.orphans = set()
        self.room.set()  # requests waiting for a live actor go on

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


async def _await(ref):
    return await ref
