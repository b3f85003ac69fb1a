"""Speculative decoding through the PD split on a real local Ray: the decode actors load the MTP head and draft on
their side (the first draft of a request comes from its first decode step: the handoff stays the layout spec-off
sends), and every token equals the in-process engine's with speculation off, greedy and seeded sampled, also for
requests retried on another decode actor after theirs died mid-stream."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import ray
from serving_helpers import EAGER, local_ray, member_holding, run, stream_with_fault

from cluster.inprocess import InProcessEngine
from cluster.service import Service
from core.configs import ClusterConfig, PrefillConfig, ServeConfig, TierConfig
from core.request import Request
from core.types import SamplingParams

pytestmark = pytest.mark.ray

TIER = TierConfig(offload=True, device_budget_bytes=4 * 2**20, host_pool_bytes=32 * 2**20, speculative_tokens=3)


@pytest.fixture(scope="module")
def service(loop, tiny_dir):
    local_ray(tiny_dir)
    cfg = ServeConfig(step=dataclasses.replace(EAGER, speculative_adaptive=False), model="tiny", tier=TIER,
                      prefill=PrefillConfig(max_batch_tokens=256),
                      cluster=ClusterConfig(num_prefill=1, num_decode=2, placement="any", max_restarts=2))
    svc = Service(cfg, prefix="pdspec")
    run(loop, svc.start())
    yield svc
    run(loop, svc.stop(shutdown_ray=False))


def _requests(n: int, prompt_len: int = 50, max_tokens: int = 40):
    out = []
    for i in range(n):
        ids = tuple((11 * i + 7 * j) % 250 + 6 for j in range(prompt_len + 13 * i))
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0 if i % 2 == 0 else 0.8, seed=300 + i)
        out.append(Request(f"s{i}-{time.monotonic_ns()}", ids, sp))
    return out


def _spec_off(tiny_model, reqs):
    eng = InProcessEngine(tiny_model, dataclasses.replace(TIER, speculative_tokens=0), step=EAGER)
    done = eng.generate(reqs)
    eng.close()
    return {r.request_id: done[r.request_id].token_ids for r in reqs}


def _speculated(service) -> list[dict]:
    return [ray.get(m.handle.stats.remote(), timeout=60).speculation for m in service.frontend.decode if m.alive]


def test_pd_with_speculation_gives_spec_offs_tokens(loop, service, tiny_model):
    reqs = _requests(4)

    async def go():
        results = await asyncio.gather(*(service.complete(r) for r in reqs))
        return {r.request_id: [e.token.token_id for e in evs] for r, evs in zip(reqs, results)}

    assert run(loop, go()) == _spec_off(tiny_model, reqs)
    spec = [s for s in _speculated(service) if s and s["steps"]]
    assert spec and all(s["acceptance_length"] > 1.0 for s in spec), spec


def test_a_retried_request_gives_the_same_tokens(loop, service, tiny_model):
    reqs = _requests(2, prompt_len=60, max_tokens=90)
    ref = _spec_off(tiny_model, reqs)

    async def kill(r):
        victim = member_holding(service.frontend.decode, r.request_id)
        ray.kill(victim.handle, no_restart=False)
        return victim.name

    got, killed = run(loop, stream_with_fault(service, reqs, 25, kill))
    assert killed and got == ref
    assert service.frontend.retries["decode"] >= 1
