"""Prefill and decode replicas of two ranks each (DP attention + expert parallelism) on the embedded Ray,
behind real HTTP.

Each rank is its own actor holding half the routed experts; a replica's ranks exchange MoE rows every
forward over gloo, idle ones included; any prefill rank hands its layouts to whichever decode rank the
router chose. Output must equal the single-process engine's, for requests spread over both ranks; a
rank killed mid-stream takes its replica down, the replica is built again, and every request finishes
with the tokens it would have had.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import ray
from serving_helpers import EAGER, complete_killing_prefill, free_port, start_gateway, stop_gateway, stream_with_fault

from cluster.inprocess import InProcessEngine
from core.configs import ClusterConfig, PrefillConfig, ServeConfig, ServerConfig, StepConfig, TierConfig
from core.request import Request
from core.types import SamplingParams

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]
TIER = TierConfig(offload=True, hot_buffer_slots=16, device_budget_bytes=4 * 2**20, host_pool_bytes=32 * 2**20)


@pytest.fixture(scope="module")
def gw(tiny_dir):
    # decode_mode compiled is asked for: a CPU rank of an expert-parallel replica runs the fixed-shape step uncompiled
    cfg = ServeConfig(model="tiny", tier=TIER, prefill=PrefillConfig(max_batch_tokens=256), step=StepConfig(decode_mode="compiled"),
                      cluster=ClusterConfig(placement="any", num_prefill=1, num_decode=1, prefill_layout="dp2+ep2",
                                            decode_layout="dp2+ep2", max_restarts=2),
                      server=ServerConfig(port=free_port()))
    g = start_gateway(cfg, tiny_dir)
    yield g
    stop_gateway(g)


def _prompt(i: int, n: int) -> list[int]:
    return [(7 * i + 13 * j) % 250 + 6 for j in range(n + 9 * i)]


def _reference(tiny_model, prompts, max_tokens):
    eng = InProcessEngine(tiny_model, TIER, step=EAGER)
    reqs = [Request(f"ref{i}", tuple(p), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            for i, p in enumerate(prompts)]
    done = eng.generate(reqs)
    eng.close()
    return [done[r.request_id].token_ids for r in reqs]


def _member_stats(gw):
    return {m.name: ray.get(m.handle.stats.remote(), timeout=60) for m in gw.service.frontend.decode}


def test_replica_serves_http_like_one_process(gw, tiny_model):
    prompts = [_prompt(i, 50) for i in range(6)]
    want = _reference(tiny_model, prompts, 24)

    async def go():
        async with httpx.AsyncClient(base_url=gw.url, timeout=300) as client:
            async def one(p):
                r = await client.post("/v1/completions", json={"model": "tiny", "prompt": p, "max_tokens": 24,
                                                               "temperature": 0, "ignore_eos": True, "logprobs": 0})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["logprobs"]["tokens"]
            return await asyncio.gather(*(one(p) for p in prompts))

    loop = asyncio.new_event_loop()
    try:
        got_text = loop.run_until_complete(go())
    finally:
        loop.close()
    tok = gw.service.tokenizer
    assert got_text == [[tok.decode([t]) for t in ids] for ids in want]
    stats = _member_stats(gw)
    port = gw.service.config.server.port
    assert sorted(stats) == [f"e2e{port}-decode-0-r0", f"e2e{port}-decode-0-r1"]
    assert all(s.handoffs > 0 for s in stats.values()), f"the router used one decode rank only: {stats}"
    assert all(s.step.mode == "fixed_eager" for s in stats.values())  # gloo exchanges cannot be compiled
    sent = [ray.get(m.handle.stats.remote(), timeout=60).handoffs for m in gw.service.frontend.prefill]
    assert len(sent) == 2 and all(n > 0 for n in sent), f"the router used one prefill rank only: {sent}"


def test_rank_killed_mid_stream_fails_over(gw, tiny_model):
    svc = gw.service
    prompts = [_prompt(i, 60) for i in range(4)]
    want = _reference(tiny_model, prompts, 80)
    reqs = [Request(f"k{i}-{time.monotonic_ns()}", tuple(p), SamplingParams(max_tokens=80, ignore_eos=True))
            for i, p in enumerate(prompts)]
    old_ids = {m.name: m.handle._actor_id for m in svc.frontend.decode}

    async def kill(_r):
        victim = svc.frontend.decode[1]
        ray.kill(victim.handle, no_restart=True)
        return victim.name

    async def go():
        got, killed = await stream_with_fault(svc, reqs, 20, kill)
        return [got[r.request_id] for r in reqs], killed

    got, killed = gw.server.run(go(), timeout_s=500)
    assert killed and got == want  # nothing lost, nothing repeated, same tokens
    assert svc.frontend.retries["decode"] >= 1
    # both ranks are new actors (the replica was rebuilt whole) and serve again
    for _ in range(240):
        if all(m.alive for m in svc.frontend.decode) and all(m.handle._actor_id != old_ids[m.name] for m in svc.frontend.decode):
            break
        time.sleep(0.5)
    assert all(m.handle._actor_id != old_ids[m.name] for m in svc.frontend.decode)
    for m in svc.frontend.decode:
        assert ray.get(m.handle.check_integrity.remote(), timeout=120)


def test_prefill_rank_killed_mid_prompt_is_retried(gw, tiny_model):
    """A prefill rank dies while a long prompt is in its prefill: the prefill replica is rebuilt and the
    request's prefill is retried, with the tokens one process makes."""
    svc = gw.service
    prompt = _prompt(3, 4000)  # 16 chunks of 256 tokens: time to kill its rank mid-prompt
    want = _reference(tiny_model, [prompt], 8)[0]
    req = Request(f"p-{time.monotonic_ns()}", tuple(prompt), SamplingParams(max_tokens=8, ignore_eos=True))
    old = {m.name: m.handle._actor_id for m in svc.frontend.prefill}

    before = svc.frontend.retries["prefill"]
    evs = gw.server.run(complete_killing_prefill(svc, req, no_restart=True), timeout_s=500)
    assert svc.frontend.retries["prefill"] >= before + 1
    assert [e.token.token_id for e in evs] == want
    assert all(m.handle._actor_id != old[m.name] for m in svc.frontend.prefill)  # both ranks are new actors
