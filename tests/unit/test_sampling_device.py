"""Batched sampling on the logits' device: draws follow the filtered softmax, a row's token depends only on
(its logits, params, seed, index) whatever batch it is in, and the device step traces as one graph."""

from __future__ import annotations

import pytest
import torch

from cachetier.store import TieredStore
from core.configs import StubConfig, TierConfig
from core.types import SampledToken, SamplingParams
from decode.worker import DecodeRequest, DecodeWorker
from model.sampling import (
    SamplingBatch,
    filtered_logits,
    index_column,
    mix32,
    noise_bits,
    row_keys,
    sample,
    sample_batch,
    sample_tokens,
    seed_words,
    vocab_mix,
)
from model.stub import StubModel

# Twelve distinct logits; each setting's filter cuts well away from its threshold (margins noted), so float32
# rounding cannot move a token across it.
LOGITS = torch.tensor([2.0, 1.6, 1.3, 1.1, 0.6, 0.4, 0.1, -0.3, -0.8, -1.2, -1.9, -2.6])
SETTINGS = {
    "temperature": SamplingParams(temperature=0.7),
    "top_k": SamplingParams(temperature=1.0, top_k=4),
    "top_p": SamplingParams(temperature=1.2, top_p=0.8),  # mass before the 6th/7th token: 0.784 / 0.852
    "min_p": SamplingParams(temperature=1.0, min_p=0.17),  # 6th/7th token at 0.202 / 0.150 of the largest
    # top-k cuts from the 8th token, top-p the 7th (mass before it 0.959), min-p the 6th (0.169 of the largest)
    "mix": SamplingParams(temperature=0.9, top_k=7, top_p=0.95, min_p=0.19),
}
DRAWS = 20_000


def reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The exact filtered distribution [vocab] float64, written out token by token."""
    x = logits.double() / p.temperature
    probs = torch.softmax(x, -1)
    keep = torch.ones(len(x), dtype=torch.bool)
    order = torch.argsort(x, descending=True).tolist()
    if 0 < p.top_k < len(x):
        keep &= x >= x[order[p.top_k - 1]]
    q = torch.where(keep, probs, 0.0)
    q = q / q.sum()
    if p.top_p < 1.0:
        before = 0.0
        for i in order:
            if keep[i]:
                if before >= p.top_p:
                    keep[i] = False
                else:
                    before += float(q[i])
    if p.min_p > 0:
        keep &= probs >= p.min_p * probs.max()
    out = torch.where(keep, probs, 0.0)
    return out / out.sum()


def _block(params: list[SamplingParams], vocab: int):
    """The one block of a batch whose rows all sample (what `filtered_logits` takes)."""
    sb = SamplingBatch.build(params, [0] * len(params), "cpu", vocab, block_rows=len(params))
    assert sb.num_sampled == len(params) and len(sb.blocks) == 1
    return sb.blocks[0]


def _draws(logits: torch.Tensor, p: SamplingParams, n: int) -> torch.Tensor:
    """n draws of one row: half over successive indices of one seed, half over seeds at one index."""
    half = n // 2
    seeds = [1234] * half + [10_000 + i for i in range(n - half)]
    indices = list(range(half)) + [3] * (n - half)
    sb = SamplingBatch.build([p] * n, seeds, "cpu", logits.shape[-1])
    return sample_tokens(logits.expand(n, -1), sb, index_column(indices, "cpu"))


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_draws_follow_the_filtered_softmax(name):
    """Chi-square and total variation of 20,000 draws against the exact filtered softmax (deterministic: fixed
    seeds). Dropped tokens are never drawn. The bounds sit about 4-6 standard deviations above what a correct
    sampler gives here; a wrong temperature, an off-by-one in top-p or a biased noise is far outside them."""
    p = SETTINGS[name]
    want = reference(LOGITS, p)
    counts = torch.bincount(_draws(LOGITS[None], p, DRAWS), minlength=len(LOGITS)).double()
    assert counts[want == 0].sum() == 0, f"{name}: drew a token the filters drop"
    kept = want > 0
    expected = want[kept] * DRAWS
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    df = int(kept.sum()) - 1
    assert chi2 < df + 6 * (2 * df) ** 0.5, f"{name}: chi-square {chi2:.1f} with {df} degrees of freedom"
    tv = 0.5 * float((counts / DRAWS - want).abs().sum())
    assert tv < 0.015, f"{name}: total variation {tv:.4f}"


def test_a_row_draws_the_same_alone_and_in_any_batch():
    """Each row's token, over 12 indices, alone and inside a batch of rows with other params: greedy rows, rows
    with logprobs, a top-p row without top-k (the batch sorts) beside top-k + top-p rows (alone they rank only
    their top-k candidates), min-p; in one block and in CPU-style blocks of one and two rows. The filtered
    logits agree exactly, not just the tokens."""
    g = torch.Generator().manual_seed(5)
    vocab = 3000
    logits = torch.randn(7, vocab, generator=g) * 2.5
    params = [SamplingParams(temperature=0.9, top_k=40, top_p=0.9), SamplingParams(),
              SamplingParams(temperature=1.1, top_p=0.7), SamplingParams(temperature=0.8, min_p=0.1, logprobs=2),
              SamplingParams(temperature=1.0, top_k=5), SamplingParams(logprobs=1),
              SamplingParams(temperature=0.6, top_k=100, top_p=0.95, min_p=0.02)]
    seeds = [11, 12, 13, 14, 15, 16, 17]
    blocked = [SamplingBatch.build(params, seeds, "cpu", vocab, block_rows=b) for b in (1, 2)]  # CPU-style blocks
    assert [len(b.blocks) for b in blocked] == [5, 3]
    for index in range(12):
        together = sample(logits, params, seeds, [index] * 7)
        alone = [sample(logits[i : i + 1], [params[i]], [seeds[i]], [index])[0] for i in range(7)]
        assert together == alone
        for b in blocked:
            assert sample_batch(logits, b, index_column([index] * 7, "cpu")) == alone
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    batch = _block([params[i] for i in sampled], vocab)
    assert batch.top_p_sorts  # the batch takes the full sort; each top-k + top-p row alone does not
    together = filtered_logits(logits[sampled], batch)
    for j, i in enumerate(sampled):
        one = _block([params[i]], vocab)
        assert torch.equal(filtered_logits(logits[i : i + 1], one)[0], together[j])


def test_ties_at_the_top_k_value_stay_together_on_both_paths():
    """Coarse logits tie at every top-k boundary. Tokens tied with the k-th value all stay, and top-p after top-k
    keeps the same set whether it ranks the whole vocabulary or only the top-k candidates."""
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(4, 400, generator=g) * 2).round() / 2  # [4, 400] about 25 distinct values per row
    p = SamplingParams(temperature=1.0, top_k=30, top_p=0.6)
    ranked_alone = _block([p] * 4, 400)
    with_sort = _block([p] * 4 + [SamplingParams(temperature=1.0, top_p=0.5)], 400)
    assert not ranked_alone.top_p_sorts and with_sort.top_p_sorts
    a = filtered_logits(x, ranked_alone)
    b = filtered_logits(torch.cat((x, x[:1])), with_sort)[:4]
    assert torch.equal(a, b)
    kth = x.topk(30, dim=-1).values[:, -1:]
    assert ((x >= kth).sum(-1) > 30).all()  # the ties reach past the 30th position
    # the rule in float64, token by token: among the top-k tokens (ties included, renormalised), keep a token
    # iff the mass of the tokens strictly more likely than it is below top_p
    q = torch.softmax(x.double().masked_fill(x < kth, float("-inf")), -1)  # [4, 400]
    above = torch.stack([(q * (x > x[:, t : t + 1])).sum(-1) for t in range(400)], -1)
    assert torch.equal(torch.isfinite(a), (x >= kth) & (above < 0.6))
    only_k = filtered_logits(x, _block([SamplingParams(temperature=1.0, top_k=30)] * 4, 400))
    assert torch.equal(torch.isfinite(only_k), x >= kth)


def test_top_p_keeps_equal_probabilities_together():
    """Four tokens of 0.2 and two of 0.1: with top_p 0.3 the mass strictly above a 0.2 token is 0, so all four
    stay (no sort order decides between equals); 0.1 tokens have 0.8 before them and go."""
    x = torch.log(torch.tensor([[0.1, 0.2, 0.2, 0.1, 0.2, 0.2]]))
    got = filtered_logits(x, _block([SamplingParams(temperature=1.0, top_p=0.3)], 6))
    assert torch.isfinite(got).tolist() == [[False, True, True, False, True, True]]


def test_top_p_weighs_the_whole_row():
    """0.6, 0.3, 0.1: top_p 0.62 keeps two (0.6 before the second), 0.58 keeps one. The normaliser counts every
    token, the smallest included, on both paths: the whole row sorted, and the top-3 candidates of a row with
    a fourth token of no weight."""
    three = torch.log(torch.tensor([[0.1, 0.6, 0.3]]))
    four = torch.log(torch.tensor([[0.1, 0.6, 0.3, 1e-30]]))
    for top_p, keep in ((0.62, [False, True, True]), (0.58, [False, True, False])):
        got = filtered_logits(three, _block([SamplingParams(temperature=1.0, top_p=top_p)], 3))
        assert torch.isfinite(got)[0].tolist() == keep
        got = filtered_logits(four, _block([SamplingParams(temperature=1.0, top_p=top_p, top_k=3)], 4))
        assert torch.isfinite(got)[0].tolist() == keep + [False]


def test_min_p_drops_what_is_below_its_share_of_the_largest():
    probs = torch.tensor([0.40, 0.25, 0.12, 0.09, 0.08, 0.04, 0.02])
    x = torch.log(probs)[None]
    for min_p, keep in ((0.25, 3), (0.5, 2), (0.04, 7), (0.0, 7)):  # floors 0.1, 0.2, 0.016, none
        got = torch.isfinite(filtered_logits(x, _block([SamplingParams(temperature=1.0, min_p=min_p)], 7)))[0]
        assert got.tolist() == [i < keep for i in range(7)], min_p
    hot = _block([SamplingParams(temperature=2.0, min_p=0.5)], 7)  # min-p sees the tempered distribution
    tempered = torch.softmax(x / 2.0, -1)[0]
    assert torch.isfinite(filtered_logits(x, hot))[0].tolist() == (tempered >= 0.5 * tempered.max()).tolist()
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(6, 80, generator=g)
    one = [SamplingParams(temperature=0.8, min_p=1.0)] * 6  # only the largest survives: the draw is the argmax
    assert [t.token_id for t in sample(rows, one, list(range(6)), [2] * 6)] == rows.argmax(-1).tolist()
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="min_p"):
            SamplingParams(temperature=1.0, min_p=bad)


def test_the_draw_is_a_pure_function_of_seed_index_and_vocab_id():
    """The noise bits are pinned (they are exact integers on every device: changing them changes every seeded
    stream), the same for a row alone or among others, and seeds count modulo 2**64."""
    keys = row_keys(seed_words([0, 42, 2**63 + 5], "cpu"), torch.tensor([0, 5, 1 << 40]))
    bits = noise_bits(keys, vocab_mix(4))
    assert bits.tolist() == PINNED_BITS
    assert ((bits >= 0) & (bits < 2**32)).all()
    alone = noise_bits(row_keys(seed_words([42], "cpu"), torch.tensor([5])), vocab_mix(4))
    assert torch.equal(alone[0], bits[1])
    assert torch.equal(row_keys(seed_words([-1], "cpu"), torch.tensor([3])), row_keys(seed_words([2**64 - 1], "cpu"), torch.tensor([3])))

    flat = torch.zeros(1, 1000)
    p = [SamplingParams(temperature=1.0)]
    a = [sample(flat, p, [42], [i])[0].token_id for i in range(50)]
    assert a == [sample(flat, p, [42], [i])[0].token_id for i in range(50)]
    assert len(set(a)) > 40  # different indices, different draws
    b = [sample(flat, p, [43], [i])[0].token_id for i in range(50)]
    assert sum(x == y for x, y in zip(a, b)) < 5
    # bits of one row are a permutation of distinct values: no two tokens share a draw
    row = noise_bits(row_keys(seed_words([7], "cpu"), torch.tensor([9])), vocab_mix(50_000))[0]
    assert row.unique().numel() == 50_000


PINNED_BITS = [[1640306300, 277614103, 3881292243, 4104005016], [1923697435, 2396444473, 1030048179, 1339160206],
               [506429873, 3389736316, 3960716761, 3665942689]]


def test_mix32_is_exact_32_bit_arithmetic():
    """The int64 tensor hash equals the same rounds on Python's unbounded integers taken mod 2**32, at the
    edges of the range too (no product wraps int64)."""
    def rounds(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) % 2**32
        x ^= x >> 15
        x = (x * 0x846CA68B) % 2**32
        return x ^ (x >> 16)

    g = torch.Generator().manual_seed(0)
    xs = torch.randint(0, 2**32, (2000,), generator=g).tolist() + [0, 1, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1]
    got = mix32(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert got == [rounds(x) for x in xs]


def test_logprobs_are_of_the_raw_distribution_in_a_mixed_batch():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 64, generator=g)
    params = [SamplingParams(temperature=0.9, top_k=2, logprobs=3), SamplingParams(logprobs=0),
              SamplingParams(temperature=1.0)]
    out = sample(logits, params, [1, 2, 3], [4, 4, 4])
    lp = torch.log_softmax(logits, -1)
    top3 = lp[0].topk(3)
    t0 = out[0]
    assert t0.token_id in logits[0].topk(2).indices.tolist()
    assert t0.logprob == pytest.approx(lp[0, t0.token_id].item(), abs=1e-6)  # not renormalised over the top 2
    assert [i for i, _ in t0.top_logprobs] == top3.indices.tolist()
    assert [v for _, v in t0.top_logprobs] == pytest.approx(top3.values.tolist(), abs=1e-6)
    assert out[1].token_id == logits[1].argmax().item() and out[1].top_logprobs == ()
    assert out[1].logprob == pytest.approx(lp[1].max().item(), abs=1e-6)
    assert out[2].logprob is None


def _capture_batch(vocab: int, full_sort: bool) -> tuple[list[SamplingParams], list[int]]:
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_k=20, top_p=0.9),
              SamplingParams(temperature=1.2, min_p=0.05), SamplingParams(temperature=0.7)]
    if full_sort:
        params.append(SamplingParams(temperature=1.0, top_p=0.8))
    return params, list(range(100, 100 + len(params)))


@pytest.mark.parametrize(("full_sort", "block_rows"), [(False, None), (True, None), (True, 2)])
def test_the_device_step_traces_as_one_graph(full_sort, block_rows):
    """`torch.compile(fullgraph=True)` raises on any graph break: a host read (.item(), .tolist(), bool of a
    tensor), a data-dependent shape (nonzero, masked_select) or untraceable Python inside the step. Greedy
    and sampled rows, top-k, both top-p paths, min-p, one block and several."""
    torch._dynamo.reset()
    vocab = 500
    params, seeds = _capture_batch(vocab, full_sort)
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(len(params), vocab, generator=g)
    sb = SamplingBatch.build(params, seeds, "cpu", vocab, block_rows=block_rows)
    assert len(sb.blocks) == (1 if block_rows is None else 2)
    index = index_column([3] * len(params), "cpu")
    step = torch.compile(sample_tokens, fullgraph=True, backend="eager")
    for _ in range(3):
        assert torch.equal(step(logits, sb, index), sample_tokens(logits, sb, index))
        index += 1
    greedy_only = SamplingBatch.build([SamplingParams()] * 3, [0] * 3, "cpu", vocab)
    assert torch.equal(step(logits[:3], greedy_only, index[:3]), logits[:3].argmax(-1))


def test_the_device_step_holds_in_a_cuda_graph_on_fake_cuda():
    """The step on (fake) CUDA tensors under the capture guard: no tensor from host data, no host tensor or
    copy, no device read, no value-sized allocation — the CUDA branch of the step, checked without a GPU. The
    parameter tensors are built before the region, as the decode worker builds them per group."""
    from kernels.capture_guard import capture_guard, fake_cuda

    vocab = 500
    params, seeds = _capture_batch(vocab, full_sort=True)
    params = params + [SamplingParams(temperature=0.9, top_k=7, top_p=0.5, logprobs=2)]
    with fake_cuda():
        logits = torch.randn(len(params), vocab, device="cuda")
        for block_rows in (None, 2):
            sb = SamplingBatch.build(params, seeds + [1], "cuda", vocab, block_rows=block_rows)
            index = index_column([3] * len(params), "cuda")
            with capture_guard("cuda"):
                tokens = sample_tokens(logits, sb, index)
                index += 1
            assert tokens.shape == (len(params),) and tokens.device.type == "cuda"


class _Table(StubModel):
    """A stand-in whose step gives each row logits that depend only on that row's last token (a fixed table):
    a request's stream can be worked out alone, whatever batch the worker decodes it in."""

    def __init__(self, model, stub):
        super().__init__(model, stub)
        self.table = torch.randn(self.cfg.vocab_size, self.cfg.vocab_size, generator=torch.Generator().manual_seed(4)) * 2

    def decode_step(self, store, token_ids):
        store.advance()
        return self.table[torch.as_tensor(list(token_ids))]


def test_decode_groups_sample_each_request_as_it_would_alone(tiny_model):
    """Seeded requests join and leave a running batch (so its groups and their device index columns are rebuilt),
    one re-prefilled with 4 tokens already generated and one solo: each stream equals sampling that request
    alone, token index by token index, from its own logits."""
    model = _Table(tiny_model, StubConfig(decode_step_s=0.0))
    store = TieredStore(tiny_model.cfg, TierConfig(offload=True, hot_buffer_slots=16, device_budget_bytes=4 * 2**20,
                                                   host_pool_bytes=16 * 2**20))
    worker = DecodeWorker(model, store)
    layout = tiny_model.prefill(list(range(6, 30)), last_only=True)[1]
    specs = [  # (id, first token, num_generated, params, seed, joins at step, solo)
        ("a", 50, 1, SamplingParams(max_tokens=14, ignore_eos=True, temperature=0.9, top_p=0.9), 1, 0, False),
        ("b", 60, 1, SamplingParams(max_tokens=9, ignore_eos=True), 2, 0, False),
        ("c", 70, 4, SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.1, top_k=20, min_p=0.02), 3, 3, False),
        ("d", 80, 1, SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.7, logprobs=1), 4, 5, False),
        ("e", 90, 1, SamplingParams(max_tokens=7, ignore_eos=True, temperature=1.0), 5, 2, True),
    ]
    want = {}
    for rid, first, n_gen, sp, seed, _, _ in specs:
        toks, last = [], first
        for index in range(n_gen, sp.max_tokens):
            last = sample(model.table[last][None], [sp], [seed], [index])[0].token_id
            toks.append(last)
        want[rid] = toks
    seen: dict[str, list[int]] = {}
    step = 0
    while step < 6 or worker.has_work():
        for rid, first, n_gen, sp, seed, join, solo in specs:
            if join == step:
                worker.submit(DecodeRequest.fresh(rid, layout.clone(), SampledToken(first), sp, seed, n_gen, solo=solo))
        for ev in worker.step():
            seen.setdefault(ev.request_id, []).append(ev.token.token_id)
        step += 1
    assert seen == want


def test_sample_batch_reuses_its_tensors_across_steps():
    """A kept SamplingBatch and an index column advanced in place give what `sample` gives with the indices
    as numbers."""
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(3, 200, generator=g)
    params = [SamplingParams(temperature=0.9, top_p=0.8), SamplingParams(), SamplingParams(temperature=1.3, top_k=9)]
    sb = SamplingBatch.build(params, [5, 6, 7], "cpu", 200)
    index = index_column([2, 7, 0], "cpu")
    for step in range(5):
        assert sample_batch(logits, sb, index) == sample(logits, params, [5, 6, 7], [2 + step, 7 + step, step])
        index += 1
