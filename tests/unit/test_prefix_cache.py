"""The prefix cache: output with it equals output without it; host tier (LRU, budget, pins); disk tier
(spill, reload, checksum, restart)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from cachetier.layout import layout_format
from cachetier.prefix import PrefixCache
from core.configs import PrefillConfig, PrefixCacheConfig
from core.request import Attempt, Request
from core.types import SamplingParams
from model.sampling import sample
from prefill.worker import PrefillWorker

PAGE = 64  # two HCA windows (32) of the built-in model, sixteen C4 windows (4)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
SEEDED = SamplingParams(max_tokens=6, temperature=0.9, top_k=40, seed=7)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(6, vocab, (n,), generator=g).tolist()


def _worker(model, **cache) -> PrefillWorker:
    pc = PrefixCacheConfig(enabled=True, page_tokens=PAGE, **cache)
    return PrefillWorker(model, PrefillConfig(max_batch_tokens=512, prefix_cache=pc))


def _plain(model) -> PrefillWorker:
    return PrefillWorker(model, PrefillConfig(max_batch_tokens=512))


_ids = iter(range(10**9))


def _prefill(worker: PrefillWorker, tokens: list[int], sp: SamplingParams = GREEDY):
    worker.submit(Attempt.of(Request(f"r{next(_ids)}", tuple(tokens), sp, 11)))
    out = []
    while worker.has_work():
        out += worker.step()
    assert len(out) == 1
    return out[0]


def _continue(model, res, steps: int = 5) -> tuple[list[int], torch.Tensor]:
    """The tokens after the first, decoded from the result's layout; and the logits seen."""
    toks, seen, tok = [res.first_token.token_id], [], res.first_token.token_id
    layout = res.layout.clone()
    for i in range(steps):
        lo = model.decode_layouts([layout], [tok])
        seen.append(lo)
        tok = sample(lo, [res.attempt.sampling], [res.attempt.seed], [i + 1])[0].token_id
        toks.append(tok)
    return toks, torch.cat(seen)


# Lengths of the shared prefix: before / at / after a C4 window end (100 = 25 x 4), an HCA window end (96 = 3 x 32)
# and a page boundary (64, 128).
COMMON = (63, 64, 65, 95, 96, 97, 99, 100, 101, 127, 128, 129)


@pytest.mark.parametrize("common", COMMON)
@pytest.mark.parametrize("sp", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_output_with_cache_equals_output_without(tiny_model, common, sp):
    vocab = tiny_model.cfg.vocab_size
    shared = _tokens(common, vocab, 1)
    a, b = shared + _tokens(45, vocab, 2), shared + _tokens(38, vocab, 3)
    want_tokens, want_logits = _continue(tiny_model, _prefill(_plain(tiny_model), b, sp))

    w = _worker(tiny_model)
    _prefill(w, a, sp)  # caches pages of `a`, state at its last page boundary
    first = _prefill(w, b, sp)  # resumes where `a` kept state (if within the shared pages); keeps state where b leaves a
    second = _prefill(w, b, sp)  # resumes at b's last page boundary
    st = w.prefix_cache.stats()
    assert st.hit_tokens >= len(b) // PAGE * PAGE  # the second b at least resumed past all its full pages
    for res in (first, second):
        got_tokens, got_logits = _continue(tiny_model, res)
        assert got_tokens == want_tokens
        torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)
        assert res.layout.num_tokens == len(b)
    w.prefix_cache.check_integrity()
    assert all(n.refs == 0 for n in w.prefix_cache.nodes.values())


def test_next_turn_resumes_at_the_last_boundary_of_the_previous_one(tiny_model):
    vocab = tiny_model.cfg.vocab_size
    w = _worker(tiny_model)
    turn1 = _tokens(150, vocab, 4)
    turn2 = turn1 + _tokens(70, vocab, 5)
    _prefill(w, turn1)
    computed = w.tokens_in
    res = _prefill(w, turn2)
    assert w.tokens_in - computed == len(turn2) - 128  # 150 // 64 * 64 = 128 tokens came from the cache
    assert _continue(tiny_model, res)[0] == _continue(tiny_model, _prefill(_plain(tiny_model), turn2))[0]


def test_state_policy_last_keeps_less_state_than_every(tiny_model):
    vocab = tiny_model.cfg.vocab_size
    prompts = [_tokens(300, vocab, 6), _tokens(300, vocab, 6)[:200] + _tokens(90, vocab, 7)]
    kept = {}
    for policy in ("last", "every"):
        w = _worker(tiny_model, state_policy=policy)
        for p in prompts:
            _prefill(w, p)
        st = w.prefix_cache.stats()
        kept[policy] = st.host_state_bytes
        assert st.nodes == 4 + 1  # 4 pages of the first prompt, 1 new page (192..256) of the second
        assert st.state_bytes_every_page == st.nodes * st.state_snapshot_bytes
    # last: state at 256 (end of prompt 1), 192 (where prompt 2 left it) and 256 (end of prompt 2) -> 3 snapshots
    assert kept["last"] == 3 * w.prefix_cache.stats().state_snapshot_bytes
    assert kept["every"] == 5 * w.prefix_cache.stats().state_snapshot_bytes


def test_prompt_logprobs_requests_never_resume(tiny_model):
    vocab = tiny_model.cfg.vocab_size
    w = _worker(tiny_model)
    p = _tokens(140, vocab, 8)
    _prefill(w, p)
    sp = SamplingParams(max_tokens=1, prompt_logprobs=0)
    res = _prefill(w, p, sp)
    want = _prefill(_plain(tiny_model), p, sp)
    assert len(res.prompt_logprobs) == len(p)
    assert [x.token_id for x in res.prompt_logprobs] == [x.token_id for x in want.prompt_logprobs]


# --- the host tier ---------------------------------------------------------------------------------


def _cache(model, **kw) -> PrefixCache:
    cfg = PrefixCacheConfig(enabled=True, page_tokens=PAGE, **kw)
    return PrefixCache(model.cfg, cfg, layout_format(model.cfg, model.dtype))


def _layout(model, tokens):
    return model.prefill(tokens)[1]


def test_lru_eviction_under_the_host_budget(tiny_model):
    vocab = tiny_model.cfg.vocab_size
    p1, p2, p3 = (_tokens(64, vocab, s) for s in (10, 11, 12))
    probe = _cache(tiny_model)
    probe.store(p1, _layout(tiny_model, p1))
    one = probe.stats()
    per_prompt = one.host_seg_bytes + one.host_state_bytes
    c = _cache(tiny_model, host_bytes=2 * per_prompt)
    for p in (p1, p2):
        c.store(p, _layout(tiny_model, p))
    c.release(c.acquire(p1 + [1], 64))  # p1 is now the most recently used
    c.store(p3, _layout(tiny_model, p3))  # over budget: p2 (least recently used) goes
    c.check_integrity()
    assert c.stats().evictions == 2  # its page and its state
    assert c.acquire(p2 + [1], 64).tokens == 0
    assert c.acquire(p1 + [1], 64).tokens == 64 and c.acquire(p3 + [1], 64).tokens == 64
    assert c.host_bytes <= 2 * per_prompt


def test_pinned_entries_are_never_evicted(tiny_model):
    vocab = tiny_model.cfg.vocab_size
    c = _cache(tiny_model, host_bytes=0)  # everything unpinned goes at once
    p = _tokens(128, vocab, 13)
    c.store(p, _layout(tiny_model, p))
    assert c.stats().nodes == 0  # nothing pinned: evicted (no disk tier: dropped)
    c = _cache(tiny_model)
    c.store(p, _layout(tiny_model, p))
    hits = [c.acquire(p + [5], 128) for _ in range(2)]  # two users of one entry
    c.config = PrefixCacheConfig(enabled=True, page_tokens=PAGE, host_bytes=0)  # the budget shrinks under them
    q = _tokens(64, vocab, 14)
    c.store(q, _layout(tiny_model, q))  # q goes at once; p stays: it is pinned
    assert c.stats().nodes == 2 and all(n.refs == 2 for n in c.nodes.values())
    c.release(hits[0])
    c.release(hits[0])  # releasing twice is harmless
    assert c.stats().nodes == 2
    c.release(hits[1])  # the last user leaves: evicted
    assert c.stats().nodes == 0
    c.check_integrity()


def test_concurrent_use_of_one_entry(tiny_model):
    """Threads restore the same entry while another stores prompts that push the cache over its budget."""
    vocab = tiny_model.cfg.vocab_size
    p = _tokens(128, vocab, 15)
    full = _layout(tiny_model, p)
    c = _cache(tiny_model)
    c.store(p, full)
    c.config = PrefixCacheConfig(enabled=True, page_tokens=PAGE, host_bytes=c.host_bytes + 1)
    errors, restored = [], []

    def user():
        try:
            for _ in range(20):
                hit = c.acquire(p + [3], 128)
                if hit.tokens:
                    lay = tiny_model.new_layout()
                    lay.reserve(tiny_model.cfg, 129)
                    restored.append(c.restore(hit, lay))
                c.release(hit)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    def writer():
        for s in range(6):
            q = _tokens(64, vocab, 100 + s)
            c.store(q, _layout(tiny_model, q))

    threads = [threading.Thread(target=user) for _ in range(3)] + [threading.Thread(target=writer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert restored  # at least the uses before the first eviction hit
    for lay in restored:
        for a, b in zip(lay.layers, full.layers):
            torch.testing.assert_close(a.window, b.window, atol=0, rtol=0)
            if a.entries is not None:
                torch.testing.assert_close(a.entries, b.entries, atol=0, rtol=0)
    c.check_integrity()
    assert all(n.refs == 0 for n in c.nodes.values())


# --- the disk tier ---------------------------------------------------------------------------------


def _disk_cache(model, directory, host_bytes=0, disk_bytes=1 << 30) -> PrefixCache:
    return _cache(model, host_bytes=host_bytes, disk_bytes=disk_bytes, directory=str(directory))


def _files(directory) -> list[str]:
    return sorted(os.listdir(directory))


def test_spill_to_disk_and_reload_on_a_hit(tiny_model, tmp_path):
    vocab = tiny_model.cfg.vocab_size
    w = PrefillWorker(tiny_model, PrefillConfig(prefix_cache=PrefixCacheConfig(
        enabled=True, page_tokens=PAGE, host_bytes=0, disk_bytes=1 << 30, directory=str(tmp_path))))
    p = _tokens(200, vocab, 16)
    _prefill(w, p)
    assert w.prefix_cache.flush(30)  # files are written by the cache's writer thread
    st = w.prefix_cache.stats()
    assert st.host_seg_bytes == st.host_state_bytes == 0  # all spilled
    assert st.disk_pages == 3 and st.disk_writes == 4 and st.evictions == 4
    assert not [f for f in _files(tmp_path) if f.startswith(".tmp-")]
    q = p + _tokens(30, vocab, 17)
    res = _prefill(w, q)
    st = w.prefix_cache.stats()
    assert st.hit_tokens == 192 and st.disk_reads == 4
    assert _continue(tiny_model, res)[0] == _continue(tiny_model, _prefill(_plain(tiny_model), q))[0]
    w.prefix_cache.check_integrity()


def test_corrupt_file_is_a_miss(tiny_model, tmp_path):
    vocab = tiny_model.cfg.vocab_size
    c = _disk_cache(tiny_model, tmp_path)
    p = _tokens(128, vocab, 18)
    c.store(p, _layout(tiny_model, p))
    c.flush()
    state = next(f for f in _files(tmp_path) if f.endswith(".state"))
    path = tmp_path / state
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    hit = c.acquire(p + [1], 128)
    assert hit.tokens == 0 and c.stats().disk_errors == 1
    assert state not in _files(tmp_path)  # the bad file is gone
    c.release(hit)
    # a corrupt page takes the pages after it along
    c.store(p, _layout(tiny_model, p))
    c.flush()
    c.config = PrefixCacheConfig(enabled=True, page_tokens=PAGE, host_bytes=0, disk_bytes=1 << 30, directory=str(tmp_path))
    c._evict_host()
    first = tmp_path / f"{c.root.children[tuple(p[:64])].digest}.seg"
    first.write_bytes(first.read_bytes()[:-7])  # truncated
    assert c.acquire(p + [1], 128).tokens == 0
    assert c.stats().nodes == 0
    c.check_integrity()


def test_cache_directory_survives_a_restart(tiny_model, tmp_path):
    vocab = tiny_model.cfg.vocab_size
    pc = PrefixCacheConfig(enabled=True, page_tokens=PAGE, host_bytes=1 << 30, disk_bytes=1 << 30, directory=str(tmp_path))
    w = PrefillWorker(tiny_model, PrefillConfig(prefix_cache=pc))
    p = _tokens(260, vocab, 19)
    _prefill(w, p)  # written through to disk while it stays in memory
    w.prefix_cache.close()
    (tmp_path / ".tmp-leftover.seg.1").write_bytes(b"half a file")  # an interrupted write
    (tmp_path / "ffff.seg").write_bytes(b"not ours")

    w2 = PrefillWorker(tiny_model, PrefillConfig(prefix_cache=pc))  # a new process: index from the directory
    c = w2.prefix_cache
    assert c.stats().nodes == 4 and c.stats().state_snapshots == 1 and c.host_bytes == 0
    assert ".tmp-leftover.seg.1" not in _files(tmp_path) and "ffff.seg" not in _files(tmp_path)
    q = p + _tokens(20, vocab, 20)
    res = _prefill(w2, q)
    assert c.stats().hit_tokens == 256 and c.stats().disk_reads == 5
    assert _continue(tiny_model, res)[0] == _continue(tiny_model, _prefill(_plain(tiny_model), q))[0]
    c.check_integrity()


def test_disk_budget_drops_least_recently_used(tiny_model, tmp_path):
    vocab = tiny_model.cfg.vocab_size
    probe = _disk_cache(tiny_model, tmp_path / "probe")
    p1 = _tokens(64, vocab, 21)
    probe.store(p1, _layout(tiny_model, p1))
    probe.flush()
    per_prompt = probe.disk_bytes
    c = _disk_cache(tiny_model, tmp_path / "c", disk_bytes=2 * per_prompt)
    prompts = [_tokens(64, vocab, s) for s in (22, 23, 24)]
    for p in prompts:
        c.store(p, _layout(tiny_model, p))
        c.flush()
    st = c.stats()
    assert st.disk_drops == 2 and c.disk_bytes <= 2 * per_prompt
    assert c.acquire(prompts[0] + [1], 64).tokens == 0
    assert c.acquire(prompts[2] + [1], 64).tokens == 64
    assert len(_files(tmp_path / "c")) == 4
    c.check_integrity()


def test_a_part_dropped_while_its_file_is_written_leaves_no_file(tiny_model, tmp_path):
    vocab = tiny_model.cfg.vocab_size
    c = _disk_cache(tiny_model, tmp_path, host_bytes=1 << 30)
    gate, write = threading.Event(), c.disk.write

    def slow_write(*args):
        gate.wait(10)
        return write(*args)

    c.disk.write = slow_write
    p = _tokens(64, vocab, 25)
    c.store(p, _layout(tiny_model, p))
    c.config = PrefixCacheConfig(enabled=True, page_tokens=PAGE, host_bytes=0, disk_bytes=1 << 30, directory=str(tmp_path))
    c._evict_host()
    assert c.stats().nodes == 1 and c.host_bytes > 0  # waiting for its files: not evicted yet
    c._drop(c.root.children[tuple(p)].seg)  # dropped (as a failed read would) while the writes are queued
    gate.set()
    assert c.flush(30)
    assert _files(tmp_path) == [] and c.stats().disk_writes == 0
    c.check_integrity()
    c.close()


def test_a_failing_cache_never_fails_a_request(tiny_model):
    vocab = tiny_model.cfg.vocab_size
    w = _worker(tiny_model)
    p = _tokens(150, vocab, 26)
    _prefill(w, p)

    def broken(*_):
        raise RuntimeError("broken restore")

    w.prefix_cache.restore = broken
    computed = w.tokens_in
    res = _prefill(w, p)
    assert w.tokens_in - computed == len(p)  # prefilled whole
    assert _continue(tiny_model, res)[0] == _continue(tiny_model, _prefill(_plain(tiny_model), p))[0]
    assert all(n.refs == 0 for n in w.prefix_cache.nodes.values())  # the failed lookup released its pins
