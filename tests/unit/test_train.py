"""The training entry point runs and learns (a few steps on one batch); nothing is trained for real here."""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F

from model.builtin import random_init, tiny_config
from model.loader import build_empty
from model.train import TrainConfig, init_mtp, mtp_forward, mtp_loss, stdlib_files, train, train_forward, train_mtp


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


# --- the MTP head (`hisparse train --mtp`) ------------------------------------------------------------


def _mtp_model():
    model = build_empty(replace(tiny_config(), vocab_size=300))
    random_init(model, 1)
    init_mtp(model)
    return model


def test_init_mtp_starts_from_the_model_s_own_layers():
    model = _mtp_model()
    mtp, first, last = model.mtp, model.layers[0], model.layers[-1]  # layer 0 is the sliding-window one
    assert torch.equal(mtp.attn.wq_b.weight, first.attn.wq_b.weight) and torch.equal(mtp.attn_norm.weight, first.attn_norm.weight)
    assert torch.equal(mtp.ffn.experts.gate_up, last.ffn.experts.gate_up) and torch.equal(mtp.hc_ffn_fn, last.hc_ffn_fn)
    assert torch.equal(mtp.hc_head_fn, model.hc_head_fn) and torch.equal(mtp.norm.weight, model.norm.weight)
    assert torch.equal(mtp.e_proj.weight, torch.eye(model.cfg.hidden_size))


def test_the_mtp_training_forward_is_the_drafts_math():
    """The trainer's MTP logits (streams from the training forward) are the block's over prefill's streams."""
    model = _mtp_model()
    ids = torch.randint(6, 300, (1, 80), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = mtp_forward(model, ids)[0]
    with torch.inference_mode():
        _, _, hidden = model.prefill(ids[0], hidden_tail=80)
        want, _ = model.mtp.forward_sequence(model, hidden[None, :-1], ids[:, 1:])
    assert got.shape == (79, 300) and (got - want[0]).abs().max() < 1e-4


def test_mtp_loss_goes_down_with_the_main_model_frozen():
    model = _mtp_model()
    main = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("mtp.")}
    stream = torch.arange(4000) % 97 + 6
    tc = TrainConfig(steps=10, batch=2, seq_len=64, lr=3e-3, warmup=2, log_every=5, threads=1)
    x = stream[:65]
    with torch.no_grad():
        before = mtp_loss(model, x[None, :-1], x[None, 1:]).item()
    history = train_mtp(model, stream, tc, progress=False)
    with torch.no_grad():
        after = mtp_loss(model, x[None, :-1], x[None, 1:]).item()
    assert len(history) == 2 and history[-1]["mtp_loss"] < history[0]["mtp_loss"] and after < before
    assert all(torch.equal(v, main[k]) for k, v in model.state_dict().items() if not k.startswith("mtp."))


def test_the_train_command_takes_mtp_defaults_and_keeps_the_main_ones(monkeypatch, tmp_path):
    import model.train as train_mod
    from hisparse.cli import build_parser
    from hisparse.train_cmd import run

    seen = {}
    monkeypatch.setattr(train_mod, "run_mtp_training", lambda src, out, cfg, progress: seen.update(mtp=(src, out, cfg)) or {})
    monkeypatch.setattr(train_mod, "run_training", lambda out, cfg, vocab_size, progress: seen.update(main=cfg) or {})
    run(build_parser().parse_args(["train", "--mtp", "--out", str(tmp_path), "--steps", "3"]))
    run(build_parser().parse_args(["train", "--out", str(tmp_path)]))
    src, out, cfg = seen["mtp"]
    assert (src / "model.safetensors").is_file() and out == str(tmp_path)
    assert (cfg.steps, cfg.seq_len, cfg.lr, cfg.threads) == (3, train_mod.MTP_TRAIN.seq_len, train_mod.MTP_TRAIN.lr, 1)
    assert (seen["main"].steps, seen["main"].seq_len, seen["main"].lr, seen["main"].threads) == (3000, 512, 3e-3, 2)
