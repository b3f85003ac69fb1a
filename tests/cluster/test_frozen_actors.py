"""Failures real traffic found, on a real local Ray with two prefill and two decode actors.

- lm-eval's traffic: hundreds of sequential `max_tokens: 1` requests. Each ends with its first token, so
  its decode reservation is dropped and the decode worker goes idle and checks its integrity — while the
  next request's reservation arrives from the actor's event loop. That check once read the allocator
  mid-reservation and failed, uncounted, leaking an owner entry each time; now it holds the allocation
  lock, and every failure is counted.
- A frozen actor (SIGSTOP) cannot report itself stuck: it is seen from outside — it answers nothing — and
  its requests move after `step_hang_s`; it comes back into routing when it answers again (SIGCONT).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from serving_helpers import EAGER, local_ray, run

from cluster.membership import SILENCE_MIN_S
from cluster.service import Service
from core.configs import ClusterConfig, DeadlineConfig, PrefillConfig, ServeConfig, TierConfig
from core.request import Request
from core.types import SamplingParams

pytestmark = [pytest.mark.ray, pytest.mark.slow]

TIER = TierConfig(offload=True, hot_buffer_slots=16, device_budget_bytes=4 * 2**20, host_pool_bytes=16 * 2**20)
HANG_S = 4.0


@pytest.fixture(scope="module")
def service(loop, tiny_dir):
    local_ray(tiny_dir)
    cfg = ServeConfig(step=EAGER, model="tiny", tier=TIER, prefill=PrefillConfig(max_batch_tokens=256),
                      cluster=ClusterConfig(num_prefill=2, num_decode=2, placement="any", max_restarts=1,
                                            prefill_num_cpus=0.5, decode_num_cpus=0.5),
                      deadlines=DeadlineConfig(step_hang_s=HANG_S, token_timeout_s=60.0, queue_timeout_s=30.0,
                                               max_request_retries=2))
    svc = Service(cfg, prefix="frozen")
    run(loop, svc.start())
    yield svc
    run(loop, svc.stop(shutdown_ray=False))


def _req(i: int, max_tokens: int, prompt_len: int = 30) -> Request:
    ids = tuple((7 * i + 3 * j) % 250 + 6 for j in range(prompt_len))
    return Request(f"f{i}-{time.monotonic_ns()}", ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _tables_settle(loop, service, timeout_s: float = 20.0) -> dict:
    """Wait for every per-request table to be back at zero (the decode actors report once a second)."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = service.frontend.stats()
        if not any(st["tables"].values()) and st["running"] == st["reserved"] == 0:
            return st
        if time.monotonic() > deadline:
            return st
        run(loop, asyncio.sleep(0.5))


def test_many_sequential_one_token_requests_leave_nothing_and_fail_no_check(loop, service):
    async def go():
        for i in range(200):
            evs = await service.complete(_req(i, max_tokens=1))
            assert len(evs) == 1 and evs[0].finish_reason == "length", (i, evs)

    run(loop, go())
    st = _tables_settle(loop, service)
    assert st["tables"] == {k: 0 for k in st["tables"]}, st["tables"]  # decode_owners among them
    # idle checks ran (one each time a decode actor empties; reports lag by up to a second), none failed
    assert st["integrity_errors"] == 0 and st["integrity_checks"] >= 20, {k: st[k] for k in ("integrity_errors", "integrity_checks")}


def _member_with_work(members, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for m in members:
            if m.keys or m.load:
                return m
        time.sleep(0.05)
    raise AssertionError("no actor got a request")


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_frozen_actor_loses_its_requests_and_comes_back(loop, service, role):
    fe = service.frontend
    members = fe.decode if role == "decode" else fe.prefill
    # decode: streams that run long enough to be caught mid-way; prefill: long prompts, caught in prefill
    reqs = [_req(100 + i, max_tokens=150) for i in range(4)] if role == "decode" else \
        [_req(200 + i, max_tokens=4, prompt_len=3000) for i in range(4)]

    async def go():
        tasks = [asyncio.ensure_future(service.complete(r)) for r in reqs]
        await asyncio.sleep(0.3)
        victim = await asyncio.to_thread(_member_with_work, members)
        os.kill(victim.info.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            moved_after = time.monotonic() - t0
        finally:
            os.kill(victim.info.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while not victim.usable and time.monotonic() < deadline:  # answering again: back in routing
            await asyncio.sleep(0.2)
        return results, moved_after, victim

    retries = dict(fe.retries)
    results, moved_after, victim = run(loop, go())
    assert [len(evs) for evs in results] == [r.sampling.max_tokens for r in reqs]  # every token, none lost or repeated
    assert [[e.index for e in evs] for evs in results] == [list(range(r.sampling.max_tokens)) for r in reqs]
    assert fe.retries[role if role == "decode" else "prefill"] > retries[role if role == "decode" else "prefill"]
    assert moved_after < max(HANG_S, SILENCE_MIN_S) + 40  # moved on the hang deadline, not the token/prefill timeouts
    assert victim.usable
    after = run(loop, service.complete(_req(300, max_tokens=3)))
    assert len(after) == 3
