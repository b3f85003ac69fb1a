"""A real local Ray instance on 127.0.0.1 for the cluster tests, and an event loop that outlives each test."""

from __future__ import annotations

import asyncio

import pytest

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


def run(loop, coro, timeout: float = 300):
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))
