"""The router: picks a prefill actor and a decode actor per request and carries it through both legs.

- prefill: the live actor with the fewest prompt tokens in flight from this router;
- decode: the live actor with the most free device pages that fits the request (its footprint at
  final length, as the decode worker will reserve it); when none fits now the request waits for one
  to free up (up to `queue_timeout_s`, then 503); a request larger than any decode actor's whole
  budget is refused at once (400), before any prefill work is spent on it.

Failures: a prefill that dies is retried once on another prefill actor (or on the same one once
Ray has restarted it); a decode actor that dies mid-stream costs its requests a re-prefill of
prompt + tokens generated so far, then they continue on another decode actor — tokens are neither
lost nor repeated, and greedy/seeded output stays the same because sampling depends only on
(seed, token index). Dead actors are restarted by Ray (max_restarts) and rejoin when they answer again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, ObjectLostError, OwnerDiedError, RayActorError

from cachetier.geometry import pages_for_request
from cluster.handoff import COLLECTIVE_TRANSPORTS, Handoff, Received
from cluster.launch import Actors
from core.types import (
    CapacityError,
    GenerateRequest,
    HisparseError,
    NeverFitsError,
    TokenEvent,
    WorkerUnavailable,
    finish_reason,
)
from prefill.worker import PrefillRequest

log = logging.getLogger(__name__)
_ACTOR_GONE = (RayActorError, ActorDiedError, ActorUnavailableError)
_LAYOUT_GONE = (OwnerDiedError, ObjectLostError)


@dataclass
class Member:
    handle: object
    name: str
    alive: bool = True
    info: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    inflight: dict[str, int] = field(default_factory=dict)
    """request id -> prompt tokens (prefill) or reserved pages (decode) sent by this router."""
    generation: int = 0

    @property
    def load(self) -> int:
        return sum(self.inflight.values())


class Router:
    def __init__(self, actors: Actors, eos_ids: tuple[int, ...], queue_timeout_s: float = 60.0, poll_s: float = 1.0,
                 transport: str = "object_store") -> None:
        self.prefill = [Member(h, i["name"], info=i) for h, i in zip(actors.prefill, actors.prefill_info)]
        self.decode = [Member(h, i["name"], info=i) for h, i in zip(actors.decode, actors.decode_info)]
        self.eos_ids = eos_ids
        self.queue_timeout_s = queue_timeout_s
        self.transport = transport
        self._pair_locks: dict[tuple[str, str], asyncio.Lock] = {}
        self.poll_s = poll_s
        self._freed = asyncio.Event()
        self._poller: asyncio.Task | None = None
        self.retries = {"prefill": 0, "decode": 0}
        self.waiting = 0

    # lifecycle -----------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            try:
                await self._poller
            except asyncio.CancelledError:
                pass
            self._poller = None

    async def _poll(self) -> None:
        while True:
            await asyncio.gather(*(self._refresh(m) for m in self.prefill + self.decode), return_exceptions=True)
            await asyncio.sleep(self.poll_s)

    async def _refresh(self, m: Member) -> None:
        try:
            m.stats = await asyncio.wait_for(_await(m.handle.stats.remote()), timeout=max(5.0, 5 * self.poll_s))
            if not m.alive:
                log.info("%s answers again; it rejoins", m.name)
                m.alive, m.inflight = True, {}
                m.generation += 1
                self._freed.set()
        except _ACTOR_GONE:
            self._mark_dead(m)
        except asyncio.TimeoutError:
            pass  # busy, not dead

    def _mark_dead(self, m: Member) -> None:
        if m.alive:
            log.warning("%s is unreachable; routing around it until it restarts", m.name)
        m.alive = False

    def ready(self) -> bool:
        return any(m.alive for m in self.decode) and any(m.alive for m in self.prefill)

    # footprints ----------------------------------------------------------------------------------

    @staticmethod
    def pages_needed(member: Member, reserve_tokens: int) -> int:
        g = member.info["geometry"]  # Geometry.describe() of the decode actor
        return pages_for_request(g["group_pages"], g["block_tokens"], reserve_tokens)

    def check_admissible(self, req: GenerateRequest) -> None:
        """Refuse (400) a request no decode actor could hold even when empty."""
        reserve = len(req.prompt_token_ids) + req.sampling.max_tokens
        if self.decode and all(self.pages_needed(m, reserve) > m.info["geometry"]["num_pages"] for m in self.decode):
            g = self.decode[0].info["geometry"]
            raise NeverFitsError(
                f"prompt + max_tokens = {reserve} tokens need {self.pages_needed(self.decode[0], reserve)} KV pages, more than a "
                f"decode worker holds ({g['num_pages']} pages of {g['block_tokens']} tokens); lower max_tokens or shorten the prompt",
                param="max_tokens",
            )

    # choosing ------------------------------------------------------------------------------------

    def _pick_prefill(self, exclude: set[str]) -> Member | None:
        live = [m for m in self.prefill if m.alive and m.name not in exclude]
        return min(live, key=lambda m: m.load) if live else None

    async def _pick_decode(self, rid: str, reserve_tokens: int, exclude: set[str]) -> Member:
        deadline = time.monotonic() + self.queue_timeout_s
        self.waiting += 1
        try:
            while True:
                live = [m for m in self.decode if m.alive and m.name not in exclude]
                if not live:
                    live = [m for m in self.decode if m.alive]  # the excluded one came back: better than nothing
                if not live:
                    raise WorkerUnavailable("no decode actor is alive; requests resume once one restarts")
                fits = [m for m in live if m.info["geometry"]["num_pages"] - m.load >= self.pages_needed(m, reserve_tokens)]
                if fits:
                    best = max(fits, key=lambda m: m.info["geometry"]["num_pages"] - m.load)
                    best.inflight[rid] = self.pages_needed(best, reserve_tokens)
                    return best
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CapacityError("every decode actor's device budget is full; retry shortly", retry_after_s=2.0)
                self._freed.clear()
                try:
                    await asyncio.wait_for(self._freed.wait(), timeout=min(left, 1.0))
                except asyncio.TimeoutError:
                    pass
        finally:
            self.waiting -= 1

    def _release(self, m: Member | None, rid: str) -> None:
        if m is not None and m.inflight.pop(rid, None) is not None:
            self._freed.set()

    # the two legs --------------------------------------------------------------------------------

    async def _run_prefill(self, preq: PrefillRequest):
        """Prefill, retried once on another live prefill actor; returns (member, handoff)."""
        tried: set[str] = set()
        for _ in range(2):
            m = self._pick_prefill(tried)
            if m is None:
                break
            m.inflight[preq.request_id] = len(preq.prompt_token_ids) + len(preq.resume_tokens)
            ref = m.handle.prefill.remote(preq)
            try:
                return m, await _await(ref)
            except asyncio.CancelledError:  # the caller left while its prompt was being prefilled
                ray.cancel(ref)
                raise
            except _ACTOR_GONE as e:
                log.warning("prefill of %s failed on %s (%s)", preq.request_id, m.name, type(e).__name__)
                self._mark_dead(m)
                tried.add(m.name)
                self.retries["prefill"] += 1
            finally:
                m.inflight.pop(preq.request_id, None)
        if tried:
            raise WorkerUnavailable(f"prefill of {preq.request_id} failed on {sorted(tried)} and no other prefill actor is alive")
        raise WorkerUnavailable("no prefill actor is alive; requests resume once one restarts")

    async def generate(self, req: GenerateRequest, seed: int) -> AsyncIterator[TokenEvent]:
        """Tokens of `req` as they are produced (index 0 comes from prefill, the rest from decode)."""
        self.check_admissible(req)
        rid = req.request_id
        generated: list[int] = []
        exclude_decode: set[str] = set()
        layout_losses = 0
        while True:
            preq = PrefillRequest(rid, tuple(req.prompt_token_ids), req.sampling, seed, tuple(generated))
            pm, h = await self._run_prefill(preq)
            if not generated:
                ev = TokenEvent(rid, 0, h.first_token, finish_reason(h.first_token.token_id, 1, req.sampling, self.eos_ids))
                generated.append(h.first_token.token_id)
                yield ev
                if ev.finish_reason is not None:
                    pm.handle.release.remote(rid)
                    return
            reserve = h.layout_tokens + req.sampling.max_tokens - h.num_generated + 1
            dm = None
            gen = None
            handed_over = False
            try:
                dm = await self._pick_decode(rid, reserve, exclude_decode)
                gen = await self._hand_over(pm, dm, h)
                handed_over = True
                async for ref in gen:
                    ev = await ref
                    generated.append(ev.token.token_id)
                    if ev.finish_reason is not None:
                        gen = None  # finished: nothing to cancel
                    yield ev
                    if ev.finish_reason is not None:
                        return
                gen = None
                raise HisparseError(f"decode stream of {rid} ended without a finish reason")
            except (*_ACTOR_GONE, *_LAYOUT_GONE) as e:
                gen = None
                if not handed_over and (isinstance(e, _LAYOUT_GONE) or not await self._answers(pm)):
                    # the prefill actor died before its layout reached the decode actor: prefill again, once
                    self._mark_dead(pm)
                    self.retries["prefill"] += 1
                    layout_losses += 1
                    if layout_losses > 1:
                        raise WorkerUnavailable(f"the layout of {rid} was lost twice (prefill actor failures)") from None
                    continue
                log.warning("decode actor %s failed under %s (%s); re-prefilling %d tokens", dm.name if dm else "?", rid,
                            type(e).__name__, len(req.prompt_token_ids) + len(generated))
                if dm is not None:
                    self._mark_dead(dm)
                    exclude_decode.add(dm.name)
                self.retries["decode"] += 1
            finally:
                self._release(dm, rid)
                if gen is not None:  # the consumer left early (client gone): stop the decode side
                    ray.cancel(gen)
                    pm.handle.abort.remote(rid)

    async def _hand_over(self, pm: Member, dm: Member, h: Handoff):
        """Start the decode stream with the layout exported by the prefill actor; returns once it has arrived."""
        export = pm.handle.export
        if self.transport != "object_store":
            export = export.options(tensor_transport=self.transport)
        lock = None
        if self.transport in COLLECTIVE_TRANSPORTS:  # one transfer at a time per pair (see cluster.handoff)
            lock = self._pair_locks.setdefault((pm.name, dm.name), asyncio.Lock())
            await lock.acquire()
        try:
            h.sent_at = time.time()
            gen = dm.handle.generate.options(num_returns="streaming").remote(h, export.remote(h.request_id))
            try:
                received = await (await gen.__anext__())
            except asyncio.CancelledError:  # the caller left during the handoff: stop the decode side too
                ray.cancel(gen)
                raise
            if not isinstance(received, Received):
                ray.cancel(gen)
                raise HisparseError(f"decode stream of {h.request_id} did not start with the layout's receipt")
            return gen
        finally:
            if lock is not None:
                lock.release()

    async def _answers(self, m: Member) -> bool:
        try:
            await asyncio.wait_for(_await(m.handle.ready.remote()), timeout=5.0)
            return True
        except (*_ACTOR_GONE, asyncio.TimeoutError):
            return False

    # numbers -------------------------------------------------------------------------------------

    def stats(self) -> dict:
        dec = [m.stats for m in self.decode if m.stats]
        keys = ("running", "waiting", "device_bytes_used", "device_bytes_total", "host_bytes_used", "host_bytes_total",
                "hits", "misses", "bytes_h2d", "handoff_bytes", "integrity_errors")
        out = {k: sum(s.get(k, 0) for s in dec) for k in keys}
        out["router_waiting"] = self.waiting
        out["decode_alive"] = sum(m.alive for m in self.decode)
        out["prefill_alive"] = sum(m.alive for m in self.prefill)
        out["retries"] = dict(self.retries)
        out["prefill_queued_tokens"] = sum(m.stats.get("queued_tokens", 0) for m in self.prefill if m.stats)
        return out


async def _await(ref):
    return await ref
