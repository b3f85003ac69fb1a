"""Full prompt pages that running requests share, held once (`cachetier.sharing`): the tokens are the ones each
request gets holding its own copy, both tiers hold the shared pages once, the last holder frees them, a paused
sharer leaves them in place, and the integrity check knows who holds what."""

from __future__ import annotations

import pytest
import torch
from serving_helpers import EAGER  # noqa: E402

from cachetier.layout import pack_layout, unpack_layout, without_prefix
from cachetier.prefix import page_keys
from cachetier.store import IntegrityError, TieredStore
from core.configs import TierConfig
from core.types import SampledToken, SamplingParams
from decode.worker import DecodeRequest, DecodeWorker

PAGE = 128


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(6, vocab, (n,), generator=g).tolist()


def _worker(model, share: int, offload: bool = True, **tier) -> DecodeWorker:
    cfg = TierConfig(offload=offload, device_budget_bytes=tier.pop("device_budget_bytes", 6 * 2**20),
                     host_pool_bytes=16 * 2**20 if offload else None, block_tokens=PAGE, share_prefixes=share,
                     hot_buffer_slots=model.cfg.index_topk if offload else None, reserved_slots=4 if offload else 8,
                     **tier)
    return DecodeWorker(model, TieredStore(model.cfg, cfg), max_running=8, step_config=EAGER)


class Driver:
    """Requests reserved with their prompts' page keys, prefilled, handed over less what the worker holds already,
    and decoded to the end, the store checked after every step."""

    def __init__(self, worker: DecodeWorker) -> None:
        self.worker, self.out, self.held, self.sent = worker, {}, {}, {}

    def reserve(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        w = self.worker
        assert w.reserve(rid, len(prompt) + max_tokens, prefix_keys=page_keys(prompt, PAGE))
        self.held[rid] = w.store.held_tokens(rid)
        self._pending = getattr(self, "_pending", [])
        self._pending.append((rid, prompt, max_tokens))

    def arrive(self) -> None:
        model = self.worker.model
        for rid, prompt, max_tokens in self._pending:
            sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.8 if rid.endswith("s") else 0.0)
            logits, layout = model.prefill(prompt, last_only=True)
            packed = pack_layout(without_prefix(layout, model.cfg, self.held[rid]), "test")
            self.sent[rid] = packed.tensor_bytes
            req = DecodeRequest.fresh(rid, unpack_layout(packed), SampledToken(int(logits[-1].argmax())), sp, seed=7)
            assert self.worker.arrive(req)
            self.out[rid] = [req.first_token.token_id]
        self._pending = []

    def step(self) -> None:
        for ev in self.worker.step():
            self.out[ev.request_id].append(ev.token.token_id)
        self.worker.check_integrity()

    def finish(self) -> dict[str, list[int]]:
        while self.worker.has_work():
            self.step()
        return self.out


def _plan(model):
    vocab = model.cfg.vocab_size
    prefix = _ids(300, 1, vocab)  # two full pages, then the third diverges
    return {
        "a": prefix + _ids(40, 2, vocab),
        "b": prefix + _ids(100, 3, vocab),
        "cs": prefix[:256],  # its whole prompt is the two shared pages
        "d": prefix + _ids(212, 4, vocab),
    }, {"a": 12, "b": 40, "cs": 40, "d": 30}


def _start(worker, prompts, lengths) -> Driver:
    """a and b reserve together (b shares at its fill), then cs and d reserve with a filled a holding the pages (they
    share at reservation, their handoffs leave the pages out); each group decodes one step."""
    drv = Driver(worker)
    for group in (("a", "b"), ("cs", "d")):
        for rid in group:
            drv.reserve(rid, prompts[rid], lengths[rid])
        drv.arrive()
        drv.step()
    return drv


def _run(worker, prompts, lengths, stats_at: list | None = None):
    """`_start`, then decode to the end (a finishes first)."""
    drv = _start(worker, prompts, lengths)
    if stats_at is not None:
        stats_at.append(worker.store.stats())
    return drv.finish(), drv


@pytest.mark.parametrize("offload", [True, False], ids=["tier-on", "tier-off"])
def test_shared_pages_decode_the_same_and_are_held_once(tiny_model, offload):
    prompts, lengths = _plan(tiny_model)
    own_stats, shared_stats = [], []
    ref, ref_drv = _run(_worker(tiny_model, 0, offload), prompts, lengths, own_stats)
    w = _worker(tiny_model, 2, offload)
    out, drv = _run(w, prompts, lengths, shared_stats)
    assert out == ref
    assert [len(out[r]) for r in prompts] == [lengths[r] for r in prompts]
    # cs and d shared the two pages at reservation: their handoffs left them out; b shared them at its fill
    assert drv.held == {"a": 0, "b": 0, "cs": 2 * PAGE, "d": 2 * PAGE} and ref_drv.held == dict.fromkeys(prompts, 0)
    assert all(drv.sent[r] < ref_drv.sent[r] for r in ("cs", "d")) and drv.sent["b"] == ref_drv.sent["b"]
    own, shared = own_stats[0], shared_stats[0]
    assert shared["share_shared_pages"] == 4 and shared["share_shared_at_fill"] == 2
    assert shared["share_registered"] == 5  # a's two, b's third page, d's third and fourth
    g = w.store.geo
    # four requests, two pages each held once: 3 x 2 device pages fewer, and 3 x 2 host blocks with the tier on
    def used(st):
        return st["pages_total"] - st["pages_free"]

    assert used(own) - used(shared) == 6
    assert own["host_bytes_used"] - shared["host_bytes_used"] == (6 * g.host_block_bytes if offload else 0)
    # the last holder freed them: both tiers whole again, nothing registered, every map block back
    st = w.store.stats()
    assert st["pages_free"] == st["pages_total"] and st["host_bytes_used"] == 0 and st["shared_pages_now"] == 0
    assert w.store.sharing.map_owner == {} and w.store.sharing.maps_free == g.share_maps
    assert st["share_freed"] == 5


def test_a_paused_sharer_leaves_the_shared_pages_and_resumes_the_same(tiny_model):
    prompts, lengths = _plan(tiny_model)
    ref, _ = _run(_worker(tiny_model, 0), prompts, lengths)
    w = _worker(tiny_model, 2, reserve="estimate", output_estimate_tokens=8, resident=True)
    drv = _start(w, prompts, lengths)
    store = w.store
    shared_pages = {p.page for p in store.sharing.pages.values()}
    free = store.pages.num_free
    r = store.residents["d"]
    own = store.geo.group_pages + len(r.blocks) - r.shared + len(r.c4_pages)
    w._pause("d")  # its own pages go to host memory; the shared ones stay where they are, held by it
    w.check_integrity()
    assert store.pages.num_free == free + own and "d" in store.sharing.pages[r.prefix_keys[0]].holders
    assert {p.page for p in store.sharing.pages.values()} == shared_pages
    drv.step()
    assert store.swaps == 1
    out = drv.finish()
    assert store.resumes == 1
    assert out == ref
    assert store.promotions > 0  # sharers' C4 entries went resident too, in pages of their own


def test_when_map_blocks_run_out_a_request_shares_fewer_pages(tiny_model):
    prompts, lengths = _plan(tiny_model)
    ref, _ = _run(_worker(tiny_model, 0), prompts, lengths)
    w = _worker(tiny_model, 1)
    w.store.sharing._free_maps = w.store.sharing._free_maps[:1]  # one map block left
    out, drv = _run(w, prompts, lengths)
    assert out == ref
    st = w.store.stats()
    assert st["share_no_map_block"] >= 1 and st["share_shared_at_fill"] == 1  # b shared one page, kept its second
    assert drv.held["cs"] == drv.held["d"] == 0  # the only map block was b's until it finished
    assert st["pages_free"] == st["pages_total"] and st["shared_pages_now"] == 0


def test_integrity_check_knows_shared_pages(tiny_model):
    prompts, lengths = _plan(tiny_model)

    def running():
        w = _worker(tiny_model, 2)
        drv = Driver(w)
        for rid in ("a", "b"):
            drv.reserve(rid, prompts[rid], lengths[rid])
        drv.arrive()
        drv.step()
        return w

    w = running()
    p = next(iter(w.store.sharing.pages.values()))
    p.holders.discard("b")
    with pytest.raises(IntegrityError, match="held by"):
        w.check_integrity()
    w = running()
    p = next(iter(w.store.sharing.pages.values()))
    w.store.pages.owner[p.page] = "b"
    with pytest.raises(IntegrityError, match="owned by"):
        w.check_integrity()
    w = running()
    m = w.store.residents["b"].maps[0]
    w.store.sharing.map_owner[m] = "a"
    with pytest.raises(IntegrityError, match="map block"):
        w.check_integrity()
    w = running()
    w.store.hot.entry_map[0][w.store.residents["b"].maps[0] * w.store.geo.e4] = 0  # b's map says slot 0 holds entry 0
    with pytest.raises(IntegrityError, match="entries mapped|entry map"):
        w.check_integrity()


def test_kept_prompts_and_shared_pages_combine(tiny_model):
    """With `--retain-bytes` too, a finishing sharer keeps its prompt pages: a page others still hold is copied into
    a host block of the kept entry, the last holder's become the entry's. Follow-up turns take the kept entries over
    (one of them then shares the first pages with the other at its fill) and decode what whole layouts give."""
    prompts, lengths = _plan(tiny_model)
    w = _worker(tiny_model, 2, retain_bytes=16 * 2**20)
    out, _ = _run(w, prompts, lengths)
    ret = w.store.retention
    assert {k.owner for k in ret.kept.values()} == {"kept:b", "kept:cs", "kept:d"}  # cs's replaced a's (same pages)
    assert ret.count["copied_pages"] >= 2 * 2  # a and d left while others held the shared pages
    assert w.store.stats()["shared_pages_now"] == 0 and w.store.host_bytes_used() == ret.host_blocks * w.store.geo.host_block_bytes
    vocab = tiny_model.cfg.vocab_size
    follow = {"b2": prompts["b"] + out["b"][:-1] + _ids(50, 8, vocab), "d2": prompts["d"] + out["d"][:-1] + _ids(20, 9, vocab)}
    at_fill = w.store.stats()["share_shared_at_fill"]
    drv = Driver(w)
    for rid, p in follow.items():
        drv.reserve(rid, p, 16)
    assert drv.held == {"b2": 3 * PAGE, "d2": 4 * PAGE}  # their kept prompts, left out of the handoffs
    drv.arrive()
    got = drv.finish()
    ref = Driver(_worker(tiny_model, 0))
    for rid, p in follow.items():
        ref.reserve(rid, p, 16)
    ref.arrive()
    assert got == ref.finish()
    st = w.store.stats()
    assert st["kept_reused"] == 2 and st["share_shared_at_fill"] - at_fill == 2  # d2 shared b2's first two pages at its fill
    assert st["pages_free"] == st["pages_total"] and st["shared_pages_now"] == 0


def test_a_layout_shorter_than_the_pages_it_shares_is_refused(tiny_model):
    prompts, lengths = _plan(tiny_model)
    w = _worker(tiny_model, 2)
    drv = Driver(w)
    drv.reserve("a", prompts["a"], lengths["a"])
    drv.arrive()
    drv.step()
    assert w.reserve("x", 400, prefix_keys=page_keys(prompts["a"], PAGE)) and w.store.held_tokens("x") == 2 * PAGE
    _, short = tiny_model.prefill(prompts["a"][:200], last_only=True)
    with pytest.raises(ValueError, match="fewer than the 256 of the shared pages"):
        w.store.fill("x", short)
    assert w.abort("x")
    w.check_integrity()
    assert w.store.sharing.pages[page_keys(prompts["a"], PAGE)[0]].holders == {"a"}
