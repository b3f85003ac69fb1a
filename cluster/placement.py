"""Where a frontend puts a request: the admission check, the decode reservation and its queue, the prefill choice.

- `check_admissible`: a request no decode actor could hold even when empty is refused (400) before any work;
  the gateway's early refusal and the attempt loop call this one function.
- `reserve`: the decode actor with the most free pages (by its latest report) that may fit the request at its
  final length — room in pages and under its request cap — reserves its pages; with no room anywhere the
  request waits in one bounded queue until a report shows room, and past `queue_timeout_s` fails with 503
  before any token exists. Decode actors that keep finished prompts' pages (`cachetier.retention`) are asked
  first when a prompt that finished there is the longest prefix of this one (a chat's next turn), with the
  context's page keys, so the handoff can leave the kept pages out.
- `pick_prefill`: the prefill actor holding the longest cached prefix of the prompt (within the affinity load
  cap), else the least loaded.
"""

from __future__ import annotations

import asyncio
import time

from cluster.affinity import PrefixAffinity
from cluster.membership import Member, Membership, _await
from cluster.protocol import ACTOR_GONE
from core.configs import POLL_INTERVAL_S, DeadlineConfig
from core.request import Attempt, Request
from core.types import CapacityError, NeverFitsError, WorkerUnavailable


def context_tokens(attempt: Attempt) -> list[int]:
    """What an attempt prefills: the prompt and every generated token but the last (the next step's input)."""
    return list(attempt.prompt_token_ids) + list(attempt.generated[:-1])


SHARE_SLACK = 0.25
"""Routing for shared prefixes: the share of its request cap an actor may hold beyond the least loaded one and still
be preferred for the pages it would share."""


class Placement:
    def __init__(self, members: Membership, deadlines: DeadlineConfig, room: asyncio.Event,
                 affinity: PrefixAffinity | None, kept: PrefixAffinity | None = None) -> None:
        self.members, self.deadlines, self.room, self.affinity = members, deadlines, room, affinity
        self.kept = kept
        self.waiting = 0
        """Requests of this frontend waiting for decode capacity."""

    def check_admissible(self, req: Request) -> None:
        """Refuse (400) a request no decode actor could hold even when empty."""
        decode = self.members.decode
        reserve = req.reserve_tokens
        if req.sampling.max_tokens and decode and all(m.info.capacity.never_fits(reserve) for m in decode):
            cap = decode[0].info.capacity
            raise NeverFitsError(
                f"prompt + max_tokens = {reserve} tokens need {cap.pages_for(reserve)} KV pages, more than a decode "
                f"worker holds ({cap.num_pages} pages of {cap.block_tokens} tokens); lower max_tokens or shorten the "
                "prompt", param="max_tokens")

    @staticmethod
    def might_fit(m: Member, pages: int) -> bool:
        """Whether `m`'s latest report leaves room for `pages` more pages and one more request."""
        r = m.report
        return r is None or (r.pages_free >= pages and r.running + r.reserved + r.waiting < m.info.capacity.max_running)

    async def reserve(self, attempt: Attempt, exclude: set[str]) -> tuple[Member, tuple[str, ...], int]:
        """Reserve the attempt's pages on a decode actor, waiting in the bounded queue for room (503 past the deadline)
        -> (the actor, the page keys it was given, tokens whose classical entries it kept from an earlier turn)."""
        if self.waiting >= self.deadlines.max_queued_requests:
            raise CapacityError(f"{self.waiting} requests already wait for decode capacity; retry shortly",
                                retry_after_s=min(self.deadlines.queue_timeout_s, 5.0))
        tokens = attempt.reserve_tokens
        keys = tuple(self.kept.keys(context_tokens(attempt))) if self.kept is not None else ()
        deadline = time.monotonic() + self.deadlines.queue_timeout_s
        self.waiting += 1
        try:
            while True:
                usable = [m for m in self.members.decode if m.usable]
                live = [m for m in usable if m.name not in exclude] or usable
                self.room.clear()
                fits = [m for m in live if self.might_fit(m, m.info.capacity.pages_for(tokens))]
                kept = {m.name: self.kept.matched_pages(m.name, list(keys)) for m in fits} if keys else {}
                least = min((self._load(m) for m in fits), default=0)
                for m in sorted(fits, key=lambda m: self._order(m, kept.get(m.name, 0), least)):
                    pages = m.info.capacity.pages_for(tokens)
                    m.pending_pages += pages
                    sent = keys if m.info.capacity.takes_keys else ()
                    try:
                        ok, m.report, held = await _await(
                            m.handle.reserve.remote(self.members.owner, attempt.key, tokens, sent))
                    except ACTOR_GONE:
                        self.members.lose(m, f"decode actor {m.name} died", dead=True)
                        continue
                    finally:
                        m.pending_pages -= pages
                    if ok:
                        m.keys.add(attempt.key)
                        if sent and m.info.capacity.shares:  # the next prompt with these first pages shares them there
                            self.kept.record(m.name, list(sent))
                        return m, sent, held
                left = deadline - time.monotonic()
                if left <= 0:
                    if not live:  # dead or stuck, and none came back in time (Ray restarts dead ones)
                        raise WorkerUnavailable(f"no decode actor is alive (none came back within "
                                                f"{self.deadlines.queue_timeout_s:.0f} s, --queue-timeout-s); retry later")
                    raise CapacityError(f"no decode actor had room within {self.deadlines.queue_timeout_s:.0f} s "
                                        "(--queue-timeout-s); retry shortly", retry_after_s=2.0)
                try:
                    await asyncio.wait_for(self.room.wait(), min(left, POLL_INTERVAL_S))
                except asyncio.TimeoutError:
                    pass
        finally:
            self.waiting -= 1

    @staticmethod
    def _load(m: Member) -> int:
        """Requests a decode actor holds, by its latest report."""
        r = m.report
        return r.running + r.reserved + r.waiting if r is not None else 0

    @staticmethod
    def _order(m: Member, matched: int, least: int) -> tuple[int, int]:
        """Where a decode actor comes in the order reservations are asked in (lowest first): first the one holding the
        longest prefix of this context (`matched` pages): a prompt it kept from an earlier turn (`--retain-bytes`), or
        pages of requests placed there that this one would share (`--share-prefixes`) while it holds no more than
        `SHARE_SLACK` of its request cap beyond the least loaded actor (one common system prompt must not pile every
        request onto one actor); then the most pages free."""
        room = (m.report.pages_free if m.report else 0) - m.pending_pages
        cap = m.info.capacity
        if matched and (cap.keeps or (cap.shares and Placement._load(m) - least <= SHARE_SLACK * cap.max_running)):
            return (-matched, -room)
        return (0, -room)

    async def pick_prefill(self, attempt: Attempt) -> Member:
        """The usable prefill actor holding the longest prefix of what the attempt prefills (within the load cap),
        else the least loaded; waits (up to the queue deadline) while all are restarting."""
        deadline = time.monotonic() + self.deadlines.queue_timeout_s
        while True:
            live = [m for m in self.members.prefill if m.usable]
            if live:
                loads = {m.name: sum(m.load.values()) + (m.stats.queued_tokens if m.stats else 0) for m in live}
                if self.affinity is not None:
                    name = self.affinity.pick(loads, context_tokens(attempt))
                    return next(m for m in live if m.name == name)
                return min(live, key=lambda m: loads[m.name])
            if time.monotonic() >= deadline:
                raise WorkerUnavailable(f"no prefill actor is alive (none came back within "
                                        f"{self.deadlines.queue_timeout_s:.0f} s, --queue-timeout-s); retry later")
            await asyncio.sleep(0.2)
