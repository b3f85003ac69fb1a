"""The sampling controls beyond temperature and the filters: logit bias, presence/frequency/repetition penalties,
min_tokens, bad words, allowed token ids. Each changes what is drawn the way its definition says (checked against
hand computations), greedy rows honour them, a row draws the same alone or in any batch, the device step traces
as one graph, and the decode and prefill workers carry what a request has seen across regroups, retries and the
PD split."""

from __future__ import annotations

import pytest
import torch
from serving_helpers import EAGER  # noqa: E402

from cachetier.store import TieredStore
from core.configs import PrefillConfig, StubConfig, TierConfig
from core.request import Attempt, Request
from core.types import InvalidRequestError, SampledToken, SamplingParams, finish_reason
from decode.worker import DecodeRequest, DecodeWorker, _Group, _Running
from model import sampling as smp
from model.sampling import SamplingBatch, index_column, sample, sample_batch
from model.stub import StubModel
from prefill.worker import PrefillWorker

SP = SamplingParams
TIER = TierConfig(offload=True, hot_buffer_slots=16, device_budget_bytes=4 * 2**20, host_pool_bytes=16 * 2**20)


def _batch(params, vocab, seen=None, eos=(), seeds=None, device="cpu", block_rows=None):
    """A SamplingBatch the way `sample` builds one: a private token history for the rows that look back."""
    history, slots = smp.TokenHistory.for_rows(params, seen, vocab, device)
    seeds = list(range(len(params))) if seeds is None else seeds
    return SamplingBatch.build(params, seeds, device, vocab, block_rows, eos_ids=eos, history=history, slots=slots)


def _processed(logits, params, seen=None, index=None, eos=()):
    sb = _batch(params, logits.shape[-1], seen, eos)
    return smp.process_logits(logits, sb, index_column(index or [0] * len(params), "cpu"))


def _ids(tokens):
    return [t.token_id for t in tokens]


# --- each control against its definition -----------------------------------------------------------------------


def test_logit_bias_is_added_to_the_raw_logits():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 50, generator=g)
    top2 = logits.topk(2, dim=-1).indices
    banned = [SP(logit_bias={int(top2[i, 0]): -100.0}) for i in range(4)]  # -100 on the greedy token
    assert _ids(sample(logits, banned, [0] * 4, [0] * 4)) == top2[:, 1].tolist()
    low = int(logits[0].argmin())
    forced = SP(temperature=1.0, logit_bias={low: 100.0})  # +100 on the least likely token: drawn every time
    assert set(_ids(sample(logits[:1].expand(300, -1), [forced] * 300, list(range(300)), [0] * 300))) == {low}
    x = _processed(logits[:1], [SP(logit_bias={3: 2.5, 7: -1.25})])
    want = logits[:1].clone()
    want[0, 3] += 2.5
    want[0, 7] -= 1.25
    assert torch.equal(x, want)


def test_presence_and_frequency_penalties_against_a_hand_computation():
    """OpenAI: logit - frequency x count - presence x (count > 0), counts over the generated tokens only (the
    prompt's tokens are not penalised)."""
    raw = [2.0, 0.3, 2.5, -0.4, 1.0, 1.9, 0.0, 0.7]
    logits = torch.tensor([raw])
    prompt, generated = (1, 3, 6), (2, 2, 5, 2, 7)
    counts = {2: 3, 5: 1, 7: 1}
    for presence, frequency in ((0.6, 0.25), (-1.0, 0.0), (0.0, -0.5), (2.0, 2.0)):
        p = SP(presence_penalty=presence, frequency_penalty=frequency)
        want = [x - frequency * counts.get(v, 0) - presence * (v in counts) for v, x in enumerate(raw)]
        got = _processed(logits, [p], [(prompt, generated)])[0]
        assert got.tolist() == pytest.approx(want, abs=1e-6), (presence, frequency)
        assert _ids(sample(logits, [p], [0], [5], tokens_so_far=[(prompt, generated)])) == [max(range(8), key=want.__getitem__)]
    assert _ids(sample(logits, [SP()], [0], [5])) == [2]  # unpenalised the repeated token wins; penalised (0.6, 0.25) it is 0


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    """vLLM/HF: seen = prompt or generated; a seen token's logit is divided by the penalty when positive and
    multiplied by it otherwise. Penalties above 1 discourage repeats, below 1 encourage them."""
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 0.0]])
    seen = [((1, 2), (4,))]  # prompt: a negative and a positive logit; generated: the largest
    assert _processed(logits, [SP(repetition_penalty=2.0)], seen)[0].tolist() == [2.0, -2.0, 0.25, -0.5, 1.5, 0.0]
    assert _processed(logits, [SP(repetition_penalty=0.5)], seen)[0].tolist() == [2.0, -0.5, 1.0, -0.5, 6.0, 0.0]
    assert _ids(sample(logits, [SP()], [0], [1])) == [4]
    assert _ids(sample(logits, [SP(repetition_penalty=2.0)], [0], [1], tokens_so_far=seen)) == [0]
    assert _ids(sample(logits, [SP(repetition_penalty=2.0)], [0], [0], tokens_so_far=[((4,), ())])) == [0]  # the prompt counts


def test_min_tokens_holds_back_eos_and_stop_ids_until_the_count():
    """End-of-sequence (id 1) is the best token and stop id 3 the next: below min_tokens neither is drawn, from
    the min_tokens-th index on the best is. With ignore_eos only the stop id is held back."""
    logits = torch.tensor([[0.0, 5.0, 0.5, 4.0, 0.2, 3.0]])
    p = SP(min_tokens=3, stop_token_ids=(3,), max_tokens=8)
    assert [_ids(sample(logits, [p], [0], [i], eos_ids=(1,)))[0] for i in range(5)] == [5, 5, 5, 1, 1]
    x = _processed(logits, [p], index=[2], eos=(1,))[0]
    assert x.isinf().tolist() == [False, True, False, True, False, False]
    ignoring = SP(min_tokens=3, stop_token_ids=(3,), ignore_eos=True)
    assert _ids(sample(logits, [ignoring], [0], [0], eos_ids=(1,))) == [1]
    hot = SP(temperature=1.0, min_tokens=2, stop_token_ids=(3,))
    early = _ids(sample(logits.expand(400, -1), [hot] * 400, list(range(400)), [1] * 400, eos_ids=(1,)))
    late = _ids(sample(logits.expand(400, -1), [hot] * 400, list(range(400)), [2] * 400, eos_ids=(1,)))
    assert not {1, 3} & set(early) and {1, 3} <= set(late)


def test_bad_words_ban_single_tokens_always_and_a_words_last_token_after_its_prefix():
    """vLLM: a one-token word is always banned; a longer word's last token is banned when the tokens before it
    are the last ones generated (the prompt does not count), matched on the device over the recent tokens."""
    logits = torch.zeros(1, 12)
    p = SP(bad_words_token_ids=((5,), (1, 2, 9), (4, 9), (3, 3, 3, 8)))
    cases = [((), (), {5}), ((), (7, 1, 2), {5, 9}), ((), (7, 4), {5, 9}), ((), (1, 2, 8), {5}), ((), (2,), {5}),
             ((), (1, 2, 4), {5, 9}), ((1, 2), (), {5}), ((), (3, 3, 3), {5, 8}), ((), (3, 3), {5}),
             ((), tuple(range(10, 12)) * 30 + (1, 2), {5, 9}), ((), (1, 2) + (10,) * 40, {5})]
    for prompt, generated, banned in cases:
        x = _processed(logits, [p], [(prompt, generated)])[0]
        assert {v for v in range(12) if x[v] == float("-inf")} == banned, (prompt, generated)
    longest = tuple(range(10, 10 + smp.TokenHistory.RING + 1))  # the longest word a request may ban
    x = _processed(torch.zeros(1, 64), [SP(bad_words_token_ids=(longest,))], [((), (0,) + longest[:-1])])[0]
    assert {v for v in range(64) if x[v] == float("-inf")} == {longest[-1]}


def test_allowed_token_ids_are_all_that_can_be_drawn():
    """A vocabulary that is not a multiple of 32, allowed ids at a word's last bit (the int32 sign bit), the next
    word's first and the vocabulary's last."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 70, generator=g)
    allowed = (0, 31, 32, 69)
    x = _processed(logits, [SP(allowed_token_ids=allowed)])[0]
    assert torch.equal(x.isfinite(), torch.isin(torch.arange(70), torch.tensor(allowed)))
    assert torch.equal(x[list(allowed)], logits[0, list(allowed)])
    assert _ids(sample(logits, [SP(allowed_token_ids=allowed)], [0], [0])) == [max(allowed, key=lambda t: float(logits[0, t]))]
    flat = SP(temperature=1.0, allowed_token_ids=allowed)
    assert set(_ids(sample(torch.zeros(400, 70), [flat] * 400, list(range(400)), [0] * 400))) == set(allowed)


def test_a_token_bitmask_masks_the_rows_it_is_given():
    """The grammar engine's input: one packed row per batch row, bit j of word w for token 32 w + j."""
    g = torch.Generator().manual_seed(3)
    vocab = 100
    sets = [torch.randperm(vocab, generator=g)[:k].tolist() for k in (1, 17, 64, vocab)]
    bits = smp.pack_token_bitmask(sets, vocab, "cpu")
    assert bits.shape == (4, 4) and bits.dtype == torch.int32
    logits = torch.randn(4, vocab, generator=g)
    sb = _batch([SP()] * 4, vocab)
    x = smp.process_logits(logits, sb, index_column([0] * 4, "cpu"), token_bitmask=bits)
    for row, ids in enumerate(sets):
        assert torch.equal(x[row].isfinite(), torch.isin(torch.arange(vocab), torch.tensor(ids)))
    assert _ids(sample_batch(logits, sb, index_column([0] * 4, "cpu"), token_bitmask=bits)) == [
        max(ids, key=lambda t: float(logits[r, t])) for r, ids in enumerate(sets)]


def test_min_p_and_the_other_filters_see_the_processed_logits():
    """min_p keeps what is at least min_p times as likely as the most likely token after the processors: a bias
    that takes the top token out moves the floor with it (floor 2 + ln 0.3 = 0.80: tokens 1 and 2 stay)."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    p = SP(temperature=1.0, min_p=0.3, logit_bias={0: -100.0})
    sb = _batch([p], 4)
    x = smp.process_logits(logits, sb, index_column([0], "cpu"))
    assert smp.filtered_logits(x, sb.blocks[0]).isfinite()[0].tolist() == [False, True, True, False]
    assert set(_ids(sample(logits.expand(300, -1), [p] * 300, list(range(300)), [0] * 300))) == {1, 2}
    top1 = SP(temperature=1.0, top_k=1, logit_bias={0: -100.0})
    assert _ids(sample(logits, [top1], [0], [0])) == [1]


def test_range_errors_name_the_parameter():
    bad = [({"logit_bias": {5: 100.5}}, "logit_bias"), ({"logit_bias": {5: float("nan")}}, "logit_bias"),
           ({"logit_bias": {"5": 1.0}}, "logit_bias"), ({"presence_penalty": 2.5}, "presence_penalty"),
           ({"frequency_penalty": -2.01}, "frequency_penalty"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
           ({"repetition_penalty": float("inf")}, "repetition_penalty"), ({"min_tokens": 17}, "min_tokens"),
           ({"min_tokens": -1}, "min_tokens"), ({"bad_words_token_ids": ((),)}, "bad_words"),
           ({"bad_words_token_ids": (tuple(range(40)),)}, "bad_words"), ({"bad_words_token_ids": ((1, True),)}, "bad_words"),
           ({"allowed_token_ids": ()}, "allowed_token_ids"), ({"stop_token_ids": (1.5,)}, "stop_token_ids"),
           ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"), ({"top_p": 0.0}, "top_p"),
           ({"top_k": -1}, "top_k"), ({"min_p": 2.0}, "min_p"), ({"logprobs": 21}, "logprobs"), ({"max_tokens": 0}, "max_tokens")]
    for kwargs, param in bad:
        with pytest.raises(InvalidRequestError) as e:
            SP(**kwargs)
        assert e.value.param == param and e.value.status == 400 and param in str(e.value), kwargs
        assert isinstance(e.value, ValueError)
    assert SP(logit_bias={9: -100, 3: 100}).logit_bias == ((3, 100.0), (9, -100.0))  # a mapping, kept as sorted pairs
    for kwargs, param in [({"logit_bias": {4096: 1.0}}, "logit_bias"), ({"stop_token_ids": (5000,)}, "stop_token_ids"),
                          ({"bad_words_token_ids": ((1, 4096),)}, "bad_words"), ({"allowed_token_ids": (-1, 3)}, "allowed_token_ids")]:
        with pytest.raises(InvalidRequestError) as e:
            Request("r", (1, 2, 3), SP(**kwargs), 0).check(4096, 1000)
        assert e.value.param == param and "outside the vocabulary" in str(e.value)
    Request("r", (1, 2, 3), SP(logit_bias={4095: 1.0}, allowed_token_ids=(0, 4095)), 0).check(4096, 1000)


def test_greedy_rows_with_any_control_leave_the_plain_path():
    for p in (SP(logit_bias={1: 1.0}), SP(presence_penalty=0.1), SP(frequency_penalty=-0.1), SP(repetition_penalty=1.1),
              SP(min_tokens=1), SP(bad_words_token_ids=((4,),)), SP(allowed_token_ids=(1,)), SP(logprobs=0)):
        assert not p.plain
        run = _Running(DecodeRequest.fresh("r", _Layout(), SampledToken(2), p, 0, prompt_token_ids=tuple(range(10))), 2, 1)
        assert not _Group(["r"], [run], (1,)).plain
    assert SP().plain and SP(seed=3, ignore_eos=True, stop_token_ids=(4,)).plain


class _Layout:
    num_tokens = 10


def test_the_chosen_tokens_logprob_is_reported_even_outside_the_top():
    """The contract `SampledToken` states: `logprob` is the chosen token's, of the raw distribution, however it
    was chosen; `top_logprobs` the most likely raw tokens."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 40, generator=g)
    lp = torch.log_softmax(logits, -1)
    low = int(logits[0].argmin())
    params = [SP(temperature=0.7, logit_bias={low: 100.0}, logprobs=2), SP(allowed_token_ids=(low, 7), logprobs=3)]
    out = sample(logits, params, [1, 2], [0, 0])
    assert out[0].token_id == low and out[0].logprob == pytest.approx(float(lp[0, low]), abs=1e-6)
    assert [i for i, _ in out[0].top_logprobs] == lp[0].topk(2).indices.tolist() and low not in dict(out[0].top_logprobs)
    want = max((low, 7), key=lambda t: float(logits[1, t]))
    assert out[1].token_id == want and out[1].logprob == pytest.approx(float(lp[1, want]), abs=1e-6)
    assert [i for i, _ in out[1].top_logprobs] == lp[1].topk(3).indices.tolist()


# --- batches, seeds, capture ---------------------------------------------------------------------------------------


def _mixed(vocab):
    """Rows with and without controls, greedy and sampled, with (prompt, generated) tokens so far."""
    params = [SP(), SP(temperature=0.9, top_p=0.9),
              SP(temperature=1.0, logit_bias={3: 4.0, 11: -2.0}, presence_penalty=1.5, frequency_penalty=0.5, min_tokens=4,
                 stop_token_ids=(7,), max_tokens=30),
              SP(repetition_penalty=1.7, bad_words_token_ids=((2,), (13, 14), (5, 6, 8))),
              SP(temperature=0.8, top_k=9, allowed_token_ids=tuple(range(0, vocab, 3)), frequency_penalty=1.0, logprobs=2),
              SP(temperature=1.1, min_p=0.05, repetition_penalty=0.8, bad_words_token_ids=((9, 9),))]
    seen = [None, None, ((4, 5), (3, 3, 11)), ((13, 20, 21), (13,)), ((), (0, 3)), ((9, 1), ())]
    return params, seen


def _run_rows(logits_by_step, params, seen, seeds, rows, block_rows=None):
    """Steps over the rows `rows` of a mixed batch, its histories advancing: each step's tokens and processed logits."""
    vocab = logits_by_step[0].shape[-1]
    sb = _batch([params[i] for i in rows], vocab, [seen[i] for i in rows], (1,), [seeds[i] for i in rows], block_rows=block_rows)
    index = index_column([len(seen[i][1]) if seen[i] else 0 for i in rows], "cpu")
    out = []
    for logits in logits_by_step:
        x = smp.process_logits(logits[rows], sb, index)
        out.append((sample_batch(logits[rows], sb, index), x))
        index += 1
    return out


def test_a_row_with_controls_draws_the_same_alone_and_in_any_batch():
    """Over 8 steps with the token histories advancing, each row's tokens and processed logits are the same
    alone as in the mixed batch, in one block and in CPU-style blocks of one row."""
    g = torch.Generator().manual_seed(5)
    vocab = 40
    params, seen = _mixed(vocab)
    seeds = [21, 22, 23, 24, 25, 26]
    steps = [torch.randn(len(params), vocab, generator=g) * 2 for _ in range(8)]
    rows = list(range(len(params)))
    for block_rows in (None, 1):
        together = _run_rows(steps, params, seen, seeds, rows, block_rows)
        for i in rows:
            alone = _run_rows(steps, params, seen, seeds, [i])
            for (tok_all, x_all), (tok_one, x_one) in zip(together, alone):
                assert tok_all[i] == tok_one[0]
                assert torch.equal(x_all[i], x_one[0])


def test_seeded_controls_are_reproducible():
    g = torch.Generator().manual_seed(6)
    vocab = 40
    params, seen = _mixed(vocab)
    steps = [torch.randn(len(params), vocab, generator=g) for _ in range(10)]
    rows = list(range(len(params)))
    a = [_ids(t) for t, _ in _run_rows(steps, params, seen, [1, 2, 3, 4, 5, 6], rows)]
    b = [_ids(t) for t, _ in _run_rows(steps, params, seen, [1, 2, 3, 4, 5, 6], rows)]
    c = [_ids(t) for t, _ in _run_rows(steps, params, seen, [7, 8, 9, 10, 11, 12], rows)]
    assert a == b
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    assert sum(a[s][i] != c[s][i] for s in range(10) for i in sampled) > 10


def test_the_history_rebuilt_from_tokens_is_the_history_recorded_step_by_step():
    """A retry or the PD split rebuilds a request's row from its tokens (`load`); a running request's row is
    updated by the steps (`record`). Both give the same counts, prompt marks and recent tokens, past the ring."""
    vocab = 50
    g = torch.Generator().manual_seed(7)
    generated = torch.randint(0, vocab, (45,), generator=g).tolist()
    prompt = (3, 4, 4, 49)
    p = SP(presence_penalty=1.0, frequency_penalty=0.3, bad_words_token_ids=((1, 2),))
    stepped = smp.TokenHistory(2, vocab, "cpu")
    other = stepped.take(p, (7,), (8, 8))  # a row the steps must leave alone
    slot = stepped.take(p, prompt, generated[:1])
    sb = SamplingBatch.build([p], [0], "cpu", vocab, history=stepped, slots=[slot])
    for t in generated[1:]:
        sb.processors.record(torch.tensor([t]))
    loaded = smp.TokenHistory(1, vocab, "cpu")
    loaded.take(p, prompt, generated)
    for name in ("counts", "penalty", "seen", "recent"):
        assert torch.equal(getattr(stepped, name)[slot], getattr(loaded, name)[0]), name
    assert stepped.counts[other].tolist() == [0] * 8 + [2] + [0] * 41 and stepped.recent[other].tolist()[-3:] == [-1, 8, 8]
    assert loaded.recent[0].tolist() == generated[-smp.TokenHistory.RING :]
    counts = torch.bincount(torch.tensor(generated), minlength=vocab)
    assert loaded.counts[0].tolist() == counts.tolist()
    assert loaded.seen[0].tolist() == [c > 0 or t in prompt for t, c in enumerate(counts.tolist())]
    assert loaded.penalty[0].tolist() == pytest.approx([-(0.3 * c + (c > 0)) for c in counts.tolist()], abs=1e-6)


def _capture_params(vocab):
    params, seen = _mixed(vocab)
    return params, seen, list(range(100, 100 + len(params)))


@pytest.mark.parametrize("block_rows", [None, 2])
def test_the_step_with_every_control_traces_as_one_graph(block_rows):
    """`torch.compile(fullgraph=True)` over `sample_step` (processors, a token bitmask, the draw and the history
    update) against the eager step on a twin batch: the same tokens and the same histories, step after step."""
    torch._dynamo.reset()
    vocab = 70
    params, seen, seeds = _capture_params(vocab)
    g = torch.Generator().manual_seed(8)
    twins = [_batch(params, vocab, seen, (1,), seeds, block_rows=block_rows) for _ in range(2)]
    bits = smp.pack_token_bitmask([range(0, vocab, 2)] + [range(vocab)] * (len(params) - 1), vocab, "cpu")
    step = torch.compile(smp.sample_step, fullgraph=True, backend="eager")
    index = [index_column([2] * len(params), "cpu") for _ in range(2)]
    for _ in range(4):
        logits = torch.randn(len(params), vocab, generator=g)
        assert torch.equal(step(logits, twins[0], index[0], bits), smp.sample_step(logits, twins[1], index[1], bits))
        for i in index:
            i += 1
    h0, h1 = (t.processors.history for t in twins)
    for name in ("counts", "penalty", "seen", "recent"):
        assert torch.equal(getattr(h0, name), getattr(h1, name)), name
    assert int(h0.counts.sum()) == 4 * 4 + sum(len(s[1]) for s in seen if s)  # four looking-back rows, four steps


def test_the_step_with_every_control_holds_in_a_cuda_graph_on_fake_cuda():
    """`sample_step` on (fake) CUDA under the capture guard: processors, the token bitmask, the history update;
    the batch and the history built before the region, as the decode worker builds them per group and per
    admission."""
    from kernels.capture_guard import capture_guard, fake_cuda

    vocab = 70
    params, seen, seeds = _capture_params(vocab)
    with fake_cuda():
        logits = torch.randn(len(params), vocab, device="cuda")
        for block_rows in (None, 2):
            sb = _batch(params, vocab, seen, (1,), seeds, device="cuda", block_rows=block_rows)
            bits = smp.pack_token_bitmask([range(vocab)] * len(params), vocab, "cuda")
            index = index_column([3] * len(params), "cuda")
            with capture_guard("cuda"):
                tokens = smp.sample_step(logits, sb, index, bits)
                index += 1
            assert tokens.shape == (len(params),) and tokens.device.type == "cuda"


# --- the workers ---------------------------------------------------------------------------------------------------

EOS = 1


class _Table(StubModel):
    """A stand-in whose logits depend only on the row's last token: a few strong candidates per token (and the
    end-of-sequence id among them), so penalties, bans and min_tokens change the stream."""

    def __init__(self, model, stub):
        super().__init__(model, stub)
        g = torch.Generator().manual_seed(9)
        self.table = torch.full((64, self.cfg.vocab_size), -8.0)
        self.table.scatter_(1, torch.randint(10, 40, (64, 8), generator=g), torch.rand(64, 8, generator=g) * 3)
        self.table[:, EOS] = 0.5
        self.prefill_row = torch.randn(1, self.cfg.vocab_size, generator=g) * 2

    def after(self, token: int) -> torch.Tensor:
        return self.table[token % 64][None]

    def decode_step(self, store, token_ids):
        store.advance()
        return self.table[torch.as_tensor(list(token_ids)) % 64]

    def prefill_batch(self, items, last_only=False, full_logits=None, **kw):
        _, layouts = super().prefill_batch(items, last_only, full_logits, **kw)
        return [self.prefill_row] * len(items), layouts


def _stream(model, prompt, first, sp, seed):
    """A request's whole stream sampled one token at a time from the tokens so far (`sample` rebuilds what it
    has seen each time): what a decode worker must give, whatever batches, regroups and retries it goes through."""
    gen = [first]
    while finish_reason(gen[-1], len(gen), sp, (EOS,)) is None:
        gen += _ids(sample(model.after(gen[-1]), [sp], [seed], [len(gen)], (EOS,), [(prompt, gen)]))
    return gen


def test_decode_honours_every_control_across_regroups_and_retries(tiny_model):
    """Requests with penalties, bans, min_tokens, biases and masks join and leave a running batch (its groups are
    rebuilt), one is solo and two are retries re-prefilled with generated tokens: each stream is its stream
    sampled alone from its tokens so far; the histories are given back when they leave."""
    model = _Table(tiny_model, StubConfig(decode_step_s=0.0))
    worker = DecodeWorker(model, TieredStore(tiny_model.cfg, TIER), eos_ids=(EOS,), step_config=EAGER)
    layout = tiny_model.prefill(list(range(6, 30)), last_only=True)[1]
    prompt = (12, 15, 20, 33, 37, 12)
    plain_greedy = _stream(model, prompt, 20, SP(max_tokens=12, ignore_eos=True), 0)
    word = (plain_greedy[2], plain_greedy[3])
    specs = {  # id: (params, seed, first token, tokens already generated by an earlier try, joins at step, solo)
        "freq": (SP(max_tokens=14, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5), 1, 20, 1, 0, False),
        "words": (SP(max_tokens=12, ignore_eos=True, bad_words_token_ids=(word, (plain_greedy[6],))), 2, 20, 1, 1, False),
        "rep": (SP(max_tokens=12, ignore_eos=True, temperature=0.9, repetition_penalty=1.8), 3, 15, 1, 2, False),
        "min": (SP(max_tokens=10, min_tokens=5, logit_bias={EOS: 6.0}), 4, 22, 1, 0, False),
        "plain": (SP(max_tokens=6, ignore_eos=True), 5, 30, 1, 0, False),
        "retry": (SP(max_tokens=16, temperature=1.0, presence_penalty=1.2, repetition_penalty=1.3,
                     bad_words_token_ids=((25, 26),), ignore_eos=True), 6, 18, 6, 3, False),
        "retry_min": (SP(max_tokens=12, min_tokens=8, logit_bias={EOS: 6.0}, frequency_penalty=0.7), 7, 31, 4, 2, False),
        "solo": (SP(max_tokens=9, temperature=1.0, allowed_token_ids=tuple(range(10, 25)) + (EOS,), presence_penalty=2.0,
                    min_tokens=3), 8, 11, 1, 1, True),
    }
    want, requests = {}, {}
    for rid, (sp, seed, first, n_gen, _, solo) in specs.items():
        full = _stream(model, prompt, first, sp, seed)
        want[rid] = full[n_gen:]
        generated = tuple(full[:n_gen]) if n_gen > 1 else ()
        requests[rid] = DecodeRequest.fresh(rid, layout.clone(), SampledToken(full[n_gen - 1]), sp, seed, n_gen,
                                            prompt_token_ids=prompt, generated=generated, solo=solo)
    seen: dict[str, list[int]] = {}
    step = 0
    while step < 5 or worker.has_work():
        for rid, spec in specs.items():
            if spec[4] == step:
                worker.submit(requests[rid])
        for ev in worker.step():
            seen.setdefault(ev.request_id, []).append(ev.token.token_id)
        step += 1
    assert seen == want
    assert worker.history is not None and worker.history.taken == 0
    words = plain_greedy[1:][: len(seen["words"])]
    assert seen["words"] != words and plain_greedy[6] not in seen["words"]
    assert all(seen["words"][i : i + 2] != list(word) for i in range(len(seen["words"])))
    assert seen["min"][-1] == EOS and EOS not in seen["min"][:-1] and len(seen["min"]) == 5  # indices 1..5: EOS first at 5
    assert seen["retry_min"][-1] == EOS and EOS not in seen["retry_min"][:-1] and len(seen["retry_min"]) == 5  # 4..8
    assert set(seen["solo"]) <= set(range(10, 25)) | {EOS}


def test_the_pd_split_keeps_the_prompt_only_when_sampling_reads_it(tiny_model):
    """`Attempt.stripped` (what a prefill actor sends a decode actor) drops the prompt's tokens unless a
    repetition penalty counts them; a decode request built from it as the decode actor builds one decodes what
    the request decodes in one process. A request that looks back cannot arrive without what it looks at."""
    model = _Table(tiny_model, StubConfig(decode_step_s=0.0))
    layout = tiny_model.prefill(list(range(6, 30)), last_only=True)[1]
    prompt = tuple(range(10, 40, 2))
    rep = SP(max_tokens=10, ignore_eos=True, repetition_penalty=2.0, presence_penalty=0.5)
    assert Attempt.of(Request("a", prompt, rep, 3)).stripped().prompt_token_ids == prompt
    assert Attempt.of(Request("b", prompt, SP(presence_penalty=1.0), 3)).stripped().prompt_token_ids == ()
    assert Attempt.of(Request("c", prompt, SP(), 3)).stripped().request.prompt_len == len(prompt)
    full = _stream(model, prompt, 22, rep, 3)
    worker = DecodeWorker(model, TieredStore(tiny_model.cfg, TIER), eos_ids=(EOS,), step_config=EAGER)
    attempt = Attempt.of(Request("a", prompt, rep, 3)).stripped()
    worker.submit(DecodeRequest(attempt, SampledToken(22), 1, layout=layout.clone()))
    got = []
    while worker.has_work():
        got += [ev.token.token_id for ev in worker.step()]
    assert got == full[1:]
    assert full[1:] != _stream(model, (), 22, rep, 3)[1:]  # the prompt changed what was drawn
    lost = Attempt(replace_prompt(Request("a", prompt, rep, 3)), "a")
    with pytest.raises(ValueError, match="prompt"):
        DecodeRequest(lost, SampledToken(22), 1, layout=layout.clone())
    with pytest.raises(ValueError, match="generated"):
        DecodeRequest(Attempt.of(Request("b", prompt, SP(presence_penalty=1.0), 3)), SampledToken(22), 3, layout=layout.clone())


def replace_prompt(request: Request) -> Request:
    from dataclasses import replace

    return replace(request, prompt_token_ids=())


def test_the_prefill_side_samples_the_first_token_with_the_same_processors(tiny_model):
    """Prefill's first token: a bias moves the greedy token, a repetition penalty sees the prompt, min_tokens
    counts this token as the first generated (EOS held back at min_tokens 1, drawn and ending the request
    without it), and a sampled row's controls equal `sample` with the prompt as what it has seen."""
    model = _Table(tiny_model, StubConfig(prefill_s=0.0, decode_step_s=0.0))
    row = model.prefill_row
    top = int(row.argmax())
    prompt = (top, 40, 41, 42)
    rep = SP(max_tokens=4, repetition_penalty=3.0)
    hot = SP(max_tokens=4, temperature=0.8, presence_penalty=2.0, repetition_penalty=1.5, min_tokens=2,
             logit_bias={EOS: 100.0}, bad_words_token_ids=((top,), (40, 41)))
    params = {"plain": SP(max_tokens=4), "bias": SP(max_tokens=4, logit_bias={top: -100.0}), "rep": rep,
              "eos": SP(max_tokens=4, logit_bias={EOS: 100.0}), "min": SP(max_tokens=4, min_tokens=1, logit_bias={EOS: 100.0}),
              "hot": hot}
    worker = PrefillWorker(model, PrefillConfig(), eos_ids=(EOS,))
    for rid, sp in params.items():
        worker.submit(Attempt.of(Request(rid, prompt, sp, 11)))
    done = {}
    while worker.has_work():
        done.update((r.key, r) for r in worker.step())
    first = {rid: r.first_token.token_id for rid, r in done.items()}
    assert first["plain"] == top and first["bias"] == int(row[0].topk(2).indices[1])
    penalised = row.clone()
    penalised[0, list(prompt)] = torch.where(row[0, list(prompt)] > 0, row[0, list(prompt)] / 3.0, row[0, list(prompt)] * 3.0)
    assert first["rep"] == int(penalised.argmax()) != top
    assert first["eos"] == EOS and done["eos"].finish_reason == "stop"
    assert first["min"] != EOS and done["min"].finish_reason is None
    assert first["hot"] == sample(row, [hot], [11], [0], (EOS,), [(prompt, ())])[0].token_id
    assert first["hot"] not in (EOS, top)
