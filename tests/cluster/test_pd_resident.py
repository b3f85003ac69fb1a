"""Resident C4 entries (`--resident on`) through the PD split on a real local Ray: the decode actor's budget holds
every request in the tiered way but only a few of them resident, so requests become resident while there is
room and reservations that find the room held by resident pages are refused, freed by the next step and retried.
The tokens are the in-process engine's without residency."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import ray
import torch
from serving_helpers import EAGER, local_ray, run

from cachetier.geometry import Geometry
from cluster.inprocess import InProcessEngine
from cluster.service import Service
from core.configs import ClusterConfig, PrefillConfig, ServeConfig, TierConfig
from core.request import Request
from core.types import SamplingParams

pytestmark = pytest.mark.ray

N, PROMPT, MAX_TOKENS = 8, 60, 200


def _tier(cfg) -> TierConfig:
    base = TierConfig(offload=True, hot_buffer_slots=16, device_budget_bytes=4 * 2**20, host_pool_bytes=32 * 2**20,
                      resident=True)
    g = Geometry(cfg, base, torch.float32)  # the service's default dtype on this CPU
    per = g.group_pages + g.blocks_for(PROMPT + 9 * N + MAX_TOKENS)  # one request in the tiered way
    pages = -(-(N * per + g.group_pages) // g.group_pages) * g.group_pages  # all of them, or a few resident
    return dataclasses.replace(base, device_budget_bytes=g.device_bytes(pages))


@pytest.fixture(scope="module")
def service(loop, tiny_dir, tiny_model):
    local_ray(tiny_dir)
    cfg = ServeConfig(step=EAGER, model="tiny", tier=_tier(tiny_model.cfg), prefill=PrefillConfig(max_batch_tokens=256),
                      cluster=ClusterConfig(num_prefill=1, num_decode=1, placement="any", max_restarts=1))
    svc = Service(cfg, prefix="pdres")
    run(loop, svc.start())
    yield svc
    run(loop, svc.stop(shutdown_ray=False))


def _requests():
    out = []
    for i in range(N):
        ids = tuple((5 * i + 11 * j) % 250 + 6 for j in range(PROMPT + 9 * i))
        sp = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0 if i % 2 == 0 else 0.8, seed=500 + i)
        out.append(Request(f"res{i}-{time.monotonic_ns()}", ids, sp))
    return out


def test_pd_with_resident_entries_gives_the_tiered_tokens(loop, service, tiny_model):
    reqs = _requests()
    eng = InProcessEngine(tiny_model, dataclasses.replace(_tier(tiny_model.cfg), resident=False,
                                                          device_budget_bytes=64 * 2**20), step=EAGER)
    done = eng.generate(reqs)
    eng.close()
    want = {r.request_id: done[r.request_id].token_ids for r in reqs}

    async def go():
        first = [asyncio.ensure_future(service.complete(r)) for r in reqs[:2]]
        await asyncio.sleep(0.5)  # the first two decode, resident, when the rest arrive
        results = await asyncio.gather(*first, *(service.complete(r) for r in reqs[2:]))
        return {r.request_id: [e.token.token_id for e in evs] for r, evs in zip(reqs, results)}

    assert run(loop, go()) == want
    (decode,) = service.actors.decode
    stats = ray.get(decode.stats.remote(), timeout=60)
    assert stats.promotions >= 2 and stats.demotions >= 1, stats
    assert stats.running == 0 and stats.device_bytes_used == 0 and stats.host_bytes_used == 0
    assert ray.get(decode.check_integrity.remote(), timeout=120)
