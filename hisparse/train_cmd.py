"""`hisparse train`: train the built-in model on the standard library's sources (see `model.train`); with
`--mtp`, train the multi-token-prediction head of an already trained model instead (its main weights frozen)."""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("train", help="train the built-in model on this Python's standard library (CPU, ~1 h); "
                                            "--mtp: its MTP head only (~25 min)")
    p.add_argument("--out", required=True, help="model directory to write (config, weights, tokenizer, training.json)")
    p.add_argument("--mtp", action="store_true",
                   help="train an MTP (draft) head for the model given by --model, its main weights frozen, and write "
                        "the model with it to --out (the main weights' file copied unchanged, the head in mtp.safetensors); "
                        "--out may be the model's own directory")
    p.add_argument("--model", default="tiny", help="with --mtp: the trained model to add a head to (default: the built-in one)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 3000; with --mtp 600)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 512; with --mtp 256)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 3e-3; with --mtp 2e-3)")
    p.add_argument("--dense-fraction", type=float, default=0.6, help="share of steps with dense CSA attention (indexer warm-up)")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default 2; with --mtp 1)")
    p.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from model.train import MTP_TRAIN, TrainConfig, run_mtp_training, run_training

    base = MTP_TRAIN if args.mtp else TrainConfig(dense_fraction=args.dense_fraction)
    given = {"steps": args.steps, "seq_len": args.seq_len, "lr": args.lr, "threads": args.threads}
    cfg = replace(base, batch=args.batch, seed=args.seed, **{k: v for k, v in given.items() if v is not None})
    if args.mtp:
        from model.builtin import resolve_model_dir

        result = run_mtp_training(resolve_model_dir(args.model), args.out, cfg, progress=not args.no_progress)
    else:
        result = run_training(args.out, cfg, vocab_size=args.vocab_size, progress=not args.no_progress)
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0
