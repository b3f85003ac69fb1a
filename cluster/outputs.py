"""Where a frontend's decode output lands: one `Collector` per attempt, in one `Collectors` registry.

The decode actors' messages (`cluster.protocol.StepMessage`) hold tokens for many requests at once; the
registry hands each request's delta to its collector, which keeps tokens in order whatever order the
messages come in and merges what is pending for a consumer that lags.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from cluster.protocol import StepMessage, failure_error
from core.types import DeadlineExceeded, PromptLogprob, TokenEvent


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


class Collectors(dict[str, Collector]):
    """Attempt key -> its collector, and the routing of a decode actor's message into them."""

    def open(self, key: str, request_id: str, first_index: int) -> Collector:
        col = self[key] = Collector(key, request_id, first_index)
        return col

    def deliver(self, msg: StepMessage) -> set[str]:
        """Hand each delta and failure to its collector; returns the keys that ended (finished or failed)."""
        ended = set()
        for key, delta in msg.deltas.items():
            col = self.get(key)
            if col is not None:
                col.put(delta.events(col.request_id))
            if delta.finish_reason is not None:
                ended.add(key)
        for key, dropped in msg.failures.items():
            ended.add(key)
            col = self.get(key)
            if col is not None:
                col.fail(failure_error(dropped.kind, dropped.message))
        return ended

    def fail(self, keys, error: BaseException) -> None:
        for key in keys:
            col = self.get(key)
            if col is not None:
                col.fail(error)
