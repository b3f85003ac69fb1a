"""A chat's follow-up turns through the PD split on a real local Ray (`--retain-bytes`): with two decode actors,
each next turn goes back to the one that kept the previous prompt's pages, its handoff carries only the pages
after them and the state, and its tokens are the in-process engine's from whole layouts."""

from __future__ import annotations

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
                  retain_bytes=8 * 2**20)
TURNS, USER, MAX_TOKENS, PAGE = 3, 300, 20, 256


@pytest.fixture(scope="module")
def service(loop, tiny_dir):
    yield from pd_service(loop, tiny_dir, TIER, "pdturn")


def _handoff_bytes(service) -> dict[str, int]:
    return {s.name: s.handoff_bytes for s in ray.get([d.stats.remote() for d in service.actors.decode], timeout=60)}


def test_follow_up_turns_go_back_and_send_only_the_new_pages(loop, service, tiny_model):
    eng = InProcessEngine(tiny_model, dataclasses.replace(TIER, retain_bytes=0), step=EAGER)
    try:
        for c in range(2):
            history: list[int] = []
            where: str | None = None
            for t in range(TURNS):
                prompt = history + [(7 * c + 13 * t + 3 * j) % 250 + 6 for j in range(USER)]
                sp = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.8 if c else 0.0, seed=40 + t)
                req = Request(f"chat{c}.{t}-{time.monotonic_ns()}", tuple(prompt), sp)
                before = _handoff_bytes(service)
                got = [e.token.token_id for e in run(loop, service.complete(req))]
                want = eng.generate([req])[req.request_id].token_ids
                assert got == want, (c, t)
                after = _handoff_bytes(service)
                (went,) = [n for n in after if after[n] != before[n]]
                sent = after[went] - before[went]
                _, layout = tiny_model.prefill(prompt, last_only=True)
                kept = len(history) // PAGE * PAGE if t else 0  # the previous turn's prompt pages
                if t:
                    assert went == where  # routed back to the actor that kept the previous prompt
                    assert kept > 0
                assert sent == pack_layout(without_prefix(layout, tiny_model.cfg, kept), "x").tensor_bytes
                if t:
                    assert sent < pack_layout(layout, "x").tensor_bytes
                where = went
                history = prompt + got[:-1]  # what the next turn's prompt extends (the last token was never fed)
    finally:
        eng.close()
    stats = ray.get([d.stats.remote() for d in service.actors.decode], timeout=60)
    assert sum(s.kept_reused for s in stats) == 2 * (TURNS - 1)
    assert sum(s.kept_requests for s in stats) == 2  # each conversation's last turn stays kept
    assert all(s.running == 0 and s.device_bytes_used == 0 for s in stats)
    assert all(ray.get([d.check_integrity.remote() for d in service.actors.decode], timeout=120))
