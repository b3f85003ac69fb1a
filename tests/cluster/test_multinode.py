"""Several Ray nodes with prefill/decode roles: placement by role, end-to-end generation, node loss."""

from __future__ import annotations

import asyncio

import pytest
import ray
from ray.cluster_utils import Cluster
from serving_helpers import EAGER, run

from cluster.inprocess import InProcessEngine
from cluster.protocol import ROLE_DECODE, ROLE_PREFILL
from cluster.service import Service
from core.configs import ClusterConfig, DeadlineConfig, ServeConfig, TierConfig
from core.request import Request
from core.types import SamplingParams, WorkerUnavailable

pytestmark = pytest.mark.ray
TIER = TierConfig(offload=True, hot_buffer_slots=16, device_budget_bytes=4 * 2**20, host_pool_bytes=16 * 2**20)


@pytest.fixture(scope="module")
def cluster(tiny_dir):
    ray.shutdown()  # this module's cluster has nodes of its own (see serving_helpers.local_ray)
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False})
    prefill_node = c.add_node(num_cpus=1, resources={ROLE_PREFILL: 1}, node_ip_address="127.0.0.1")
    decode_node = c.add_node(num_cpus=1, resources={ROLE_DECODE: 1}, node_ip_address="127.0.0.1")
    c.wait_for_nodes()
    ray.init(address=c.address, runtime_env={"env_vars": {"HISPARSE_CACHE": str(tiny_dir.parent.parent)}})
    yield c, prefill_node, decode_node
    ray.shutdown()
    c.shutdown()


def _req(i: int, n: int = 12):
    return Request(f"mn-{i}", tuple(range(10 + i, 60 + i)), SamplingParams(max_tokens=n, ignore_eos=True))


def test_roles_place_actors_and_survive_node_loss(loop, cluster, tiny_model):
    c, prefill_node, decode_node = cluster
    cfg = ServeConfig(step=EAGER, model="tiny", tier=TIER, cluster=ClusterConfig(address=c.address, placement="resources", max_restarts=3),
                      deadlines=DeadlineConfig(queue_timeout_s=3.0))
    svc = Service(cfg, prefix="mn")
    run(loop, svc.start())
    try:
        assert svc.actors.prefill_info[0].node_id == prefill_node.node_id
        assert svc.actors.decode_info[0].node_id == decode_node.node_id

        eng = InProcessEngine(tiny_model, TIER, step=EAGER)
        expect = eng.generate([_req(0)])["mn-0"].token_ids
        assert [e.token.token_id for e in run(loop, svc.complete(_req(0)))] == expect

        # the decode node goes away hard: no decode actor is left, requests get a clear error
        c.remove_node(decode_node, allow_graceful=False)

        async def fails():
            for attempt in range(60):
                try:
                    await svc.complete(_req(100 + attempt, 4))
                except WorkerUnavailable as e:
                    return str(e)
                await asyncio.sleep(0.5)
            return None

        msg = run(loop, fails())
        assert msg is not None and "decode actor" in msg

        # a new decode node joins: Ray restarts the actor there and it rejoins routing
        new_node = c.add_node(num_cpus=1, resources={ROLE_DECODE: 1}, node_ip_address="127.0.0.1")
        c.wait_for_nodes()

        async def back():
            for _ in range(240):
                if svc.frontend.decode[0].alive:
                    return True
                await asyncio.sleep(0.5)
            return False

        assert run(loop, back())
        info = ray.get(svc.actors.decode[0].ready.remote())
        assert info.node_id == new_node.node_id
        assert [e.token.token_id for e in run(loop, svc.complete(_req(1)))] == eng.generate([_req(1)])["mn-1"].token_ids
        assert ray.get(svc.actors.decode[0].check_integrity.remote())
        eng.close()
    finally:
        run(loop, svc.stop(shutdown_ray=False))


def test_decode_replica_lands_whole_on_a_decode_node(loop, cluster, tiny_model):
    """A replica's ranks share one placement group of role-resource bundles: both land on the one node
    that advertises room for two decode actors, and serve like one process."""
    c, _, _ = cluster
    node = c.add_node(num_cpus=2, resources={ROLE_DECODE: 2}, node_ip_address="127.0.0.1")
    c.wait_for_nodes()
    cfg = ServeConfig(step=EAGER, model="tiny", tier=TIER, cluster=ClusterConfig(address=c.address, placement="resources",
                                                                     decode_layout="dp2+ep2"))
    svc = Service(cfg, prefix="mnr")
    run(loop, svc.start())
    try:
        assert [i.node_id for i in svc.actors.decode_info] == [node.node_id] * 2
        assert [i.rank for i in svc.actors.decode_info] == [0, 1]
        eng = InProcessEngine(tiny_model, TIER, step=EAGER)
        reqs = [_req(200 + i) for i in range(3)]
        expect = eng.generate(reqs)

        async def go():
            return await asyncio.gather(*(svc.complete(r) for r in reqs))

        got = run(loop, go())
        assert [[e.token.token_id for e in evs] for evs in got] == [expect[r.request_id].token_ids for r in reqs]
    finally:
        run(loop, svc.stop(shutdown_ray=False))
