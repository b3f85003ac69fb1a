"""Cluster tests: an event loop that outlives each test (the frontend's tasks live on it)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray")


@pytest.fixture(scope="module")
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()
