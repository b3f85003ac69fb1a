"""The stand-in model (benchmarks of the serving path) runs both workers; a prefill that cannot start fails alone."""

from __future__ import annotations

import pytest

from cachetier.store import TieredStore
from core.configs import PrefillConfig, PrefixCacheConfig, StubConfig, TierConfig
from core.request import Attempt, Request
from core.types import SamplingParams
from decode.worker import DecodeRequest, DecodeWorker
from model.stub import StubModel
from prefill.worker import PrefillWorker


def _req(rid: str, n: int, max_tokens: int = 5) -> Attempt:
    return Attempt.of(Request(rid, tuple(range(6, 6 + n)), SamplingParams(max_tokens=max_tokens, ignore_eos=True), seed=0))


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_stub_prefills_and_decodes(tiny_model, prefix_cache):
    stub = StubModel(tiny_model, StubConfig(decode_step_s=0.0, prefill_s=0.0))
    prefill = PrefillWorker(stub, PrefillConfig(prefix_cache=PrefixCacheConfig(enabled=prefix_cache)))
    for i, n in enumerate((7, 40, 300)):
        prefill.submit(_req(f"r{i}", n))
    done = []
    while prefill.has_work():
        done += prefill.step()
    assert [d.key for d in done] == ["r0", "r1", "r2"] and not prefill.take_failures()
    assert [d.layout.num_tokens for d in done] == [7, 40, 300]

    store = TieredStore(tiny_model.cfg, TierConfig(device_budget_bytes=16 * 2**20, host_pool_bytes=16 * 2**20))
    decode = DecodeWorker(stub, store, max_running=4, eos_ids=())
    for d in done:
        decode.submit(DecodeRequest.fresh(d.key, d.layout, d.first_token, SamplingParams(max_tokens=5, ignore_eos=True), seed=0))
    tokens: dict[str, list[int]] = {}
    while decode.has_work():
        for ev in decode.step():
            tokens.setdefault(ev.request_id, []).append(ev.token.token_id)
    assert {rid: len(t) for rid, t in tokens.items()} == {"r0": 4, "r1": 4, "r2": 4}  # the first token came from prefill
    assert len({t for ts in tokens.values() for t in ts}) == 1  # the stand-in's one token
    assert store.stats()["device_bytes_used"] == 0


def test_a_prefill_that_cannot_start_fails_alone(tiny_model, monkeypatch):
    worker = PrefillWorker(tiny_model)
    real_start = worker._start

    def start(p):
        if p.req.key == "bad":
            raise RuntimeError("no layout for you")
        real_start(p)

    monkeypatch.setattr(worker, "_start", start)
    for rid in ("a", "bad", "b"):
        worker.submit(_req(rid, 12))
    done = worker.step()
    assert sorted(d.key for d in done) == ["a", "b"]
    failures = worker.take_failures()
    assert [f.request_id for f in failures] == ["bad"] and "could not start" in failures[0].message
    assert not worker.has_work()
