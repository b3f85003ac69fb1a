"""`hisparse train`: train the built-in model on the standard library's sources (see `model.train`)."""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("train", help="train the built-in model on this Python's standard library (CPU, ~1 h)")
    p.add_argument("--out", required=True, help="model directory to write (config, weights, tokenizer, training.json)")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dense-fraction", type=float, default=0.6, help="share of steps with dense CSA attention (indexer warm-up)")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    from model.train import TrainConfig, run_training

    cfg = TrainConfig(steps=args.steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr, dense_fraction=args.dense_fraction,
                      seed=args.seed, threads=args.threads)
    result = run_training(args.out, cfg, vocab_size=args.vocab_size, progress=not args.no_progress)
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0
