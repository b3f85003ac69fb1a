"""Resident C4 entries (`TierConfig.resident`, `cachetier.residency`): the store's bookkeeping through every
transition. The streams through transitions are `tests/integration/test_tier_equivalence.py`'s."""

from __future__ import annotations

import pytest
import torch

from cachetier.store import IntegrityError, TieredStore
from core.configs import EAGER_STEP, TierConfig
from core.types import SampledToken, SamplingParams
from decode.worker import DecodeRequest, DecodeWorker


def _store(model, budget: int = 8 << 20, **kw) -> TieredStore:
    cfg = model.cfg
    tier = TierConfig(offload=True, hot_buffer_slots=cfg.index_topk, reserved_slots=4, device_budget_bytes=budget,
                      host_pool_bytes=16 << 20, resident=True, **kw)
    return TieredStore(cfg, tier, dtype=model.dtype)


def _request(model, rid: str, n: int, max_tokens: int = 64, seed: int = 0) -> DecodeRequest:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, model.cfg.vocab_size, (n,), generator=g).tolist()
    logits, layout = model.prefill(ids, last_only=True)
    return DecodeRequest.fresh(rid, layout, SampledToken(int(logits[-1].argmax())),
                               SamplingParams(max_tokens=max_tokens, ignore_eos=True), seed=seed)


def test_geometry_places_every_c4_row_of_a_block_in_its_own_pages(tiny_model):
    g = _store(tiny_model).geo
    assert g.resident and g.c4_rows_per_page * g.md <= g.page_elems
    assert g.c4_pages_per_block * g.c4_rows_per_page >= len(g.csa_layers) * g.e4
    with pytest.raises(ValueError, match="need the tier on"):
        TierConfig(offload=False, resident=True)


def test_a_request_grows_resident_and_shrinks_back_with_nothing_lost(tiny_model):
    store = _store(tiny_model)
    worker = DecodeWorker(tiny_model, store, max_running=4, step_config=EAGER_STEP)
    worker.submit(_request(tiny_model, "a", 300))
    free0 = store.pages.num_free
    worker.step()  # admitted, then resident before its first step (room to spare)
    r = store.residents["a"]
    g = store.geo
    assert len(r.c4_pages) == len(r.blocks) * g.c4_pages_per_block > 0
    assert store.pages.num_free == free0 - g.group_pages - len(r.blocks) - len(r.c4_pages)
    worker.check_integrity()
    written = store.counter_totals()["bytes_d2h"]
    upto = r.c4_host_upto
    for _ in range(9):
        worker.step()
    worker.check_integrity()
    n = r.num_tokens // tiny_model.cfg.csa_rate
    assert n > upto and r.c4_host_upto == upto  # entries appended while resident are on the device only
    assert store.counter_totals()["bytes_d2h"] == written and store.stats()["misses"] == 0
    new_rows = store._resident_c4(r, upto)
    device_copy = [store.rows(g.md)[rows].cpu() for rows in new_rows[1]]
    store.drop_resident("a")
    assert not r.c4_pages and store.demotions == 1
    # written back when it shrank: the host pool holds every entry again, equal to what the device held
    assert r.c4_host_upto == n
    assert all(torch.equal(store.hot.host.kv[j, new_rows[0]], d) for j, d in enumerate(device_copy))
    assert store.counter_totals()["bytes_d2h"] == written + (n - upto) * len(device_copy) * g.main_bytes
    worker.check_integrity()  # the hot buffer's ring rebuilt from the host pool
    assert store.make_resident("a") and store.promotions == 2
    worker.check_integrity()
    # a hot buffer that still held entries would fail the check: a resident request's buffers hold nothing
    hot = store.hot
    hot.hot_entry_row[0][r.group, 0] = hot.entry_map[0].new_tensor(0, dtype=torch.long)
    with pytest.raises(IntegrityError, match="a layer 0"):
        worker.check_integrity()
    hot.hot_entry_row[0][r.group, 0] = -1
    # a device row that differs from its host copy fails too
    row = store._resident_c4(r)[1][0][0]
    store.rows(g.md)[row] += 1
    with pytest.raises(IntegrityError, match="differs from its host copy"):
        worker.check_integrity()
    store.rows(g.md)[row] -= 1
    worker.abort("a")
    assert store.pages.num_free == g.num_pages and store.host_bytes_used() == 0


def test_a_refused_admission_gets_the_room_back(tiny_model):
    """The budget holds two requests in the tiered way but not one of them resident beside the other: a reservation
    from another thread is refused while the resident pages are held, the next step shrinks the resident request,
    and the retried reservation goes through. Routing sees the resident pages as free all along."""
    g = _store(tiny_model).geo
    gp, blocks_a = g.group_pages, g.blocks_for(300 + 200)
    c4 = blocks_a * g.c4_pages_per_block
    total = -(-(gp + blocks_a + c4 + gp + 1) // gp) * gp  # a, its C4 pages and the headroom (whole state groups)
    left = total - gp - blocks_a - c4  # free once "a" is resident: not enough for "b"; enough once it shrinks
    b_tokens = next(t for t in range(1, 1 << 16) if g.blocks_for(t) == left + 1 - gp)
    store = _store(tiny_model, budget=g.device_bytes(total))
    assert store.geo.num_pages == total
    worker = DecodeWorker(tiny_model, store, max_running=4, step_config=EAGER_STEP)
    worker.submit(_request(tiny_model, "a", 300, max_tokens=200))
    worker.step()
    assert store.residents["a"].c4_pages
    assert store.capacity()["pages_free"] == store.pages.num_free + len(store.residents["a"].c4_pages)
    assert not worker.reserve("b", b_tokens)  # the pages are resident C4 pages now
    worker.step()  # the step thread frees them
    assert not store.residents["a"].c4_pages and store.demotions == 1
    assert worker.reserve("b", b_tokens)
    for _ in range(70):  # the demand is held: "a" does not grow back over the pages "b" is about to use
        worker.step()
    assert not store.residents["a"].c4_pages
    worker.check_integrity()


def test_growth_and_pauses_take_resident_pages_first(tiny_model):
    """Under `reserve=estimate` a running request that needs a block shrinks resident requests before anyone pauses,
    a resident request that grows takes its new blocks' C4 pages too, and a paused one leaves its C4 pages behind."""
    store = _store(tiny_model, reserve="estimate", output_estimate_tokens=8)
    worker = DecodeWorker(tiny_model, store, max_running=4, step_config=EAGER_STEP)
    worker.submit(_request(tiny_model, "a", 250, max_tokens=400))
    worker.step()
    r = store.residents["a"]
    n0 = len(r.blocks)
    assert r.c4_pages
    while len(r.blocks) == n0:
        worker.step()
    assert len(r.c4_pages) == len(r.blocks) * store.geo.c4_pages_per_block
    worker.check_integrity()
    worker._pause("a")
    assert store.pages.num_free == store.geo.num_pages and not r.c4_pages
    worker.step()  # resumes, then resident again
    assert "a" in worker.running and store.residents["a"].c4_pages
    worker.check_integrity()
    worker.abort("a")
    assert store.pages.num_free == store.geo.num_pages


class _CountingValues(dict):
    """The store's residents, counting the scans over them."""

    scans = 0

    def values(self):
        type(self).scans += 1
        return super().values()


def test_a_settled_rebalance_scans_nothing_until_something_moves(tiny_model):
    """At low load every step rebalances: once a look found nothing to do, the next ones compare a few counts and
    scan no request, until pages come or go or a request changes; then the scan runs again and grows who can."""
    store = _store(tiny_model, budget=6 << 20)
    worker = DecodeWorker(tiny_model, store, max_running=4, step_config=EAGER_STEP)
    for i, n in enumerate((300, 280)):
        worker.submit(_request(tiny_model, f"r{i}", n, seed=i))
    worker.step()
    worker.step()
    assert all(r.c4_pages for r in store.residents.values())
    store.drop_resident("r1")  # a request shrank: residency must look again
    store.residents = _CountingValues(store.residents)
    store.rebalance()
    assert store.residents["r1"].c4_pages and _CountingValues.scans >= 1  # the scan ran and grew it back
    scans = _CountingValues.scans
    for _ in range(5):
        worker.step()  # every request resident, room to spare: nothing moves
    assert _CountingValues.scans == scans
    worker.abort("r0")  # pages return: the next look scans again
    worker.step()
    assert _CountingValues.scans > scans
    worker.abort("r1")
    worker.check_integrity()
