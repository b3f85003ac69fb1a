"""The decode worker's request paths without Ray: reservations before prefill, arrivals written between
steps, leases, aborts, and failures that reach exactly the requests they affect."""

from __future__ import annotations

import time

import pytest
import torch
from serving_helpers import EAGER  # noqa: E402

from cachetier.store import TieredStore
from core.configs import FaultConfig, StubConfig, TierConfig
from core.types import SampledToken, SamplingParams
from decode.worker import DecodeRequest, DecodeWorker
from model.sampling import sample
from model.stub import StubModel

TIER = TierConfig(offload=True, hot_buffer_slots=16, device_budget_bytes=4 * 2**20, host_pool_bytes=16 * 2**20)


def _request(model, rid, prompt_len=60, max_tokens=12, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, model.cfg.vocab_size, (prompt_len,), generator=g).tolist()
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    logits, layout = model.prefill(ids, last_only=True)
    return DecodeRequest.fresh(rid, layout, sample(logits, [sp], [seed], [0])[0], sp, seed, **kw)


def _run(worker: DecodeWorker, max_steps: int = 200) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not worker.has_work():
            break
        for ev in worker.step():
            out.setdefault(ev.request_id, []).append(ev.token.token_id)
    return out


def _empty(store: TieredStore) -> None:
    cap = store.capacity()
    assert cap["pages_free"] == cap["pages_total"] and cap["host_blocks_free"] == cap["host_blocks_total"]
    assert store.device_bytes_used() == 0 and store.host_bytes_used() == 0
    store.check_integrity()


def test_reserved_path_gives_the_queued_path_tokens(tiny_model):
    reqs = [_request(tiny_model, f"r{i}", 40 + 9 * i, seed=i) for i in range(3)]
    queued = DecodeWorker(tiny_model, TieredStore(tiny_model.cfg, TIER), step_config=EAGER)
    for r in reqs:
        queued.submit(DecodeRequest.fresh(r.request_id, r.layout.clone(), r.first_token, r.sampling, r.seed))
    want = _run(queued)

    store = TieredStore(tiny_model.cfg, TIER)
    worker = DecodeWorker(tiny_model, store, step_config=EAGER)
    free0 = store.capacity()["pages_free"]
    for r in reqs:  # pages are held before the layouts exist
        assert worker.reserve(r.request_id, r.reserve_tokens, owner="gw")
    assert store.capacity()["pages_free"] < free0 and worker.stats()["reserved"] == 3
    assert sorted(worker.owned_by("gw")) == ["r0", "r1", "r2"] and worker.owned_by("other") == []
    for r in reqs:
        assert worker.arrive(r)
    assert _run(worker) == want
    assert not worker.take_failures()
    _empty(store)


def test_reservations_refuse_when_full_and_never_fitting_raises(tiny_model):
    store = TieredStore(tiny_model.cfg, TIER)
    worker = DecodeWorker(tiny_model, store, max_running=2, step_config=EAGER)
    assert worker.reserve("a", 300) and worker.reserve("b", 300)
    assert not worker.reserve("c", 300)  # max_running counts reservations
    worker.abort("a")
    assert worker.reserve("c", 300)
    from core.types import NeverFitsError

    with pytest.raises(NeverFitsError):
        worker.reserve("huge", 10_000_000)
    for rid in ("b", "c"):
        worker.abort(rid)
    _empty(store)


def test_arrival_without_reservation_is_refused(tiny_model):
    worker = DecodeWorker(tiny_model, TieredStore(tiny_model.cfg, TIER), step_config=EAGER)
    r = _request(tiny_model, "late")
    assert worker.reserve("late", r.reserve_tokens)
    worker.abort("late")  # the frontend gave up on it while its layout was on the way
    assert not worker.arrive(r)
    assert _run(worker) == {}
    _empty(worker.store)


def test_lapsed_reservation_is_freed_and_reported(tiny_model):
    store = TieredStore(tiny_model.cfg, TIER)
    worker = DecodeWorker(tiny_model, store, step_config=EAGER)
    assert worker.reserve("lost", 200, owner="gw", lease_s=0.05)
    assert not worker.has_work()  # nothing to do until the lease lapses
    time.sleep(0.1)
    assert worker.has_work()
    worker.step()
    [f] = worker.take_failures()
    assert (f.request_id, f.owner, f.kind) == ("lost", "gw", "lease")
    _empty(store)


def test_a_layout_that_cannot_be_written_fails_only_its_request(tiny_model):
    store = TieredStore(tiny_model.cfg, TIER)
    worker = DecodeWorker(tiny_model, store, step_config=EAGER)
    good = _request(tiny_model, "good", seed=1)
    bad = _request(tiny_model, "bad", prompt_len=90, seed=2)
    assert worker.reserve("good", good.reserve_tokens, owner="gw")
    assert worker.reserve("bad", 60, owner="gw")  # reserved for fewer tokens than its layout holds
    worker.arrive(good)
    worker.arrive(bad)
    out = _run(worker)
    assert list(out) == ["good"] and len(out["good"]) == good.sampling.max_tokens - 1
    [f] = worker.take_failures()
    assert (f.request_id, f.kind) == ("bad", "layout") and "reserved" in f.message
    _empty(store)


def test_a_poisoned_request_fails_its_step_and_then_fails_alone(tiny_model):
    faults = FaultConfig(poison_token_id=999)
    store = TieredStore(tiny_model.cfg, TIER)
    worker = DecodeWorker(tiny_model, store, faults=faults, step_config=EAGER)
    clean = {r.request_id: r for r in (_request(tiny_model, f"ok{i}", seed=10 + i) for i in range(2))}
    want = _run_alone(tiny_model, list(clean.values()))

    # first time: the poisoned request shares a step, so that step's requests all fail (their state may be half written)
    worker.submit(_request(tiny_model, "p", seed=3, fault="poison"))
    worker.submit(_copy(clean["ok0"]))
    assert _run(worker, 5) == {}
    assert {(f.request_id, f.kind) for f in worker.take_failures()} == {("p", "step"), ("ok0", "step")}
    assert worker.failed_steps == 1

    # when it comes back it is solo: it fails in a step of its own and the others keep decoding
    worker.submit(_request(tiny_model, "p", seed=3, fault="poison", solo=True))
    for r in clean.values():
        worker.submit(_copy(r))
    got = _run(worker)
    assert got == want
    assert [(f.request_id, f.kind) for f in worker.take_failures()] == [("p", "step")]
    _empty(store)


def _copy(r: DecodeRequest) -> DecodeRequest:
    return DecodeRequest.fresh(r.request_id, r.layout.clone(), r.first_token, r.sampling, r.seed)


def _run_alone(model, reqs: list[DecodeRequest]) -> dict[str, list[int]]:
    worker = DecodeWorker(model, TieredStore(model.cfg, TIER), step_config=EAGER)
    for r in reqs:
        worker.submit(_copy(r))
    return _run(worker)


def test_abort_returns_memory_wherever_the_request_is(tiny_model):
    store = TieredStore(tiny_model.cfg, TIER)
    worker = DecodeWorker(tiny_model, store, step_config=EAGER)
    running, arriving, reserved = (_request(tiny_model, n, seed=i) for i, n in enumerate(("run", "arr", "res")))
    for r in (running, arriving, reserved):
        assert worker.reserve(r.request_id, r.reserve_tokens)
    worker.arrive(running)
    worker.step()
    worker.arrive(arriving)
    assert set(worker.running) == {"run"} and len(worker.arrivals) == 1 and set(worker.reserved) == {"arr", "res"}
    assert worker.abort("run") and worker.abort("arr") and worker.abort("res")
    assert not worker.abort("res")  # twice: nothing left to stop
    assert not worker.has_work()
    _empty(store)


class _Counting(StubModel):
    """A stand-in whose step makes every row's next token its last token + 1: each request's stream is known
    ahead, whatever batch it decodes in."""

    def decode_step(self, store, token_ids):
        store.advance()
        nxt = (torch.as_tensor(list(token_ids)) + 1) % self.cfg.vocab_size
        logits = torch.zeros(len(nxt), self.cfg.vocab_size)
        logits[torch.arange(len(nxt)), nxt] = 1.0
        return logits


@pytest.mark.parametrize("with_logprobs", [False, True])
def test_a_step_batch_ends_each_request_by_its_own_rule(tiny_model, with_logprobs):
    """Length, stop ids, end-of-sequence and ignore_eos side by side in one batch (greedy token ids only, or with
    a request that asks for log-probabilities), and a solo request beside them."""
    model = _Counting(tiny_model, StubConfig(decode_step_s=0.0))
    eos = tiny_model.cfg.eos_token_ids[0]
    store = TieredStore(tiny_model.cfg, TIER)
    worker = DecodeWorker(model, store, eos_ids=(eos,), step_config=EAGER)
    layout = tiny_model.prefill(list(range(6, 30)), last_only=True)[1]

    def req(rid, first, solo=False, **sp):
        return DecodeRequest.fresh(rid, layout.clone(), SampledToken(first), SamplingParams(**sp), 0, solo=solo)

    worker.submit(req("length", 100, max_tokens=5, ignore_eos=True))
    worker.submit(req("stop_id", 200, max_tokens=10, stop_token_ids=(203,)))
    worker.submit(req("eos", eos - 1, max_tokens=10))
    worker.submit(req("past_eos", eos - 1, max_tokens=3, ignore_eos=True))
    worker.submit(req("solo", 300, solo=True, max_tokens=3, ignore_eos=True))
    if with_logprobs:
        worker.submit(req("logprobs", 400, max_tokens=3, ignore_eos=True, logprobs=1))
    seen: dict[str, list] = {}
    while worker.has_work():
        for ev in worker.step():
            assert type(ev.index) is int and type(ev.token.token_id) is int
            assert (ev.token.logprob is not None) == (ev.request_id == "logprobs")
            seen.setdefault(ev.request_id, []).append((ev.index, ev.token.token_id, ev.finish_reason))
    want = {
        "length": [(1, 101, None), (2, 102, None), (3, 103, None), (4, 104, "length")],
        "stop_id": [(1, 201, None), (2, 202, None), (3, 203, "stop")],
        "eos": [(1, eos, "stop")],
        "past_eos": [(1, eos, None), (2, eos + 1, "length")],
        "solo": [(1, 301, None), (2, 302, "length")],
    }
    if with_logprobs:
        want["logprobs"] = [(1, 401, None), (2, 402, "length")]
    assert seen == want
    assert not worker.running
    _empty(store)
