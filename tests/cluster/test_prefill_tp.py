"""A prefill replica that is one attention-TP group of two ranks, on the embedded Ray.

The leader alone takes requests and hands its follower its submits and aborts at the start of every
step; both compute every forward with half the heads each and sum the attention output. The layouts
the leader hands to decode make the same tokens as one process.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import ray
from serving_helpers import EAGER, local_ray, run

from cluster.inprocess import InProcessEngine
from cluster.service import Service
from core.configs import ClusterConfig, PrefillConfig, PrefixCacheConfig, ServeConfig, TierConfig
from core.request import Request
from core.types import SamplingParams

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]
TIER = TierConfig(offload=True, hot_buffer_slots=16, device_budget_bytes=4 * 2**20, host_pool_bytes=32 * 2**20)


def _config(**cluster) -> ServeConfig:
    return ServeConfig(step=EAGER, model="tiny", tier=TIER, prefill=PrefillConfig(max_batch_tokens=128),
                       cluster=ClusterConfig(placement="any", num_prefill=1, num_decode=1, **cluster))


@pytest.fixture(scope="module")
def service(loop, tiny_dir):
    local_ray(tiny_dir)
    svc = Service(_config(prefill_layout="tp2+ep2"), prefix="tptest")
    run(loop, svc.start())
    yield svc
    run(loop, svc.stop(shutdown_ray=False))


def test_tp_prefill_group_equals_one_process(loop, service, tiny_model):
    assert [m.name for m in service.frontend.prefill] == ["tptest-prefill-0-r0"]  # the follower takes no requests
    reqs = [Request(f"t{i}-{time.monotonic_ns()}", tuple((5 * i + 11 * j) % 250 + 6 for j in range(200 + 37 * i)),
                            SamplingParams(max_tokens=16, ignore_eos=True)) for i in range(4)]

    async def go():
        out = await asyncio.gather(*(service.complete(r) for r in reqs))
        return [[e.token.token_id for e in evs] for evs in out]

    got = run(loop, go())
    eng = InProcessEngine(tiny_model, TIER, step=EAGER)
    want = eng.generate(reqs)
    eng.close()
    assert got == [want[r.request_id].token_ids for r in reqs]
    follower = ray.get_actor("tptest-prefill-0-r1", namespace="hisparse")
    stats = ray.get(follower.stats.remote(), timeout=60)
    assert stats.tokens_in == sum(len(r.prompt_token_ids) for r in reqs)  # it computed every chunk with its leader


def test_tp_prefill_refuses_the_prefix_cache(tiny_dir):
    with pytest.raises(ValueError, match="prefix cache"):
        Service(ServeConfig(step=EAGER, model="tiny", prefill=PrefillConfig(prefix_cache=PrefixCacheConfig(enabled=True)),
                            cluster=ClusterConfig(placement="any", prefill_layout="tp2")))
