"""Every way a request can end frees what it holds, and failures reach exactly their requests:
client gone at the first token, a refused or mismatched handoff, a cancel during prefill, a poisoned
request, a hung step thread, a full decode side (503 before any token), a gateway that stops polling."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray
from serving_helpers import EAGER, local_ray, member_holding, run, stream_with_fault

from cachetier.layout import pack_layout
from cluster.inprocess import InProcessEngine
from cluster.protocol import DecodeTarget, Handoff, RequestGone
from cluster.service import Service
from core.configs import ClusterConfig, DeadlineConfig, FaultConfig, PrefillConfig, ServeConfig, TierConfig
from core.request import Attempt, Request
from core.types import CapacityError, HisparseError, RequestFailed, SampledToken, SamplingParams

pytestmark = pytest.mark.ray

TIER = TierConfig(offload=True, hot_buffer_slots=16, device_budget_bytes=4 * 2**20, host_pool_bytes=64 * 2**20)
POISON = 3  # token ids the generated prompts never contain (they use 6..255)
DEADLINES = DeadlineConfig(queue_timeout_s=2.0, step_hang_s=1.5, token_timeout_s=30.0, subscriber_timeout_s=3.0,
                           max_request_retries=1)


@pytest.fixture(scope="module")
def service(loop, tiny_dir):
    local_ray(tiny_dir)
    cfg = ServeConfig(step=EAGER, model="tiny", tier=TIER, prefill=PrefillConfig(max_batch_tokens=256),
                      cluster=ClusterConfig(num_prefill=1, num_decode=2, placement="any", max_restarts=1,
                                            prefill_num_cpus=0.5, decode_num_cpus=0.5),
                      deadlines=DEADLINES, faults=FaultConfig(poison_token_id=POISON))
    svc = Service(cfg, prefix="paths")
    run(loop, svc.start())
    yield svc
    run(loop, svc.stop(shutdown_ray=False))


def _req(i: int, prompt_len: int = 50, max_tokens: int = 20, poison: bool = False) -> Request:
    ids = [(11 * i + 5 * j) % 250 + 6 for j in range(prompt_len)]
    if poison:
        ids[prompt_len // 2] = POISON
    return Request(f"p{i}-{time.monotonic_ns()}", tuple(ids), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _alone(tiny_model, reqs):
    eng = InProcessEngine(tiny_model, TIER, step=EAGER)
    out = {k: v.token_ids for k, v in eng.generate(reqs).items()}
    eng.close()
    return out


def _settled(loop, service, timeout_s: float = 30.0) -> None:
    """Wait until nothing is held anywhere: no layout in a handoff, no reservation, no running request, no bytes."""
    async def check():
        deadline = time.monotonic() + timeout_s
        while True:
            p = await asyncio.gather(*(a.stats.remote() for a in service.actors.prefill))
            d = await asyncio.gather(*(a.stats.remote() for a in service.actors.decode))
            held = sum(s.held_layouts + s.held_bytes + s.pending for s in p)
            busy = sum(s.running + s.reserved + s.waiting + s.device_bytes_used + s.host_bytes_used + s.owners
                       for s in d)
            if held == 0 and busy == 0 and not service.frontend.collectors:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"still held: prefill {p}, decode {d}, collectors {list(service.frontend.collectors)}")
            await asyncio.sleep(0.2)

    run(loop, check())
    for a in service.actors.decode:
        assert ray.get(a.check_integrity.remote(), timeout=60)


def test_client_gone_at_the_first_token(loop, service):
    async def go():
        outs = service.outputs(_req(1, max_tokens=200))
        first = await outs.__anext__()
        await outs.aclose()
        return first

    first = run(loop, go())
    assert len(first.events) == 1 and first.events[0].index == 0
    _settled(loop, service)


def test_cancel_during_prefill(loop, service):
    req = _req(2, prompt_len=5000, max_tokens=10)  # about 20 prefill steps of 256 tokens

    async def go():
        task = asyncio.ensure_future(service.complete(req))
        while not any(m.load for m in service.frontend.prefill):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(loop, go())
    _settled(loop, service)


def test_refused_and_mismatched_handoffs_let_go_of_the_layout(loop, service, tiny_model):
    p, d = service.actors.prefill[0], service.actors.decode[0]
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    ok, _, _ = ray.get(d.reserve.remote("test", "gone.0", 100))
    assert ok
    ray.get(d.abort.remote(["gone.0"]))  # the reservation is gone before the layout arrives
    with pytest.raises(RequestGone):
        ray.get(p.prefill.remote(Attempt.of(Request("gone.0", tuple(range(6, 40)), sp, 0)), DecodeTarget(d, "d", "test")))
    _, layout = tiny_model.prefill(list(range(6, 40)), last_only=True)
    packed = pack_layout(layout, "v1:not-this-model")
    h = Handoff(Attempt(Request("odd", (), sp, 0, prompt_len=layout.num_tokens), "odd.0", owner="test"), SampledToken(7), 1,
                "v1:not-this-model", packed.tensor_bytes)
    with pytest.raises(HisparseError, match="format"):
        ray.get(d.admit.remote(h, packed))
    _settled(loop, service)


def test_poisoned_request_fails_clearly_and_others_are_untouched(loop, service, tiny_model):
    good = [_req(10 + i, max_tokens=40) for i in range(3)]
    bad = _req(20, max_tokens=40, poison=True)

    async def go():
        return await asyncio.gather(*(service.complete(r) for r in [*good, bad]), return_exceptions=True)

    *got, failed = run(loop, go())
    assert isinstance(failed, RequestFailed) and "--max-request-retries" in str(failed)
    assert {r.request_id: [e.token.token_id for e in evs] for r, evs in zip(good, got)} == _alone(tiny_model, good)
    assert all(m.alive for m in service.frontend.decode)  # nobody was taken down
    _settled(loop, service)


def test_hung_step_thread_is_taken_out_and_its_requests_move(loop, service, tiny_model):
    reqs = [_req(30 + i, max_tokens=120) for i in range(2)]

    async def pause(r):
        victim = member_holding(service.frontend.decode, r.request_id)
        await victim.handle.pause_step_thread.remote(4.0)
        return victim

    async def go():
        return await stream_with_fault(service, reqs, 10, pause)

    got, victim = run(loop, go())
    assert got == _alone(tiny_model, reqs)  # moved to the other actor: nothing lost or repeated
    assert service.frontend.retries["decode"] >= 1

    async def back():
        for _ in range(100):
            if not victim.hung:
                return True
            await asyncio.sleep(0.1)
        return False

    assert run(loop, back())  # progress again: it rejoins
    _settled(loop, service)


def test_full_decode_side_is_503_before_any_token(loop, service):
    big = [_req(40 + i, prompt_len=60, max_tokens=60_000) for i in range(2)]  # each takes most of one actor's pages

    async def go():
        holders = [service.outputs(r) for r in big]
        for h in holders:
            await h.__anext__()
        t0 = time.monotonic()
        with pytest.raises(CapacityError, match="queue-timeout-s"):
            await service.complete(_req(42, prompt_len=60, max_tokens=60_000))
        waited = time.monotonic() - t0
        for h in holders:
            await h.aclose()
        return waited

    assert run(loop, go()) >= DEADLINES.queue_timeout_s * 0.9
    _settled(loop, service)


def test_a_gateway_that_stops_polling_is_dropped(loop, service):
    d = service.actors.decode[1]
    ok, _, _ = ray.get(d.reserve.remote("ghost", "ghost.0", 200))
    assert ok and ray.get(d.stats.remote()).reserved == 1
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        st = ray.get(d.stats.remote())
        if st.reserved == 0 and st.dropped_subscribers >= 1:
            break
        time.sleep(0.3)
    else:
        raise AssertionError(f"the silent gateway's reservation is still held: {st}")
    _settled(loop, service)
