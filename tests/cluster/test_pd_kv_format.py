"""PD split with packed KV (`--kv-format v4`) on a real local Ray: the prefill actor hands packed rows to the
decode actor (tier on), tokens equal the dense reference numerics, the handoff moves the packed bytes."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray
from serving_helpers import EAGER, local_ray, run

from cluster.inprocess import InProcessEngine
from cluster.service import Service
from core.configs import ClusterConfig, PrefillConfig, ServeConfig, TierConfig
from core.request import Request
from core.types import SamplingParams
from model.loader import load_model

pytestmark = pytest.mark.ray

TIER = TierConfig(offload=True, hot_buffer_slots=16, device_budget_bytes=4 * 2**20, host_pool_bytes=32 * 2**20)


@pytest.fixture(scope="module")
def service(loop, tiny_dir):
    local_ray(tiny_dir)
    cfg = ServeConfig(step=EAGER, model="tiny", kv_format="v4", tier=TIER, prefill=PrefillConfig(max_batch_tokens=256),
                      cluster=ClusterConfig(num_prefill=1, num_decode=1, placement="any", max_restarts=0))
    svc = Service(cfg, prefix="pdkv")
    run(loop, svc.start())
    yield svc
    run(loop, svc.stop(shutdown_ray=False))


def _requests(n: int, prompt_len: int = 60, max_tokens: int = 25):
    return [Request(f"k{i}-{time.monotonic_ns()}", tuple((5 * i + 11 * j) % 250 + 6 for j in range(prompt_len + 37 * i)),
                            SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for i in range(n)]


def test_pd_split_with_packed_kv_equals_dense_reference(loop, service, tiny_dir):
    reqs = _requests(3)

    async def go():
        results = await asyncio.gather(*(service.complete(r) for r in reqs))
        return {r.request_id: [e.token.token_id for e in evs] for r, evs in zip(reqs, results)}

    got = run(loop, go())
    dense = load_model(tiny_dir, kv_format="v4-dense")
    eng = InProcessEngine(dense, TIER, step=EAGER)
    done = eng.generate(reqs)
    eng.close()
    assert got == {r.request_id: done[r.request_id].token_ids for r in reqs}

    # the handoff carried exactly the packed layout's bytes
    req = _requests(1, prompt_len=300, max_tokens=3)[0]
    sent0 = sum(ray.get(p.stats.remote()).bytes_sent for p in service.actors.prefill)
    run(loop, service.complete(req))
    sent1 = sum(ray.get(p.stats.remote()).bytes_sent for p in service.actors.prefill)
    packed = load_model(tiny_dir, kv_format="v4")
    _, layout = packed.prefill(list(req.prompt_token_ids), last_only=True)
    _, plain = load_model(tiny_dir).prefill(list(req.prompt_token_ids), last_only=True)
    assert sent1 - sent0 == layout.total_bytes() < plain.total_bytes()
