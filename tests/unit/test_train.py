"""The training entry point runs and learns (a few steps on one batch); nothing is trained for real here."""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F

from model.builtin import random_init, tiny_config
from model.loader import build_empty
from model.train import TrainConfig, stdlib_files, train, train_forward


def test_stdlib_split_is_deterministic_and_disjoint():
    a_train, a_held = stdlib_files()
    b_train, b_held = stdlib_files()
    assert a_train == b_train and a_held == b_held
    assert a_held and len(a_train) > 10 * len(a_held)
    assert not set(a_train) & set(a_held)


def test_training_forward_matches_inference_prefill(tiny_model):
    """Sparse training attention is the inference math: same logits as prefill."""
    ids = torch.randint(6, tiny_model.cfg.vocab_size, (1, 150), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, kl = train_forward(tiny_model, ids, sparse=True)
    ref, _ = tiny_model.prefill(ids[0])
    assert (logits[0] - ref).abs().max().item() < 1e-4
    assert torch.isfinite(kl) and kl.item() > 1e-6  # the trained indexer is not the attention's distribution exactly


def test_loss_goes_down_in_a_few_steps():
    cfg = replace(tiny_config(), vocab_size=300)
    model = build_empty(cfg)
    random_init(model, 1)
    stream = torch.arange(4000) % 97 + 6  # a periodic stream: learnable in a handful of steps
    tc = TrainConfig(steps=12, batch=2, seq_len=64, lr=3e-3, warmup=2, dense_fraction=0.5, log_every=4, threads=1)
    with torch.no_grad():
        x = stream[:65]
        before = F.cross_entropy(train_forward(model, x[None, :-1], sparse=True)[0][0], x[1:]).item()
    history = train(model, stream, tc, progress=False)
    with torch.no_grad():
        after = F.cross_entropy(train_forward(model, x[None, :-1], sparse=True)[0][0], x[1:]).item()
    assert [h["phase"] for h in history] == ["dense", "sparse", "sparse"]
    assert history[-1]["lm_loss"] < history[0]["lm_loss"]
    assert after < before
    assert all(math.isfinite(h["indexer_kl"]) and h["indexer_kl"] > 0 for h in history)  # a random indexer disagrees
