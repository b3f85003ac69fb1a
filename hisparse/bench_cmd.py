"""`hisparse bench ...`: benchmark commands. Only argparse at import time; the client loads on use."""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys


def _rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        rate = math.nan
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"expected a request rate > 0 or inf, got {text!r}")
    return rate


def _rates(text: str) -> list[float]:
    rates = [_rate(x.strip()) for x in text.split(",") if x.strip()]
    if not rates:
        raise argparse.ArgumentTypeError("expected comma-separated request rates, e.g. 1,2,4,inf")
    return rates


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _vocab_range(text: str) -> tuple[int, int]:
    sep = ".." if ".." in text else ","
    try:
        lo, hi = (int(x) for x in text.split(sep))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO..HI, e.g. 10..250, got {text!r}") from None
    if not 0 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 0 <= LO <= HI, got {text!r}")
    return lo, hi


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or any(not 0 < p < 100 for p in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated percentiles in (0, 100), got {text!r}")
    return values


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object, e.g. '{\"temperature\": 0.7}'")
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `bench` (with its nested commands) on the top-level subparsers."""
    bench = subparsers.add_parser("bench", help="benchmarks that print one JSON object")
    nested = bench.add_subparsers(dest="bench_command", required=True)

    s = nested.add_parser(
        "serve", help="online serving benchmark against an OpenAI-compatible server",
        description="Send streaming requests to a running server and report throughput and TTFT/TPOT/ITL/E2E "
                    "latency (mean, median, std, percentiles) as one JSON object on stdout.",
    )
    s.add_argument("--url", "--base-url", dest="url", default="http://127.0.0.1:8000",
                   help="server root (default http://127.0.0.1:8000)")
    s.add_argument("--model", default=None, help="model name to request (default: the first of GET /v1/models)")
    s.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="completions: token-id prompts of exact length (default); chat: text prompts")
    s.add_argument("--num-prompts", type=_positive_int, default=100, help="requests to send (default 100)")
    s.add_argument("--input-len", type=_positive_int, default=128,
                   help="prompt tokens (completions) or characters (chat) (default 128)")
    s.add_argument("--output-len", type=_positive_int, default=128, help="max_tokens with ignore_eos (default 128)")
    load = s.add_argument_group("load (a rate, a concurrency cap, or both; neither: all requests at once)")
    load.add_argument("--request-rate", type=_rate, default=math.inf, metavar="R",
                      help="Poisson arrivals per second; inf sends all at once (default inf)")
    load.add_argument("--max-concurrency", type=_positive_int, default=None, metavar="C",
                      help="most requests in flight at once (default: no cap)")
    load.add_argument("--sweep-rates", type=_rates, default=None, metavar="R1,R2,...",
                      help="run once per request rate (e.g. 1,2,4,inf); overrides --request-rate")
    s.add_argument("--seed", type=int, default=0, help="seed of prompts and arrival times (default 0)")
    s.add_argument("--vocab-range", type=_vocab_range, default=(10, 250), metavar="LO..HI",
                   help="token ids of completions prompts are drawn from LO..HI (default 10..250)")
    s.add_argument("--percentiles", type=_percentiles, default=(50.0, 99.0), metavar="P1,P2,...",
                   help="latency percentiles to report; 50 and 99 are always included (default 50,99)")
    s.add_argument("--timeout", type=float, default=600.0, help="seconds without data before a request fails")
    s.add_argument("--extra-body", type=_json_object, default=None, metavar="JSON",
                   help="fields merged into every request body, e.g. '{\"temperature\": 0.7}'")
    s.add_argument("--result-file", default=None, help="also write the JSON result here")
    s.add_argument("--plot", default=None, metavar="PNG",
                   help="write a PNG: latency CDFs of one run, or p50/p99 against offered load with --sweep-rates")
    s.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    s.add_argument("--no-require-done", action="store_true",
                   help="count a stream that ends on a finish_reason chunk without data: [DONE] as complete (transformers serve)")
    return bench


def run(args: argparse.Namespace) -> int:
    if args.bench_command == "serve":
        return _serve(args)
    print(f"hisparse bench: unknown command {args.bench_command!r}", file=sys.stderr)
    return 2


def _args_json(args: argparse.Namespace) -> dict:
    out = {}
    for key, value in vars(args).items():
        if callable(value):
            continue
        if isinstance(value, float) and math.isinf(value):
            value = "inf"
        elif isinstance(value, list):
            value = ["inf" if isinstance(v, float) and math.isinf(v) else v for v in value]
        elif isinstance(value, tuple):
            value = list(value)
        out[key] = value
    return out


def _serve(args: argparse.Namespace) -> int:
    from bench.common import emit
    from bench.serve import ServeBenchConfig, ServeBenchError, matplotlib_missing, plot_cdfs, plot_sweep, run_serve_bench, run_serve_sweep

    if not getattr(args, "verbose", False):
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request would bury the progress bar
    if args.plot and (why := matplotlib_missing()):
        print(f"hisparse bench serve: {why}", file=sys.stderr)
        return 2
    try:
        cfg = ServeBenchConfig(
            base_url=args.url, num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
            request_rate=args.request_rate, max_concurrency=args.max_concurrency, model=args.model,
            endpoint=args.endpoint, seed=args.seed, vocab_range=tuple(args.vocab_range), timeout_s=args.timeout,
            percentiles=tuple(args.percentiles), extra_body=args.extra_body, progress=not args.no_progress,
            require_done=not args.no_require_done,
        )
    except ValueError as e:
        print(f"hisparse bench serve: {e}", file=sys.stderr)
        return 2
    try:
        result = run_serve_sweep(cfg, args.sweep_rates) if args.sweep_rates else run_serve_bench(cfg)
    except ServeBenchError as e:
        print(f"hisparse bench serve: {e}", file=sys.stderr)
        return 1
    result = {"args": _args_json(args), **result}
    emit(result)
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    if args.plot:
        (plot_sweep if args.sweep_rates else plot_cdfs)(result, args.plot)
    runs = result["runs"] if args.sweep_rates else [result]
    # Exit 1 only when some run got nothing through: failures alone are a measurement, not an error.
    return 0 if all(r["completed"] > 0 for r in runs) else 1
