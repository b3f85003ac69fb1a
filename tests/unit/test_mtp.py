"""The MTP block as a drafter: its batched steps against the whole-sequence reference, the ring that survives
rejected drafts, the draft chain's shapes, determinism and capture safety, and the shipped head's acceptance."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from model.builtin import SHIPPED, random_init, tiny_config
from model.loader import build_empty, load_model
from model.mtp import MTPState, ring_slots, window_slots
from model.train import mtp_acceptance

TOL = 1e-4


@pytest.fixture(scope="module")
def model():
    m = build_empty(replace(tiny_config(), vocab_size=300), mtp=True)
    random_init(m, 11)
    return m.eval()


@pytest.fixture(scope="module")
def text(model):
    """A 90-token sequence, its main streams and logits from one prefill."""
    ids = torch.randint(6, model.cfg.vocab_size, (90,), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        logits, _, hidden = model.prefill(ids, hidden_tail=ids.numel())
    return ids, hidden, logits


def _reference(model, ids, hidden):
    """The whole-sequence MTP logits [L-1, vocab] at positions 0..L-2 (true inputs everywhere)."""
    with torch.inference_mode():
        logits, _ = model.mtp.forward_sequence(model, hidden[None, :-1], ids[None, 1:])
    return logits[0]


def test_prefill_returns_the_final_streams(model, text):
    ids, hidden, logits = text
    assert hidden.shape == (ids.numel(), model.cfg.hc_mult, model.cfg.hidden_size)
    with torch.inference_mode():
        assert torch.allclose(model.logits(hidden), logits, atol=1e-5)  # the streams the head collapsed
        _, _, tail = model.prefill(ids, hidden_tail=7)
    assert torch.allclose(tail, hidden[-7:], atol=1e-5)


def test_a_decode_step_returns_the_streams_it_drafts_from(model, text):
    """`decode_forward(with_streams=True)`: the streams of the decoded position are prefill's at that position, and
    its logits are what the step returns without them."""
    from cachetier.batch import LayoutBatch

    ids, hidden, logits = text
    t = 60
    with torch.inference_mode():
        _, layout = model.prefill(ids[:t])
        store = LayoutBatch(model.cfg, [layout])
        got, streams = model.decode_forward(store, ids[t : t + 1], with_streams=True)
    assert streams.shape == (1, model.cfg.hc_mult, model.cfg.hidden_size)
    assert (streams[0] - hidden[t]).abs().max() < TOL and (got[0] - logits[t]).abs().max() < TOL


def test_steps_one_position_at_a_time_match_the_sequence(model, text):
    ids, hidden, _ = text
    ref = _reference(model, ids, hidden)
    state = model.new_mtp_state(1, 3)
    with torch.inference_mode():
        steps = [model.mtp_step(state, hidden[t : t + 1], ids[t + 1 : t + 2], torch.tensor([t]))[0] for t in range(ids.numel() - 1)]
    assert (torch.cat(steps) - ref).abs().max() < TOL and ref.abs().max() > 1  # past the window (90 > 32) too


def test_every_position_as_a_row_of_one_batch(model, text):
    """Rows at different positions, each ring filled with that row's true earlier entries (`teacher_rings`), in
    one fixed-shape step; and a ring written by `mtp_prefill` gives the same as the teacher ring."""
    ids, hidden, _ = text
    ref = _reference(model, ids, hidden)
    rows = torch.arange(ids.numel() - 1)
    with torch.inference_mode():
        state = model.mtp.teacher_rings(model, hidden[:-1], ids[1:], rows, 3)
        batched, _ = model.mtp_step(state, hidden[rows], ids[rows + 1], rows)
        assert (batched - ref).abs().max() < TOL
        one = model.new_mtp_state(1, 3)
        model.mtp_prefill(one, 0, hidden[:60], ids[1:61], 0)  # positions 0..59: the last window of them is written
        window = torch.arange(60 - model.cfg.sliding_window, 60) % one.slots
        assert torch.allclose(one.ring[0, window], state.ring[60, window], atol=1e-6)
        last, _ = model.mtp_step(one, hidden[60:61], ids[61:62], torch.tensor([60]))
    assert (last[0] - ref[60]).abs().max() < TOL


def test_draft_is_the_chain_of_greedy_steps(model, text):
    ids, hidden, _ = text
    rows = torch.tensor([5, 40, 70])
    with torch.inference_mode():
        state = model.mtp.teacher_rings(model, hidden[:-1], ids[1:], rows, 3)
        again = MTPState(state.ring.clone())
        drafts, logits = model.draft(state, hidden[rows], ids[rows + 1], rows, 3, with_logits=True)
        h, tok, want = hidden[rows], ids[rows + 1], []
        for k in range(3):
            lg, h = model.mtp_step(again, h, tok, rows + k)
            tok = lg.argmax(-1)
            want.append(tok)
    assert drafts.shape == (3, 3) and logits.shape == (3, 3, model.cfg.vocab_size)
    assert torch.equal(drafts, torch.stack(want, 1)) and torch.equal(drafts, logits.argmax(-1))
    assert torch.equal(state.ring, again.ring)  # the same entries written


def test_draft_is_deterministic_and_picks_through_the_given_rule(model, text):
    ids, hidden, _ = text
    rows = torch.tensor([10, 50])
    with torch.inference_mode():
        base = model.mtp.teacher_rings(model, hidden[:-1], ids[1:], rows, 2)
        runs = [model.draft(MTPState(base.ring.clone()), hidden[rows], ids[rows + 1], rows, 2) for _ in range(2)]
        fixed = model.draft(MTPState(base.ring.clone()), hidden[rows], ids[rows + 1], rows, 2,
                            pick=lambda logits, k: torch.full_like(logits[:, 0], 7 + k, dtype=torch.long))
    assert torch.equal(runs[0], runs[1])
    assert fixed.tolist() == [[7, 8], [7, 8]]


def test_rejected_drafts_leave_nothing_a_later_query_reads(model, text):
    """Draft 3 from position q, accept one, rewrite the accepted position from the main model's streams, draft
    again: the same as a ring that never held the rejected drafts (the teacher ring of the new position)."""
    ids, hidden, _ = text
    q = 50
    with torch.inference_mode():
        state = model.mtp.teacher_rings(model, hidden[:-1], ids[1:], torch.tensor([q]), 3)
        wrong = torch.tensor([3])  # a draft chain fed a token the text does not have: entries that must not be read
        model.draft(state, hidden[q : q + 1], wrong, torch.tensor([q]), 3)
        # accepted: position q's entry is rewritten with its true inputs, then q + 1 drafts on
        model.mtp_step(state, hidden[q : q + 1], ids[q + 1 : q + 2], torch.tensor([q]))
        got = model.draft(state, hidden[q + 1 : q + 2], ids[q + 2 : q + 3], torch.tensor([q + 1]), 3, with_logits=True)[1]
        clean = model.mtp.teacher_rings(model, hidden[:-1], ids[1:], torch.tensor([q + 1]), 3)
        want = model.draft(clean, hidden[q + 1 : q + 2], ids[q + 2 : q + 3], torch.tensor([q + 1]), 3, with_logits=True)[1]
    assert (got - want).abs().max() < TOL


def test_window_slots_see_exactly_the_window():
    pos = torch.tensor([0, 5, 40, 41])
    slots, window = 35, 32
    rows = window_slots(pos, slots, window)
    for b, p in enumerate(pos.tolist()):
        held = {p - ((p - j) % slots) for j in range(slots) if rows[b, j] >= 0}
        assert held == set(range(max(0, p - window + 1), p + 1))
        assert all(rows[b, j] in (-1, b * slots + j) for j in range(slots))
    assert ring_slots(tiny_config(), 3) == 35


def test_rows_outside_the_batch_keep_their_ring(model, text):
    ids, hidden, _ = text
    rows = torch.tensor([20, 30])
    with torch.inference_mode():
        state = model.mtp.teacher_rings(model, hidden[:-1], ids[1:], rows, 1)
        before = state.ring.clone()
        model.mtp_step(state, hidden[rows], ids[rows + 1], rows, valid=torch.tensor([True, False]))
    assert torch.equal(state.ring[1], before[1]) and not torch.equal(state.ring[0], before[0])


def test_draft_asks_for_a_ring_with_room(model, text):
    ids, hidden, _ = text
    with pytest.raises(ValueError, match="drafts at most 1"):
        model.draft(model.new_mtp_state(1, 1), hidden[:1], ids[1:2], torch.tensor([0]), 2)


def test_draft_traces_as_one_graph(model, text):
    """`torch.compile(fullgraph=True)` raises on any graph break, so on any host read (.item(), .tolist(),
    bool of a tensor) inside the chain; the compiled chain gives the eager result."""
    ids, hidden, _ = text
    rows = torch.tensor([3, 33, 63])
    with torch.inference_mode():
        base = model.mtp.teacher_rings(model, hidden[:-1], ids[1:], rows, 2)

        def chain(ring, h, tok, pos):
            return model.draft(MTPState(ring), h, tok, pos, 2, with_logits=True)

        eager = chain(base.ring.clone(), hidden[rows], ids[rows + 1], rows)
        compiled = torch.compile(chain, fullgraph=True, backend="eager")(base.ring.clone(), hidden[rows], ids[rows + 1], rows)
    assert torch.equal(eager[0], compiled[0]) and torch.allclose(eager[1], compiled[1], atol=1e-5)


def test_draft_holds_in_a_cuda_graph_on_fake_cuda(model):
    """The chain on (fake) CUDA tensors under the capture guard: no tensor from host data, no host copy, no
    device read, no allocation sized by data."""
    import copy

    from kernels.capture_guard import capture_guard, fake_cuda

    real = copy.deepcopy(model)
    with fake_cuda():
        m = real.to("cuda")
        state = m.new_mtp_state(4, 3)
        hidden = torch.randn(4, m.cfg.hc_mult, m.cfg.hidden_size, device="cuda")
        tokens = torch.zeros(4, dtype=torch.long, device="cuda")
        pos = torch.zeros(4, dtype=torch.long, device="cuda")
        valid = torch.ones(4, dtype=torch.bool, device="cuda")
        with torch.inference_mode(), capture_guard("cuda"):
            drafts = m.draft(state, hidden, tokens, pos, 3, valid=valid)
        assert drafts.shape == (4, 3) and drafts.device.type == "cuda"


# --- the shipped head -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shipped():
    """The built-in model with its head (the loader reads the block only when asked)."""
    return load_model(SHIPPED, mtp=True)


def test_the_shipped_model_has_a_trained_head(shipped):
    record = json.loads((SHIPPED / "training.json").read_text())["mtp"]
    assert shipped.mtp is not None and record["result"]["main_weights_unchanged"]
    assert record["result"]["held_out_mtp_loss_trained"] < record["result"]["held_out_mtp_loss_init"]
    assert record["result"]["acceptance"]["greedy"]["depth_1"] >= 0.2


def test_the_shipped_head_drafts_well_above_chance_on_held_out_text(shipped):
    """On a held-out standard-library file (never trained on), draft 1 equals the main model's greedy next token
    at a rate far above chance (1 in 4096): a loose bound on what training.json records."""
    from model.tokenizer import load_tokenizer
    from model.train import read_texts, stdlib_files, token_stream

    held = read_texts(stdlib_files()[1][:3])
    ids = token_stream(load_tokenizer(SHIPPED), held)[:600]
    got = mtp_acceptance(shipped, [ids], depth=2)
    assert got["positions"] > 500
    assert got["depth_1"] >= 0.2 and got["depth_2"] <= got["depth_1"]
