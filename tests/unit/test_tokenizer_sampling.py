"""Tokenizers (byte-level built-in, a trained tokenizer.json), streaming detokenization, sampling."""

from __future__ import annotations

import torch

from core.types import SamplingParams, finish_reason
from model.sampling import greedy_tokens, sample
from model.tokenizer import byte_level_tokenizer, load_tokenizer


def test_byte_tokenizer_round_trip_and_specials():
    tok = byte_level_tokenizer()
    text = "def f(x):\n    return 'héllo ✓'"
    ids = tok.encode(text)
    assert ids[0] == tok.token_id("<|bos|>") == 0
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.eos_token_ids == (1,)


def test_incremental_detokenizer_never_splits_a_character():
    tok = byte_level_tokenizer()
    text = "añb✓c🙂"
    ids = tok.encode(text, add_special_tokens=False)
    d = tok.detokenizer()
    pieces = [d.push(i) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[-4:] == ["", "", "", "🙂"]  # a 4-byte character is text only once its last byte came


def test_chat_template_renders_roles():
    tok = byte_level_tokenizer()
    prompt = tok.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert prompt == "<|system|>be brief\n<|user|>hi\n<|assistant|>"
    ids = tok.encode_chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert tok.token_id("<|assistant|>") == ids[-1] and ids[0] == tok.token_id("<|system|>")  # the template writes the specials
    assert tok._compiled_template() is tok._compiled_template()  # compiled once


def test_tokenizer_json_from_directory(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    inner = Tokenizer(models.BPE())
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"])
    inner.train_from_iterator(["hello world", "hello there", "world peace"] * 50, trainer)
    inner.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": true}')
    tok = load_tokenizer(tmp_path)
    ids = tok.encode("hello world")
    assert tok.token_id("<s>") not in ids  # no post-processor: no BOS, whatever tokenizer_config says (as transformers)
    assert tok.decode(ids) == "hello world"
    assert tok.eos_token_ids == (tok.token_id("</s>"),)
    assert load_tokenizer(tmp_path / "missing") is None


def test_greedy_and_degenerate_filters_agree():
    logits = torch.randn(4, 50)
    greedy = [t.token_id for t in sample(logits, [SamplingParams()] * 4, [0] * 4, [0] * 4)]
    assert greedy == logits.argmax(-1).tolist()
    top1 = [SamplingParams(temperature=1.3, top_k=1)] * 4
    assert [t.token_id for t in sample(logits, top1, [5] * 4, [0] * 4)] == greedy
    tiny_p = [SamplingParams(temperature=0.7, top_p=1e-6)] * 4
    assert [t.token_id for t in sample(logits, tiny_p, [9] * 4, [3] * 4)] == greedy


def test_greedy_tokens_are_torch_argmax():
    """The CPU fast path (NumPy's argmax) picks what torch's argmax picks: ties to the first index, NaN as the largest."""
    x = torch.randn(6, 300, generator=torch.Generator().manual_seed(3))
    x[1, 3] = x[1, 7] = 99.0
    x[2, 40] = x[2, 9] = float("nan")
    x[3] = 0.0
    x[4, -1] = float("inf")
    assert greedy_tokens(x) == x.argmax(-1).tolist() == greedy_tokens(x.double())
    assert greedy_tokens(x.bfloat16()) == x.bfloat16().argmax(-1).tolist()  # other dtypes go through torch
    row = x[1:2].expand(5, -1)  # one row seen five times (a stride-0 view): argmax'd once
    assert greedy_tokens(row) == row.argmax(-1).tolist() == [3] * 5


def test_seeded_sampling_is_reproducible_and_varies_with_index():
    logits = torch.zeros(1, 1000)
    p = [SamplingParams(temperature=1.0)]
    a = [sample(logits, p, [42], [i])[0].token_id for i in range(20)]
    b = [sample(logits, p, [42], [i])[0].token_id for i in range(20)]
    c = [sample(logits, p, [43], [i])[0].token_id for i in range(20)]
    assert a == b and a != c and len(set(a)) > 10


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    p = [SamplingParams(temperature=1.0)]
    counts = torch.bincount(torch.tensor([sample(logits, p, [1], [i])[0].token_id for i in range(3000)]), minlength=3)
    freq = counts.float() / 3000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.04)


def test_logprobs_and_finish_reasons():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    t = sample(logits, [SamplingParams(logprobs=2)], [0], [0])[0]
    lp = torch.log_softmax(logits[0], -1)
    assert t.token_id == 0 and abs(t.logprob - lp[0].item()) < 1e-6
    assert [i for i, _ in t.top_logprobs] == [0, 1]
    params = SamplingParams(max_tokens=3, stop_token_ids=(7,))
    assert finish_reason(5, 1, params, (1,)) is None
    assert finish_reason(1, 1, params, (1,)) == "stop"
    assert finish_reason(7, 2, params, (1,)) == "stop"
    assert finish_reason(5, 3, params, (1,)) == "length"
    assert finish_reason(1, 1, SamplingParams(ignore_eos=True), (1,)) is None
