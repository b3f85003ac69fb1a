"""The tier's geometry and admission arithmetic, never-fitting requests, aborts, the integrity check."""

from __future__ import annotations

import random

import pytest
import torch
from serving_helpers import EAGER  # noqa: E402

from cachetier.geometry import BudgetTooSmall, Geometry, group_pages_for
from cachetier.pages import PageAllocator
from cachetier.store import IntegrityError, TieredStore
from core.configs import TierConfig
from core.types import NeverFitsError, SamplingParams
from decode.worker import DecodeRequest, DecodeWorker
from model.sampling import sample


def test_geometry_by_hand(tiny_model):
    """The built-in model: 2 CSA layers (d=64, indexer 16), 1 HCA layer (rate 32), 4 layers, window 32, fp32."""
    cfg = tiny_model.cfg
    on = Geometry(cfg, TierConfig(offload=True, hot_buffer_slots=32, reserved_slots=8), torch.float32)
    off = Geometry(cfg, TierConfig(offload=False), torch.float32)
    assert on.block_tokens == off.block_tokens == 256
    # a page holds 256 tokens: 2 x 64 indexer keys x 16 + 1 x 8 HCA entries x 64 (+ 2 x 64 C4 entries x 64 without the tier)
    assert on.page_elems == 2 * 64 * 16 + 8 * 64 == 2560
    assert off.page_elems == 2560 + 2 * 64 * 64 == 10752
    assert on.page_bytes == 2560 * 4 + 2 * 64 * 4  # + the entry->slot map
    assert off.page_bytes == 10752 * 4
    # the state: rings 4 x 32 x 64, CSA tails (4x128 kv + 4x128 score + 4x64 + 4x64 ; indexer 4x32 x2 + 4x16 x2 -> aligned
    # to 128 elements each), HCA tail 32 x 64 x 2, and with the tier 2 x 40 x 64 hot slots
    per_csa = (512 + 512 + 256 + 256) + (128 + 128 + 128 + 128)
    state_off = 4 * 32 * 64 + 2 * per_csa + 2 * 32 * 64
    assert off.state_elems == state_off
    assert on.state_elems == state_off + 2 * 40 * 64
    # 9 pages of state, rounded to 10 so that every group starts at the same offset in a host page (2 pages of 10 KiB
    # are 5 host pages); off's 2 pages of 42 KiB are already an even count
    assert -(-on.state_elems // 2560) == 9 and on.group_pages == 10
    assert off.group_pages == 2
    assert on.meta_bytes_per_group == 2 * (40 * 8 + 32 * 8)


def _request(model, rid, prompt_len, max_tokens, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, model.cfg.vocab_size, (prompt_len,), generator=g).tolist()
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    logits, layout = model.prefill(ids, last_only=True)
    return DecodeRequest.fresh(rid, layout, sample(logits, [sp], [seed], [0])[0], sp, seed)


def test_admission_counts_match_footprint(tiny_model):
    """Same budget: N requests fit with the tier, M without, exactly as the page arithmetic says."""
    cfg = tiny_model.cfg
    budget = 6 * 2**20
    prompt, max_tokens = 700, 300  # reserve 1001 tokens -> 4 blocks of 256
    counts = {}
    for offload in (True, False):
        tier = TierConfig(offload=offload, device_budget_bytes=budget, max_running=1000)
        store = TieredStore(cfg, tier)
        geo = store.geo
        worker = DecodeWorker(tiny_model, store, max_running=1000, step_config=EAGER)
        base = _request(tiny_model, "base", prompt, max_tokens)
        nb = geo.blocks_for(base.reserve_tokens)
        assert nb == 4
        expected = geo.num_pages // (geo.group_pages + nb)
        for i in range(expected + 3):
            worker.submit(DecodeRequest.fresh(f"r{i}", base.layout.clone(), base.first_token, base.sampling, 0))
        worker._admit()
        assert len(worker.running) == expected
        assert len(worker.waiting) == 3
        assert store.device_bytes_used() == expected * geo.request_device_bytes(nb)
        assert store.device_bytes_used() <= budget
        worker.check_integrity()
        counts[offload] = expected
    n, m = counts[True], counts[False]
    on_geo = Geometry(cfg, TierConfig(offload=True, device_budget_bytes=budget), torch.float32)
    off_geo = Geometry(cfg, TierConfig(offload=False, device_budget_bytes=budget), torch.float32)
    assert n / m == pytest.approx((on_geo.num_pages // (on_geo.group_pages + 4)) / (off_geo.num_pages // (off_geo.group_pages + 4)))
    assert n > m  # at 1000 tokens the fixed state still weighs; the capacity bench shows the long-context ratio


def test_request_that_can_never_fit_is_an_error(tiny_model):
    store = TieredStore(tiny_model.cfg, TierConfig(offload=False, device_budget_bytes=2 * 2**20))
    worker = DecodeWorker(tiny_model, store, step_config=EAGER)
    req = _request(tiny_model, "huge", 50, 100_000)
    with pytest.raises(NeverFitsError, match="raise --device-budget"):
        worker.submit(req)
    assert not worker.has_work()


def test_budget_too_small_is_explained(tiny_model):
    with pytest.raises(BudgetTooSmall, match="raise --device-budget"):
        TieredStore(tiny_model.cfg, TierConfig(device_budget_bytes=10_000))
    with pytest.raises(ValueError, match="at least index_topk"):
        TieredStore(tiny_model.cfg, TierConfig(hot_buffer_slots=3))


def test_abort_returns_both_tiers(tiny_model):
    store = TieredStore(tiny_model.cfg, TierConfig(offload=True, hot_buffer_slots=16, device_budget_bytes=3 * 2**20,
                                                   host_pool_bytes=8 * 2**20))
    worker = DecodeWorker(tiny_model, store, max_running=2, step_config=EAGER)
    for i in range(4):
        worker.submit(_request(tiny_model, f"a{i}", 300 + 10 * i, 200, seed=i))
    for _ in range(30):
        worker.step()
    assert len(worker.running) == 2 and len(worker.waiting) == 2
    assert store.device_bytes_used() > 0 and store.host_bytes_used() > 0
    worker.check_integrity()
    assert worker.abort("a0") and worker.abort("a3")  # one running, one waiting
    assert not worker.abort("a0")
    worker.check_integrity()
    assert worker.abort("a1")
    for _ in range(5):
        worker.step()  # a2 is admitted now
    assert list(worker.running) == ["a2"]
    worker.abort("a2")
    worker.check_integrity()
    assert store.device_bytes_used() == 0 and store.host_bytes_used() == 0
    assert store.pages.num_free == store.geo.num_pages


def test_integrity_check_catches_corruption(tiny_model):
    store = TieredStore(tiny_model.cfg, TierConfig(offload=True, hot_buffer_slots=16, device_budget_bytes=3 * 2**20,
                                                   host_pool_bytes=8 * 2**20))
    worker = DecodeWorker(tiny_model, store, step_config=EAGER)
    worker.submit(_request(tiny_model, "x", 200, 50))
    for _ in range(10):
        worker.step()
    worker.check_integrity()
    r = store.residents["x"]
    # a hot slot whose content no longer equals its host copy
    slot = int(torch.nonzero(store.hot.hot_entry_row[0][r.group] >= 0)[0])
    saved = store.hot.hot_view(0)[r.group, slot].clone()
    store.hot.hot_view(0)[r.group, slot] += 1.0
    with pytest.raises(IntegrityError, match="differs from its host copy"):
        worker.check_integrity()
    store.hot.hot_view(0)[r.group, slot] = saved
    # a page owned by nobody while a resident claims it
    page = r.blocks[0]
    store.pages.owner[page] = None
    with pytest.raises(IntegrityError):
        worker.check_integrity()
    store.pages.owner[page] = "x"
    worker.check_integrity()


def test_worker_checks_integrity_when_it_goes_idle(tiny_model):
    store = TieredStore(tiny_model.cfg, TierConfig(offload=True, hot_buffer_slots=16, device_budget_bytes=3 * 2**20,
                                                   host_pool_bytes=8 * 2**20))
    worker = DecodeWorker(tiny_model, store, step_config=EAGER)
    worker.submit(_request(tiny_model, "i", 100, 6))
    while worker.has_work():
        assert worker.integrity_checks == 0
        worker.step()
    assert worker.integrity_checks == 1
    # and a broken invariant surfaces at that moment: counted (what /metrics shows), and the worker goes on
    worker.submit(_request(tiny_model, "j", 100, 3))
    worker.step()
    store.pages.num_free -= 1  # a page leaks
    while worker.has_work():
        worker.step()
    assert worker.integrity_checks == 2 and worker.integrity_errors == 1 and worker.stats()["integrity_errors"] == 1
    worker.submit(_request(tiny_model, "k", 100, 3))  # it still serves
    while worker.has_work():
        worker.step()
    assert worker.integrity_errors == 2
    with pytest.raises(IntegrityError):  # asked for, the check still raises (and counts)
        worker.check_integrity()
    assert worker.integrity_errors == 3


def _top_free_group_by_scan(pages: PageAllocator) -> int | None:
    gp = pages.group_pages
    free = [g for g in range(pages.num_groups) if all(o is None for o in pages.owner[g * gp : (g + 1) * gp])]
    return free[-1] if free else None


def test_page_allocator_picks_groups_as_a_scan_of_the_owners_would():
    """Groups come from the top and blocks from the bottom; the per-group counts the allocator keeps to find a
    free group quickly agree with the owners after any mix of allocations and frees."""
    rng = random.Random(3)
    pages = PageAllocator(num_pages=64, group_pages=4)
    held: dict[str, tuple[int, list[int]]] = {}
    for i in range(400):
        if held and (rng.random() < 0.45 or not pages.can_allocate(3)):
            owner = rng.choice(sorted(held))
            pages.free(owner, *held.pop(owner))
        else:
            n = rng.randint(0, 6)
            expect = _top_free_group_by_scan(pages)
            if not pages.can_allocate(n):
                assert expect is None or pages.num_free < pages.group_pages + n
                continue
            group, blocks = pages.allocate(f"r{i}", n)
            assert group == expect and len(blocks) == n
            held[f"r{i}"] = (group, blocks)
        assert pages.group_counts_hold()
    for owner, (group, blocks) in held.items():
        pages.free(owner, group, blocks)
    assert pages.num_free == 64 and pages.group_counts_hold()


# --- elastic admission (reserve=estimate) --------------------------------------------------------------------


def test_estimate_admits_by_the_prompt_plus_the_estimate(tiny_model):
    """Same budget, requests asking for 3,000 tokens: `final` holds 12 blocks each, `estimate` the prompt's plus the
    output estimate's (2 blocks), so more run at once; host blocks are held at the final length under both."""
    cfg = tiny_model.cfg
    counts = {}
    for policy in ("final", "estimate"):
        store = TieredStore(cfg, TierConfig(offload=True, device_budget_bytes=2 * 2**20, host_pool_bytes=64 * 2**20,
                                            max_running=64, reserve=policy, output_estimate_tokens=200))
        worker = DecodeWorker(tiny_model, store, max_running=64, step_config=EAGER)
        base = _request(tiny_model, "base", 300, 3000)
        for i in range(20):
            worker.submit(DecodeRequest.fresh(f"r{i}", base.layout.clone(), base.first_token, base.sampling, 0))
        worker._admit()
        r = next(iter(store.residents.values()))
        assert len(r.host_blocks) == store.geo.blocks_for(3300)
        assert len(r.blocks) == store.geo.blocks_for(3300 if policy == "final" else 300 + 1 + 200)
        counts[policy] = len(worker.running)
        worker.check_integrity()
    # a request holds its state group (10 pages) and 13 blocks under `final`, 2 under `estimate`
    assert counts["estimate"] > 1.8 * counts["final"], counts
    with pytest.raises(ValueError, match="reserve must be one of"):
        TierConfig(reserve="lazy")


def test_a_paused_request_holds_host_blocks_only_and_returns_them_when_aborted(tiny_model):
    store = TieredStore(tiny_model.cfg, TierConfig(offload=True, hot_buffer_slots=16, device_budget_bytes=3 * 2**20,
                                                   host_pool_bytes=8 * 2**20, reserve="estimate"))
    worker = DecodeWorker(tiny_model, store, max_running=4, step_config=EAGER)
    for i in range(2):
        worker.submit(_request(tiny_model, f"p{i}", 200 + 10 * i, 100, seed=i))
    for _ in range(3):
        worker.step()
    pages_before = store.pages.num_free
    held = len(store.residents["p1"].blocks) + store.geo.group_pages
    worker._pause("p1")
    assert store.pages.num_free == pages_before + held and store.holds("p1") and "p1" in store.swapped
    assert store.host_bytes_used() > 0 and store.stats()["swapped_bytes"] == held * store.geo.page_elems * 4
    worker.check_integrity()
    # paused requests get the room first: a reservation is refused; at the next step p1 resumes, then "late" joins
    worker.submit(_request(tiny_model, "late", 50, 20, seed=9))
    assert not worker.reserve("pd", 300)
    worker.step()
    assert not worker.paused and list(worker.running) == ["p0", "p1", "late"] and store.resumes == 1
    worker._pause("p1")
    assert set(worker.owned_by("")) == {"p0", "p1", "late"}  # a gateway that leaves aborts its paused requests too
    assert worker.abort("p1") and not store.holds("p1") and not worker.paused
    worker.check_integrity()
    while worker.has_work():
        worker.step()
    assert store.device_bytes_used() == 0 and store.host_bytes_used() == 0 and not store.swapped
    assert store.pages.num_free == store.geo.num_pages


def test_integrity_check_knows_swapped_requests(tiny_model):
    store = TieredStore(tiny_model.cfg, TierConfig(offload=True, hot_buffer_slots=16, device_budget_bytes=3 * 2**20,
                                                   host_pool_bytes=8 * 2**20, reserve="estimate"))
    worker = DecodeWorker(tiny_model, store, max_running=4, step_config=EAGER)
    worker.submit(_request(tiny_model, "s0", 300, 50))
    worker.step()
    worker._pause("s0")
    store.check_integrity()
    b = store.swapped["s0"].resident.host_blocks[0]
    store.host_alloc.owner[b] = "someone-else"
    with pytest.raises(IntegrityError, match="host block"):
        store.check_integrity()


def test_a_request_alone_without_room_pauses_until_a_reservation_returns_its_pages(tiny_model):
    """Running alone, a request that cannot grow because a reservation made before prefill holds the free pages pauses
    itself (nothing fails); once the reservation goes, it resumes and finishes."""
    store = TieredStore(tiny_model.cfg, TierConfig(offload=True, hot_buffer_slots=16, device_budget_bytes=3 * 2**20,
                                                   host_pool_bytes=64 * 2**20, reserve="estimate",
                                                   output_estimate_tokens=16))
    worker = DecodeWorker(tiny_model, store, max_running=4, step_config=EAGER)
    worker.submit(_request(tiny_model, "solo", 200, 100))
    worker.step()
    assert len(store.residents["solo"].blocks) == 1  # 200 + 1 + 16 tokens: one block of 256
    g = store.geo
    assert worker.reserve("pd", (store.pages.num_free - g.group_pages) * g.block_tokens)
    assert store.pages.num_free == 0
    for _ in range(100):  # it crosses into its second block after about 40 tokens
        if worker.paused:
            break
        worker.step()
    worker.step()  # paused, it stays paused: no room
    assert [run.req.request_id for run in worker.paused] == ["solo"] and not worker.running
    worker.check_integrity()
    assert worker.abort("pd")
    tokens = 0
    while worker.has_work():
        tokens += len(worker.step())
    assert store.resumes == 1 and tokens > 0 and store.pages.num_free == g.num_pages


def test_a_state_group_is_rounded_to_whole_host_pages_only_where_that_is_cheap():
    assert group_pages_for(9, 10240) == 10 and group_pages_for(11, 10240) == 12  # 2 pages of 10 KiB: 5 host pages
    assert group_pages_for(10, 10240) == 10
    assert group_pages_for(3, 4096) == 3 and group_pages_for(7, 1 << 20) == 7  # pages of whole host pages
    assert group_pages_for(5, 10000) == 5  # 256 pages would be whole host pages: far more than a quarter over 5
    assert group_pages_for(5, 6144) == 6 and group_pages_for(3, 6144) == 3  # 2 pages of 6 KiB: 3 host pages; 4 is a
    # third over 3
