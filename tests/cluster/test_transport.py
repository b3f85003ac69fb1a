"""Ray's direct tensor transport for the handoff (gloo between CPU actors): same tokens, same bytes."""

from __future__ import annotations

import asyncio

import pytest
import ray
from serving_helpers import EAGER, local_ray, run

from cluster.inprocess import InProcessEngine
from cluster.service import Service
from core.configs import ClusterConfig, ServeConfig, TierConfig
from core.request import Request
from core.types import SamplingParams

pytestmark = pytest.mark.ray
TIER = TierConfig(offload=True, hot_buffer_slots=16, device_budget_bytes=4 * 2**20, host_pool_bytes=16 * 2**20)


def test_gloo_transport_hands_layouts_over(loop, tiny_dir, tiny_model):
    local_ray(tiny_dir)
    svc = Service(ServeConfig(step=EAGER, model="tiny", tier=TIER, cluster=ClusterConfig(placement="any", transport="gloo")), prefix="gloo")
    try:
        run(loop, svc.start())
        reqs = [Request(f"g{i}", tuple(range(20 + i, 90 + 3 * i)), SamplingParams(max_tokens=10, ignore_eos=True))
                for i in range(3)]

        async def go():
            return await asyncio.gather(*(svc.complete(r) for r in reqs))

        got = {r.request_id: [e.token.token_id for e in evs] for r, evs in zip(reqs, run(loop, go()))}
        eng = InProcessEngine(tiny_model, TIER, step=EAGER)
        ref = {k: v.token_ids for k, v in eng.generate(reqs).items()}
        eng.close()
        assert got == ref
        layouts = [tiny_model.prefill(list(r.prompt_token_ids), last_only=True)[1] for r in reqs]
        assert ray.get(svc.actors.decode[0].stats.remote()).handoff_bytes == sum(lay.total_bytes() for lay in layouts)
        st = ray.get(svc.actors.prefill[0].stats.remote())
        assert st.held_layouts == 0 and st.held_bytes == 0  # every handoff finished and let go of its layout
    finally:
        run(loop, svc.stop(shutdown_ray=False))
