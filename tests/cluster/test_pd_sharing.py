"""Requests sharing a prompt prefix through the PD split on a real local Ray (`--share-prefixes`): with two decode
actors, siblings of a running request go to the actor it runs on, hold its first pages by reference, their handoffs
leave those pages out, and their tokens are the in-process engine's, where each holds its own copy."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import ray
from serving_helpers import EAGER, pd_service, run

from cachetier.layout import pack_layout, without_prefix
from cluster.inprocess import InProcessEngine
from core.configs import TierConfig
from core.request import Request
from core.types import SamplingParams

pytestmark = pytest.mark.ray

TIER = TierConfig(offload=True, hot_buffer_slots=16, device_budget_bytes=8 * 2**20, host_pool_bytes=32 * 2**20,
                  share_prefixes=2)
PREFIX, PAGE = 600, 256


@pytest.fixture(scope="module")
def service(loop, tiny_dir):
    yield from pd_service(loop, tiny_dir, TIER, "pdshare")


def _stats(service):
    return {s.name: s for s in ray.get([d.stats.remote() for d in service.actors.decode], timeout=60)}


def test_siblings_of_a_running_request_share_its_pages(loop, service, tiny_model):
    prefix = [(11 * j) % 250 + 6 for j in range(PREFIX)]
    first = Request(f"lead-{time.monotonic_ns()}", tuple(prefix + [7] * 30), SamplingParams(max_tokens=160, ignore_eos=True))
    siblings = [Request(f"sib{i}-{time.monotonic_ns()}", tuple(prefix + [(5 * j + i) % 250 + 6 for j in range(40 + 90 * i)]),
                        SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8 * i, seed=3 + i)) for i in range(2)]
    before = _stats(service)

    async def scenario():
        lead = asyncio.create_task(service.complete(first))
        while not any(s.shared_pages_now for s in _stats(service).values()):  # the first is filled: its pages registered
            await asyncio.sleep(0.05)
        where = next(n for n, s in _stats(service).items() if s.shared_pages_now)
        rest = await asyncio.gather(*(service.complete(r) for r in siblings))
        return where, [await lead, *rest]

    where, outs = run(loop, scenario())
    after = _stats(service)
    eng = InProcessEngine(tiny_model, dataclasses.replace(TIER, share_prefixes=0), step=EAGER)
    try:
        for req, got in zip([first, *siblings], outs):
            assert [e.token.token_id for e in got] == eng.generate([req])[req.request_id].token_ids, req.request_id
    finally:
        eng.close()
    sent = {n: after[n].handoff_bytes - before[n].handoff_bytes for n in after}
    assert sum(after[n].handoffs - before[n].handoffs for n in after) == 3
    assert after[where].handoffs - before[where].handoffs == 3  # the siblings went where the first one runs
    layouts = [tiny_model.prefill(list(r.prompt_token_ids), last_only=True)[1] for r in (first, *siblings)]
    held = PREFIX // PAGE * PAGE  # the first's full prompt pages the siblings share
    packed = [pack_layout(lay, "x").tensor_bytes for lay in layouts]
    left_out = [pack_layout(without_prefix(lay, tiny_model.cfg, held), "x").tensor_bytes for lay in layouts[1:]]
    assert sent[where] == packed[0] + sum(left_out) and all(a < b for a, b in zip(left_out, packed[1:]))
    s, b = after[where], before[where]
    assert s.share_shared_pages - b.share_shared_pages == 2 * (PREFIX // PAGE)  # at reservation: left out of the handoff
    assert s.share_shared_at_fill == b.share_shared_at_fill
    assert all(x.running == 0 and x.device_bytes_used == 0 and x.shared_pages_now == 0 for x in after.values())
    assert all(ray.get([d.check_integrity.remote() for d in service.actors.decode], timeout=120))
