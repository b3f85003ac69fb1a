"""Finished requests' prompt pages kept for a follow-up turn (`cachetier.retention`): the next turn's handoff leaves
them out and its tokens are the ones a whole layout gives; kept pages go first under host pressure and the
integrity check counts them."""

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

MAX_TOKENS = 24


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(6, vocab, (n,), generator=g).tolist()


def _worker(model, retain_bytes: int, host_pool_bytes: int = 16 * 2**20, **tier) -> DecodeWorker:
    store = TieredStore(model.cfg, TierConfig(offload=True, device_budget_bytes=4 * 2**20, host_pool_bytes=host_pool_bytes,
                                              retain_bytes=retain_bytes, **tier))
    return DecodeWorker(model, store, max_running=8, step_config=EAGER)


def _turn(worker: DecodeWorker, rid: str, prompt: list[int], skip: bool = True) -> tuple[list[int], int, int]:
    """Reserve with the prompt's page keys, prefill, hand over the layout less what the worker keeps, decode to the
    end -> (tokens, tokens left out of the handoff, packed bytes handed over)."""
    model, store = worker.model, worker.store
    sp = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    keys = page_keys(prompt, store.geo.block_tokens)
    assert worker.reserve(rid, len(prompt) + MAX_TOKENS, prefix_keys=keys)
    held = store.held_tokens(rid)
    logits, layout = model.prefill(prompt, last_only=True)
    sent = without_prefix(layout, model.cfg, held) if skip else layout
    packed = pack_layout(sent, "test")
    req = DecodeRequest.fresh(rid, unpack_layout(packed), SampledToken(int(logits[-1].argmax())), sp, 0)
    assert worker.arrive(req)
    out = [req.first_token.token_id]
    while worker.has_work():
        out += [ev.token.token_id for ev in worker.step()]
    worker.check_integrity()
    return out, held, packed.tensor_bytes


def test_a_follow_up_turn_leaves_out_the_kept_pages_and_decodes_the_same(tiny_model):
    vocab, page = tiny_model.cfg.vocab_size, 256
    p1 = _ids(600, 1, vocab)  # two full pages
    ref = _worker(tiny_model, 0)
    kept = _worker(tiny_model, 8 * 2**20)

    a_ref, held_ref, _ = _turn(ref, "t1", p1)
    a1, held1, _ = _turn(kept, "t1", p1)
    assert a1 == a_ref and held_ref == held1 == 0  # nothing kept yet
    st = kept.store.stats()
    assert st["kept_requests"] == 1 and st["kept_total"] == 1 and ref.store.retention.kept == {}
    (k,) = kept.store.retention.kept.values()
    assert k.num_pages == 2 and k.keys == page_keys(p1, page)[:2]
    # host blocks: the kept pages' C4 entries stay in the pool, counted as free for routing
    assert kept.store.host_bytes_used() == 2 * kept.store.geo.host_block_bytes
    assert kept.store.capacity()["host_blocks_free"] == kept.store.host_alloc.num_blocks
    assert kept.store.device_bytes_used() == 0  # device pages went back at once

    p2 = p1 + a1[:-1] + _ids(300, 2, vocab)  # extends turn 1: three full pages, the first two kept
    b_ref, _, bytes_whole = _turn(ref, "t2", p2)
    b, held2, bytes_sent = _turn(kept, "t2", p2)
    assert held2 == 2 * page
    assert b == b_ref  # identical tokens from the kept pages and the shorter handoff
    _, whole = tiny_model.prefill(p2, last_only=True)
    left_out = 0  # the classical rows of the first two pages: C4 entries, indexer keys, HCA entries
    for i, lk in enumerate(whole.layers):
        rate = tiny_model.cfg.compress_rate(i)
        for t in (lk.entries, lk.index_keys):
            if t is not None and rate:
                left_out += t[: 2 * page // rate].numel() * t.element_size()
    assert left_out > 0 and bytes_whole - bytes_sent == left_out
    st = kept.store.stats()
    assert st["kept_reused"] == 1 and st["kept_reused_pages"] == 2
    (k2,) = kept.store.retention.kept.values()  # turn 2 is kept in turn, three pages
    assert k2.num_pages == 3 and k2.keys == page_keys(p2, page)[:3]


def test_kept_pages_go_first_when_admission_needs_host_blocks_and_by_budget(tiny_model):
    vocab = tiny_model.cfg.vocab_size
    w = _worker(tiny_model, 64 * 2**20, host_pool_bytes=8 * 32 * 2**10)  # 8 host blocks of 32 KiB
    store = w.store
    blocks = store.host_alloc.num_blocks
    assert blocks == 8
    for i in range(3):
        _turn(w, f"c{i}", _ids(520, 10 + i, vocab))  # two full pages kept each
    assert len(store.retention.kept) == 3 and store.host_alloc.num_free == blocks - 6
    # a reservation needing every host block: the kept entries are dropped, oldest first, and it is admitted
    assert store.fits(blocks * 256 - 1)
    assert w.reserve("big", blocks * 256 - 1)
    assert not store.retention.kept and store.retention.count["evicted"] == 3
    store.check_integrity()
    assert w.abort("big")
    # a budget that holds one entry: the second finish drops the first
    one = store.geo.host_block_bytes * 2 + 2 * store.geo.page_elems * store.geo.elem
    w2 = _worker(tiny_model, one)
    _turn(w2, "x", _ids(520, 20, vocab))
    _turn(w2, "y", _ids(520, 21, vocab))
    assert [k.owner for k in w2.store.retention.kept.values()] == ["kept:y"]
    assert w2.store.host_alloc.num_free == w2.store.host_alloc.num_blocks - 2


def test_a_handoff_that_leaves_out_what_is_not_kept_is_refused(tiny_model):
    w = _worker(tiny_model, 8 * 2**20)
    p = _ids(600, 3, tiny_model.cfg.vocab_size)
    assert w.reserve("r", len(p) + MAX_TOKENS, prefix_keys=page_keys(p, 256))
    assert w.store.held_tokens("r") == 0
    logits, layout = tiny_model.prefill(p, last_only=True)
    with pytest.raises(ValueError, match="leaves out the entries of its first 256 tokens"):
        w.store.fill("r", without_prefix(layout, tiny_model.cfg, 256))
    w.abort("r")
    w.check_integrity()


def test_integrity_check_knows_kept_pages(tiny_model):
    w = _worker(tiny_model, 8 * 2**20)
    _turn(w, "k", _ids(520, 4, tiny_model.cfg.vocab_size))
    (k,) = w.store.retention.kept.values()
    w.store.host_alloc.owner[k.host_blocks[0]] = "someone-else"
    with pytest.raises(IntegrityError, match="kept"):
        w.store.check_integrity()
