"""PD split on a real local Ray: equality with the in-process engine, handoff accounting, failures."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray
from serving_helpers import EAGER, complete_killing_prefill, local_ray, member_holding, run, stream_with_fault

from cluster.inprocess import InProcessEngine
from cluster.service import Service
from core.configs import ClusterConfig, DeadlineConfig, PrefillConfig, ServeConfig, TierConfig
from core.request import Request
from core.types import SamplingParams, WorkerUnavailable

pytestmark = pytest.mark.ray

TIER = TierConfig(offload=True, hot_buffer_slots=16, device_budget_bytes=4 * 2**20, host_pool_bytes=32 * 2**20)


@pytest.fixture(scope="module")
def service(loop, tiny_dir):
    local_ray(tiny_dir)
    cfg = ServeConfig(
        step=EAGER,
        model="tiny", tier=TIER, prefill=PrefillConfig(max_batch_tokens=256),
        cluster=ClusterConfig(num_prefill=2, num_decode=2, placement="any", max_restarts=2),
        deadlines=DeadlineConfig(queue_timeout_s=5.0),  # with no decode actor left, how long a request waits for one
    )
    svc = Service(cfg, prefix="pdtest")
    run(loop, svc.start())
    yield svc
    run(loop, svc.stop(shutdown_ray=False))


def _requests(n: int, prompt_len: int = 40, max_tokens: int = 30):
    out = []
    for i in range(n):
        ids = tuple((7 * i + 13 * j) % 250 + 6 for j in range(prompt_len + 9 * i))
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0 if i % 2 == 0 else 0.8, seed=100 + i)
        out.append(Request(f"q{i}-{time.monotonic_ns()}", ids, sp))
    return out


def _inprocess(tiny_model, reqs):
    eng = InProcessEngine(tiny_model, TIER, step=EAGER)
    done = eng.generate(reqs)
    eng.close()
    return {r.request_id: done[r.request_id].token_ids for r in reqs}


def test_every_actor_says_where_and_how_it_computes(service):
    """What the start-up log prints for each actor: device, dtype, KV format, and for decode its step mode
    (here the CPU: the cluster has no GPU, so no actor reserves one)."""
    actors = service.actors
    assert [i.describe for i in actors.prefill_info] == ["cpu, float32, kv bf16"] * 2
    assert [i.describe for i in actors.decode_info] == ["cpu, float32, kv bf16, decode eager"] * 2


def test_pd_equals_in_process_for_concurrent_requests(loop, service, tiny_model):
    reqs = _requests(6)

    async def go():
        results = await asyncio.gather(*(service.complete(r) for r in reqs))
        return {r.request_id: [e.token.token_id for e in evs] for r, evs in zip(reqs, results)}

    got = run(loop, go())
    assert got == _inprocess(tiny_model, reqs)
    # every request ran to length with indices 0..n-1 and one finish reason at the end
    evs = run(loop, service.complete(_requests(1, max_tokens=12)[0]))
    assert [e.index for e in evs] == list(range(12))
    assert [e.finish_reason for e in evs] == [None] * 11 + ["length"]


def test_handoff_bytes_equal_layout_size(loop, service, tiny_model):
    req = _requests(1, prompt_len=300, max_tokens=5)[0]

    def moved():
        sent = sum(ray.get(p.stats.remote()).bytes_sent for p in service.actors.prefill)
        got = sum(ray.get(d.stats.remote()).handoff_bytes for d in service.actors.decode)
        return sent, got

    sent0, got0 = moved()
    run(loop, service.complete(req))
    sent1, got1 = moved()
    _, layout = tiny_model.prefill(list(req.prompt_token_ids), last_only=True)
    assert sent1 - sent0 == got1 - got0 == layout.total_bytes()  # exactly the layout's tensors, once


def _decode_integrity(service):
    """Every decode actor answers and passes the integrity check (a restarted one is waited for)."""
    for d in service.actors.decode:
        assert ray.get(d.check_integrity.remote(), timeout=120)


def test_decode_actor_dies_mid_stream(loop, service, tiny_model):
    reqs = _requests(2, prompt_len=60, max_tokens=120)
    ref = _inprocess(tiny_model, reqs)

    async def kill(r):
        victim = member_holding(service.frontend.decode, r.request_id)
        ray.kill(victim.handle, no_restart=False)
        return victim.name

    async def go():
        return await stream_with_fault(service, reqs, 30, kill)

    got, killed = run(loop, go())
    assert killed and got == ref  # nothing lost, nothing repeated, same tokens
    assert service.frontend.retries["decode"] >= 1

    async def rejoined():
        for _ in range(120):
            if all(m.alive for m in service.frontend.decode):
                return True
            await asyncio.sleep(0.5)
        return False

    assert run(loop, rejoined())
    _decode_integrity(service)
    again = _requests(1, max_tokens=10)[0]
    assert [e.token.token_id for e in run(loop, service.complete(again))] == _inprocess(tiny_model, [again])[again.request_id]


def test_prefill_actor_dies_mid_request(loop, service, tiny_model):
    req = _requests(1, prompt_len=6000, max_tokens=8)[0]  # 24 prefill steps of 256 tokens: time to kill it

    before = service.frontend.retries["prefill"]
    evs = run(loop, complete_killing_prefill(service, req, no_restart=False))
    assert service.frontend.retries["prefill"] == before + 1
    assert [e.token.token_id for e in evs] == _inprocess(tiny_model, [req])[req.request_id]


def test_client_leaving_mid_stream_frees_both_tiers(loop, service):
    req = _requests(1, prompt_len=100, max_tokens=400)[0]

    async def go():
        agen = service.generate(req)
        n = 0
        async for _ in agen:
            n += 1
            if n == 10:
                break
        await agen.aclose()
        for _ in range(100):
            stats = await asyncio.gather(*(d.stats.remote() for d in service.actors.decode))
            if all(s.running == 0 and s.waiting == 0 for s in stats):
                return stats
            await asyncio.sleep(0.1)
        return stats

    stats = run(loop, go())
    assert all(s.running == 0 and s.device_bytes_used == 0 and s.host_bytes_used == 0 for s in stats)
    _decode_integrity(service)


def test_request_larger_than_any_budget_is_refused(loop, service):
    from core.types import NeverFitsError

    big = Request("too-big", (5, 6, 7), SamplingParams(max_tokens=130_000))  # > the 4 MiB budget
    with pytest.raises(NeverFitsError, match="max_tokens"):
        run(loop, service.complete(big))


def test_no_decode_actor_left_is_a_clear_error(loop, service):
    run(loop, service.frontend.stop())  # keep the poll loops from reviving them during the check
    for m in service.frontend.decode:
        m.alive = False
    try:
        with pytest.raises(WorkerUnavailable, match="no decode actor"):
            run(loop, service.complete(_requests(1, max_tokens=5)[0]))
    finally:
        for m in service.frontend.decode:
            m.alive = True
        run(loop, service.frontend.start())
