"""The step thread an actor runs its worker on, and how the actor's event loop talks to it.

Each actor owns its worker on one *step thread* that runs steps back to back while there is work and
sleeps on an event when there is none; the actor's asyncio loop only moves requests in and output out.
Requests reach the step thread as commands run between steps, so the worker is never touched by two
threads (except for what it declares thread-safe).

The thread keeps a heartbeat: the time its current step (or command) began. An actor reports how long
that has been (`stalled_s`), so a step thread that hangs is seen from outside while the actor's event
loop still answers.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_LIVE: weakref.WeakSet = weakref.WeakSet()
"""Every step thread not yet stopped, stopped and joined when the process exits (`_stop_all`)."""
EXIT_JOIN_S = 10.0


@atexit.register
def _stop_all() -> None:
    """A daemon thread still running torch when the interpreter finalizes is torn out of its C++ frames, and
    Ray's terminate handler (installed wherever ray is imported) turns that into an abort of the whole
    process. So every step thread is told to stop at exit and joined (atexit runs before that teardown)."""
    threads = list(_LIVE)
    for t in threads:
        t.stop()
    for t in threads:
        t.thread.join(timeout=EXIT_JOIN_S)


class StepThread:
    """Runs `step()` whenever `has_work()`; runs commands between steps; `tick()` about once a second;
    `idle()` when there is nothing else to do (it returns whether it did something).

    `setup()`, if given, runs first on the thread and the constructor waits for it (re-raising what it
    raised): an actor builds its model, store and worker there, so that every device operation of the
    actor, from the first allocation on, happens on this one thread."""

    def __init__(self, name: str, has_work: Callable[[], bool], step: Callable[[], None],
                 tick: Callable[[], None] | None = None, idle: Callable[[], bool] | None = None,
                 setup: Callable[[], None] | None = None) -> None:
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        self._has_work, self._step, self._tick, self._idle = has_work, step, tick, idle
        self.busy_since: float | None = None
        self._last_tick = time.monotonic()  # the first tick comes a second in, once the owner has finished building
        self._setup, self._setup_error = setup, None
        self._stopping = False
        built = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(built,), name=name, daemon=True)
        self.thread.start()
        built.wait()
        if self._setup_error is not None:
            raise self._setup_error
        _LIVE.add(self)

    def stop(self) -> None:
        """End the thread after what it is running now (commands not yet run are dropped)."""
        self._stopping = True
        self.wake.set()

    def call(self, fn: Callable[[], Any]) -> None:
        self.commands.put(fn)
        self.wake.set()

    def stalled_s(self) -> float:
        """How long the current step or command has been running (0 when between them)."""
        since = self.busy_since
        return 0.0 if since is None else time.monotonic() - since

    def _busy(self, fn: Callable[[], Any]) -> None:
        self.busy_since = time.monotonic()
        try:
            fn()
        finally:
            self.busy_since = None

    def _run(self, built: threading.Event) -> None:
        try:
            if self._setup is not None:
                self._setup()
        except BaseException as e:  # the constructor re-raises it; the thread has nothing to run
            self._setup_error = e
            built.set()
            return
        built.set()
        self._last_tick = time.monotonic()
        while not self._stopping:
            while True:
                try:
                    fn = self.commands.get_nowait()
                except queue.Empty:
                    break
                try:
                    self._busy(fn)
                except BaseException as e:  # a command reports its own failure through its future
                    log.exception("command failed: %s", e)
            now = time.monotonic()
            if self._tick is not None and now - self._last_tick >= 1.0:
                self._last_tick = now
                try:
                    self._busy(self._tick)
                except Exception:
                    log.exception("periodic work of the step thread failed")
            if self._has_work():
                try:
                    self._busy(self._step)
                except Exception:
                    log.exception("step failed")
                continue
            if self._idle is not None and self.commands.empty():
                did: list[bool] = []
                try:
                    self._busy(lambda did=did: did.append(self._idle()))
                except Exception:
                    log.exception("idle work of the step thread failed")
                if did and did[0]:
                    continue
            self.wake.wait(timeout=1.0)
            self.wake.clear()


async def on_thread(thread: StepThread, fn: Callable[[], Any]):
    """Run `fn` on the step thread between steps and await its result (or its exception)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def run() -> None:
        try:
            value, error = fn(), None
        except BaseException as e:
            value, error = None, e
        resolve(loop, fut, value, error)

    thread.call(run)
    return await fut


def resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, value=None, error: BaseException | None = None) -> None:
    """Complete `fut` from another thread (a no-op if it was cancelled meanwhile)."""

    def done() -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)

    loop.call_soon_threadsafe(done)
