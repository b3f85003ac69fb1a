"""The `hisparse` command line: serve, generate, plan, bench.

Heavy imports (torch, ray, fastapi) happen inside each command so `hisparse --help` stays instant
and `generate` never starts Ray.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys


def _int_list(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=16, help="most tokens to generate (default 16)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = no top-k filter")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hisparse", description="Serve DeepSeek-V4-style sparse-attention models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate in this process (no Ray, no server)")
    g.add_argument("--model", default="tiny", help="`tiny` (built-in) or a model directory")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (needs a tokenizer in the model directory)")
    src.add_argument("--prompt-ids", type=_int_list, help="prompt as comma-separated token ids, e.g. 1,2,3")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    _add_sampling(g)

    s = sub.add_parser("serve", help="start the cluster and the OpenAI-compatible HTTP server")
    s.add_argument("--model", default="tiny", help="`tiny` (built-in) or a model directory")

    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            print("hisparse serve: not built yet (the serving issues add it)", file=sys.stderr)
            return 2
    except KeyboardInterrupt:
        return 130
    return 1


def _generate(args: argparse.Namespace) -> int:
    from core.types import SamplingParams
    from model.builtin import resolve_model_dir
    from model.generate import generate_plain
    from model.loader import load_model
    from model.tokenizer import load_tokenizer

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            seed=args.seed, ignore_eos=args.ignore_eos,
        )
    except ValueError as e:
        print(f"hisparse generate: {e}", file=sys.stderr)
        return 2
    model_dir = resolve_model_dir(args.model)
    model = load_model(model_dir)
    tok = load_tokenizer(model_dir)
    if args.prompt is not None:
        if tok is None:
            print(f"hisparse generate: {model_dir} has no tokenizer.json; pass --prompt-ids instead", file=sys.stderr)
            return 2
        prompt_ids = tok.encode(args.prompt)
    elif args.prompt_ids:
        prompt_ids = args.prompt_ids
    else:
        print("hisparse generate: give --prompt TEXT or --prompt-ids 1,2,3", file=sys.stderr)
        return 2
    bad = [i for i in prompt_ids if not 0 <= i < model.cfg.vocab_size]
    if bad:
        print(f"hisparse generate: token ids {bad[:5]} are outside the vocabulary (0..{model.cfg.vocab_size - 1})",
              file=sys.stderr)
        return 2
    tokens, reason, _ = generate_plain(model, prompt_ids, params)
    ids = [t.token_id for t in tokens]
    text = tok.decode(ids) if tok is not None else None
    if args.json:
        print(json.dumps({"prompt_token_ids": list(prompt_ids), "token_ids": ids, "text": text,
                          "finish_reason": reason}))
    else:
        print(text if text is not None else " ".join(map(str, ids)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
