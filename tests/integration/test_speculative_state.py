"""Speculation leaves no trace of a rejected position in the store: its state equals a spec-off run's, entry by entry.

A speculative step (`decode.speculative.greedy_step` over a `cachetier.spec_batch.SpecBatch`) runs the main model
at every draft position, so each of them computes window keys, compressor tails, overlaps and, where a window
completes, C4/HCA entries and indexer keys. Only the positions up to the accepted count may leave that behind.
Here the drafts are chosen by the test from the true greedy continuation (learned from a spec-off run), so each
step's accepted count is known in advance: every draft wrong, every draft right, a seeded number of right ones,
and rows verifying fewer drafts than the span beside rows verifying all of them. After the same number of
decoded positions, every request's state in the store (`dump_state`) must equal the spec-off store's bit for bit.

Bit for bit holds because both runs give every matmul the same shape: the spec-off steps are padded to the spec
view's rows (REQUESTS x SPAN) and both use the same block-table width (BLOCKS). With the row count a multiple of
the CPU's vector width, a row's result depends on its own inputs only, not on its place in the batch (with 12 rows
the 2-column matmul of `model.model.hc_head` rounds odd and even rows differently, and the state then drifts
by an ulp or so a step).

What is compared (`dump_state`): the whole state group except the MTP ring (spec-off writes none): window rings,
every compressor's tail, score and overlap rows; the entries a request has completed, read through its block
tables: indexer keys, HCA entries, C4 entries (tier off: arena pages; tier on: host pool rows) and, tier on, the
hot buffer's ring slots. Entries past the completed count are left out on purpose: a rejected position may write
one there (`SpecBatch` writes entries at once), and nothing reads it before the position that completes it
rewrites it. The hot buffer's LRU slots are left out too: a speculative step resolves the union of its positions'
selections, so which old entries are cached differs with speculation by design (`store.check_integrity` still
checks that each one equals its host copy).

The prompts (about 100 to 200 tokens) and the runs (72 positions) make every request cross many C4 windows
(rate 4), at least two HCA windows (rate 32), its whole sliding window (32) and, for the longest, a page
boundary (256 tokens).
"""

from __future__ import annotations

import random

import pytest
import torch

from cachetier.store import TieredStore
from core.configs import TierConfig
from decode.speculative import greedy_step

N = 3
"""Draft tokens a step verifies per request."""
SPAN = N + 1
DECODE = 72
"""Positions each request decodes: a multiple of SPAN, so full acceptance ends exactly there."""
PROMPT_LENGTHS = (101, 150, 203)
REQUESTS = 4
"""Requests a spec view holds: the three above and a padding one, so both runs step over 16 rows."""
ROWS = REQUESTS * SPAN
BLOCKS = 2
"""Block-table width of every step of both runs (the longest request ends under 512 tokens)."""


@pytest.fixture(scope="module")
def model():
    """The built-in model with its MTP head, and one torch thread for the module (two spin against each other on a
    busy 2-core machine; the module fixtures run before a function-scoped `one_torch_thread` would)."""
    from model.builtin import ensure_builtin
    from model.loader import load_model

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model(ensure_builtin(), mtp=True)
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def prefilled(model):
    """(prompt, first token, layout) per request; the store only reads a layout, so every run admits the same ones."""
    g = torch.Generator().manual_seed(29)
    out = []
    with torch.inference_mode():
        for n in PROMPT_LENGTHS:
            ids = torch.randint(6, model.cfg.vocab_size, (n,), generator=g).tolist()
            logits, layout = model.prefill(ids, last_only=True)
            out.append((ids, int(logits[-1].argmax()), layout))
    return out


def new_store(model, prefilled, offload: bool) -> tuple[TieredStore, list[str]]:
    store = TieredStore(model.cfg, TierConfig(offload=offload, speculative_tokens=N, device_budget_bytes=64 << 20,
                                              reserved_slots=2), dtype=model.dtype)
    ids = [f"r{i}" for i in range(len(prefilled))]
    for rid, (prompt, _, layout) in zip(ids, prefilled):
        store.admit(rid, layout, len(prompt) + DECODE + 8)
    return store, ids


def dump_state(store: TieredStore, rid: str) -> dict[str, torch.Tensor]:
    """One request's state in the store, by name: what a spec-off run must hold bit for bit too (the module docstring
    says what is left out and why)."""
    g, r = store.geo, store.residents[rid]
    n = r.num_tokens
    out = {}
    gb = store.group_base(r.group)
    for name, f in g.state_fields.items():
        if name == "mtp":
            continue
        vals = store.arena[gb + f.offset : gb + f.offset + f.numel].view(f.shape)
        if name == "hot":
            vals = vals[:, g.lru :]  # [csa layers, reserved, row]: the ring of the newest entries
        out[f"state.{name}"] = vals.clone()
    blocks = torch.as_tensor(r.blocks_np)
    completed = {"index_keys": n // store.cfg.csa_rate, "c4": n // store.cfg.csa_rate, "hca": n // store.cfg.hca_rate}
    for name, f in g.block_fields.items():
        per = g.eh if name == "hca" else g.e4
        e = torch.arange(completed[name])
        pages = blocks[e // per]
        for k in range(f.shape[0]):  # the field's layers: CSA (keys, c4) or HCA ones
            starts = f.start(store.page_base(pages), k * per + e % per)  # [entries] element offsets
            out[f"{name}.{k}"] = store.arena[starts[:, None] + torch.arange(f.width)].clone()  # [entries, width]
    if store.hot is not None:
        host = store.hot.host
        rows = host.rows(torch.as_tensor(r.host_blocks_np), torch.arange(completed["c4"]))
        for j in range(len(g.csa_layers)):
            out[f"host.{j}"] = host.kv[j, rows].clone()  # [entries, row]
    return out


def assert_same_state(got: TieredStore, want: TieredStore, ids: list[str]) -> None:
    for rid in ids:
        assert got.residents[rid].num_tokens == want.residents[rid].num_tokens
        a, b = dump_state(got, rid), dump_state(want, rid)
        assert a.keys() == b.keys()
        differ = {k: int((a[k] != b[k]).any(-1).sum()) for k in a if not torch.equal(a[k], b[k])}
        assert not differ, f"{rid}: rows differing from spec-off, by field: {differ}"


@pytest.fixture(scope="module", params=[False, True], ids=["tier_off", "tier_on"])
def reference(request, model, prefilled):
    """Spec off: the true greedy tokens ([first token] + DECODE per request) and the store after DECODE steps, each
    step padded to the spec view's shape (module docstring)."""
    store, ids = new_store(model, prefilled, request.param)
    out = [[first] for _, first, _ in prefilled]
    pad = [0] * (ROWS - len(ids))
    for _ in range(DECODE):
        logits = model.decode_step(store.step_view(ids, ROWS, num_blocks=BLOCKS), [o[-1] for o in out] + pad)  # [ROWS, vocab]
        for o, t in zip(out, logits[: len(ids)].argmax(-1).tolist()):
            o.append(t)
    store.check_integrity()
    return request.param, store, ids, out


def run_spec(model, prefilled, reference, right, cap=lambda i, step: N) -> dict:
    """Spec on to DECODE positions per request, drafting from the true continuation: `right(i, step, nd)` of the
    `nd` drafts are correct (the leading ones), the rest are a token that is not the target. `cap(i, step)`: at
    most that many drafts are verified (the row's tokens still carry the full correct continuation past them, so
    an unverified position counted as accepted would show). Asserts nothing itself (`check` does, state first):
    returns the store, the tokens, and per step the accepted counts and the counts of right drafts."""
    offload, _, ids, truth = reference
    vocab = model.cfg.vocab_size
    store, _ = new_store(model, prefilled, offload)
    out = [[first] for _, first, _ in prefilled]
    accepted, right_drafts = [], []
    with torch.inference_mode():
        while True:
            active = [i for i, o in enumerate(out) if len(o) <= DECODE]  # o holds its first token + positions done
            if not active:
                break
            step = len(accepted)
            toks, nds, want = [], [], []
            for i in active:
                k = len(out[i]) - 1
                nd = min(cap(i, step), N, DECODE - k - 1)
                c = right(i, step, nd)
                nxt = [truth[i][k + j] if k + j <= DECODE else 0 for j in range(1, SPAN)]
                drafts = [t if j < c or j >= nd else (t + 1) % vocab for j, t in enumerate(nxt)]
                toks.append([out[i][-1], *drafts])
                nds.append(nd)
                want.append(c)
            view = store.spec_view([ids[i] for i in active], REQUESTS, SPAN, num_blocks=BLOCKS, tokens=toks, drafts=nds)
            res = greedy_step(model, view, N).tolist()
            a = [row[SPAN] for row in res[: len(active)]]
            view.advance(a)
            for i, row, ai in zip(active, res, a):
                out[i].extend(row[: ai + 1])
            accepted.append(a)
            right_drafts.append(want)
    return {"store": store, "tokens": out, "accepted": accepted, "right": right_drafts}


def check(run: dict, reference) -> None:
    """The spec-on run against spec off: the state entry by entry, the store's invariants, each step's accepted
    count (exactly its right leading drafts) and the tokens."""
    _, want, ids, truth = reference
    assert_same_state(run["store"], want, ids)
    run["store"].check_integrity()
    bad = [(step, a, c) for step, (a, c) in enumerate(zip(run["accepted"], run["right"])) if a != c]
    assert not bad, f"(step, accepted, right drafts) where they differ: {bad[:5]}"
    assert run["tokens"] == truth


def test_long_runs_of_rejection(model, prefilled, reference):
    run = run_spec(model, prefilled, reference, right=lambda i, step, nd: 0)
    check(run, reference)
    assert len(run["accepted"]) == DECODE and all(a == [0] * len(prefilled) for a in run["accepted"])


def test_full_acceptance(model, prefilled, reference):
    run = run_spec(model, prefilled, reference, right=lambda i, step, nd: nd)
    check(run, reference)
    assert len(run["accepted"]) == DECODE // SPAN and all(a == [N] * len(prefilled) for a in run["accepted"])


def test_mixed_acceptance(model, prefilled, reference):
    rng = random.Random(3)
    run = run_spec(model, prefilled, reference, right=lambda i, step, nd: rng.randint(0, nd))
    check(run, reference)
    counts = {a for step in run["accepted"] for a in step}
    assert counts == set(range(SPAN)), f"the seed should give every accepted count, got {sorted(counts)}"


def test_fewer_drafts_beside_full_rows(model, prefilled, reference):
    caps = (0, 1, N)  # each step: one row verifies no draft, one a single draft, one all of them (rotating)
    run = run_spec(model, prefilled, reference, right=lambda i, step, nd: nd, cap=lambda i, step: caps[(i + step) % len(caps)])
    check(run, reference)
    assert any(sorted(a) == [0, 1, N] for a in run["accepted"])
