"""The `hisparse` command line: serve, generate, plan, bench.

Heavy imports (torch, ray, fastapi) happen inside each command so `hisparse --help` stays instant
and `generate` never starts Ray.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys

from core.config import WEIGHT_MODES
from core.configs import (
    COMPILE_BACKENDS,
    DECODE_MODES,
    PLACEMENTS,
    RESERVE_POLICIES,
    STATE_POLICIES,
    ClusterConfig,
    DeadlineConfig,
    FieldError,
    PrefillConfig,
    PrefixCacheConfig,
    ServeConfig,
    ServerConfig,
    StepConfig,
    StubConfig,
    TierConfig,
    parse_bytes,
)
from core.device import DTYPES
from core.types import SamplingParams
from hisparse import bench_cmd, plan_cmd, train_cmd
from hisparse.flags import Flag, add_flags, config, dest


def _int_list(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def _on_off(s: str) -> bool:
    if s.lower() in ("on", "true", "1", "yes"):
        return True
    if s.lower() in ("off", "false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, got {s!r}")


def _bytes(s: str) -> int:
    try:
        return parse_bytes(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


ON_OFF = {"type": _on_off, "metavar": "on|off"}
BYTES = {"type": _bytes, "metavar": "BYTES"}

SAMPLING = [
    Flag("--max-tokens", SamplingParams, "max_tokens", {"type": int}),
    Flag("--temperature", SamplingParams, "temperature", {"type": float}),
    Flag("--top-p", SamplingParams, "top_p", {"type": float}),
    Flag("--top-k", SamplingParams, "top_k", {"type": int}),
    Flag("--min-p", SamplingParams, "min_p", {"type": float}),
    Flag("--seed", SamplingParams, "seed", {"type": int}),
    Flag("--ignore-eos", SamplingParams, "ignore_eos", {"action": "store_true"}),
]
MODEL = [
    Flag("--model", ServeConfig, "model"),
    Flag("--dtype", ServeConfig, "dtype", {"choices": DTYPES}),
    Flag("--weights", ServeConfig, "weights", {"choices": WEIGHT_MODES}),
    Flag("--kv-format", ServeConfig, "kv_format", {"choices": ("auto", "bf16", "v4")}),
]
TIER = [
    Flag("--offload", TierConfig, "offload", ON_OFF),
    Flag("--hot-buffer-slots", TierConfig, "hot_buffer_slots", {"type": int, "metavar": "B"}),
    Flag("--reserved-slots", TierConfig, "reserved_slots", {"type": int}),
    Flag("--device-budget", TierConfig, "device_budget_bytes", BYTES, bytes=True),
    Flag("--host-pool-bytes", TierConfig, "host_pool_bytes", BYTES, bytes=True),
    Flag("--block-tokens", TierConfig, "block_tokens", {"type": int}),
    Flag("--max-running", TierConfig, "max_running", {"type": int}),
    Flag("--speculative-tokens", TierConfig, "speculative_tokens", {"type": int, "metavar": "N"}),
    Flag("--reserve", TierConfig, "reserve", {"choices": RESERVE_POLICIES}),
    Flag("--output-estimate-tokens", TierConfig, "output_estimate_tokens", {"type": int}),
    Flag("--resident", TierConfig, "resident", ON_OFF),
    Flag("--retain-bytes", TierConfig, "retain_bytes", BYTES, bytes=True),
    Flag("--share-prefixes", TierConfig, "share_prefixes", {"type": int, "metavar": "N"}),
]
STEP = [
    Flag("--decode-mode", StepConfig, "decode_mode", {"choices": DECODE_MODES}),
    Flag("--compile-backend", StepConfig, "compile_backend", {"choices": COMPILE_BACKENDS}),
    Flag("--no-cuda-graphs", StepConfig, "cuda_graphs", {"action": "store_false"},
         help="with --decode-mode compiled on CUDA: run the fixed-shape step without capturing graphs"),
    Flag("--compile-cache-dir", StepConfig, "compile_cache_dir"),
    Flag("--no-speculative-adaptive", StepConfig, "speculative_adaptive", {"action": "store_false"},
         help="with --speculative-tokens: always draft N tokens instead of choosing each step's count"),
]
PREFIX_CACHE = [
    Flag("--prefix-cache", PrefixCacheConfig, "enabled", ON_OFF),
    Flag("--prefix-cache-host-bytes", PrefixCacheConfig, "host_bytes", BYTES, bytes=True),
    Flag("--prefix-cache-disk-bytes", PrefixCacheConfig, "disk_bytes", BYTES, bytes=True),
    Flag("--prefix-cache-dir", PrefixCacheConfig, "directory", {"metavar": "DIR"}),
    Flag("--prefix-cache-page-tokens", PrefixCacheConfig, "page_tokens", {"type": int, "metavar": "N"}),
    Flag("--prefix-cache-state-policy", PrefixCacheConfig, "state_policy", {"choices": STATE_POLICIES}),
]
SERVER = [
    Flag("--host", ServerConfig, "host"),
    Flag("--port", ServerConfig, "port", {"type": int}),
    Flag("--served-model-name", ServerConfig, "served_model_name"),
    Flag("--max-concurrent-requests", ServerConfig, "max_concurrent_requests", {"type": int}),
    Flag("--max-sequences-per-request", ServerConfig, "max_sequences_per_request", {"type": int}),
    Flag("--max-body-bytes", ServerConfig, "max_body_bytes", BYTES, bytes=True),
    Flag("--api-key", ServerConfig, "api_key", help="require `Authorization: Bearer KEY` on every /v1 route (or set "
         "HISPARSE_API_KEY); /health and /metrics stay open"),
    Flag("--stream-interval", ServerConfig, "stream_interval", {"type": int}),
    Flag("--api-workers", ServerConfig, "api_workers", {"type": int}),
]
DEADLINES = [
    Flag(f"--{name.replace('_', '-')}", DeadlineConfig, name, {"type": float if name.endswith("_s") else int})
    for name in ("queue_timeout_s", "max_queued_requests", "prefill_timeout_s", "handoff_timeout_s", "token_timeout_s",
                 "max_request_retries", "subscriber_timeout_s", "step_hang_s")
]
CLUSTER = [
    Flag("--address", ClusterConfig, "address"),
    Flag("--num-prefill", ClusterConfig, "num_prefill", {"type": int}),
    Flag("--num-decode", ClusterConfig, "num_decode", {"type": int}),
    Flag("--prefill-layout", ClusterConfig, "prefill_layout", {"metavar": "LAYOUT"}),
    Flag("--decode-layout", ClusterConfig, "decode_layout", {"metavar": "LAYOUT"}),
    Flag("--prefill-num-cpus", ClusterConfig, "prefill_num_cpus", {"type": float}),
    Flag("--decode-num-cpus", ClusterConfig, "decode_num_cpus", {"type": float}),
    Flag("--prefill-num-gpus", ClusterConfig, "prefill_num_gpus", {"type": float}),
    Flag("--decode-num-gpus", ClusterConfig, "decode_num_gpus", {"type": float}),
    Flag("--placement", ClusterConfig, "placement", {"choices": PLACEMENTS}),
    Flag("--max-restarts", ClusterConfig, "max_restarts", {"type": int}),
    Flag("--transport", ClusterConfig, "transport", {"choices": ("object_store", "gloo", "nccl", "nixl")}),
]
PREFILL = [
    Flag("--max-batch-tokens", PrefillConfig, "max_batch_tokens", {"type": int}),
    Flag("--entry-tile", PrefillConfig, "entry_tile", {"type": int}),
]


FLAG_OF = {(f.cls, f.name): f.flag for flags in (SAMPLING, MODEL, TIER, STEP, PREFIX_CACHE, SERVER, DEADLINES, CLUSTER, PREFILL)
           for f in flags}
"""The flag that sets each config field, to name it in a refusal."""


def refusal(command: str, e: ValueError) -> str:
    """The one line a command prints when it refuses its configuration: the flag named as it was typed."""
    text = f"{FLAG_OF.get((e.cls, e.name), e.name)} {e.problem}" if isinstance(e, FieldError) else str(e)
    return f"hisparse {command}: " + " ".join(text.split())


def tier_config(args: argparse.Namespace) -> TierConfig:
    return config(TierConfig, args)


def step_config(args: argparse.Namespace) -> StepConfig:
    return config(StepConfig, args)


def prefix_cache_config(args: argparse.Namespace) -> PrefixCacheConfig:
    return config(PrefixCacheConfig, args)


def serve_config(args: argparse.Namespace) -> ServeConfig:
    import os

    api_workers, transport = getattr(args, dest(ServerConfig, "api_workers")), getattr(args, dest(ClusterConfig, "transport"))
    if api_workers > 1 and transport in ("gloo", "nccl"):
        raise ValueError(f"--transport {transport} moves layouts from the process that set the collective up, "
                         "so it needs --api-workers 1 (or use --transport object_store or nixl)")
    stub = None
    if args.stub_step_ms is not None:
        stub = StubConfig(decode_step_s=args.stub_step_ms / 1000, prefill_s=(args.stub_prefill_ms or 0.0) / 1000)
    api_key = getattr(args, dest(ServerConfig, "api_key")) or os.environ.get(API_KEY_ENV) or None
    return config(ServeConfig, args, tier=tier_config(args), step=step_config(args), stub=stub,
                  prefill=config(PrefillConfig, args, prefix_cache=prefix_cache_config(args)),
                  cluster=config(ClusterConfig, args), server=config(ServerConfig, args, api_key=api_key),
                  deadlines=config(DeadlineConfig, args))


API_KEY_ENV = "HISPARSE_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hisparse", description="Serve DeepSeek-V4-style sparse-attention models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate in this process (no Ray, no server)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (needs a tokenizer in the model directory)")
    src.add_argument("--prompt-ids", type=_int_list, help="prompt as comma-separated token ids, e.g. 1,2,3")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    add_flags(g, MODEL)
    add_flags(g.add_argument_group("sampling"), SAMPLING)
    add_flags(g.add_argument_group("KV tier"), TIER)
    # one generation does not pay back compiling a step it runs a few hundred times: generate decodes eagerly
    add_flags(g.add_argument_group("decode step"), STEP, defaults={"--decode-mode": "eager"})

    s = sub.add_parser("serve", help="start the cluster and the OpenAI-compatible HTTP server")
    add_flags(s, MODEL)
    add_flags(s.add_argument_group("HTTP gateway"), SERVER)
    add_flags(s.add_argument_group("deadlines (every stage of a request has one)"), DEADLINES)
    b = s.add_argument_group("benchmark mode (measures the serving path alone; not for serving a model)")
    b.add_argument("--stub-step-ms", type=float, default=None,
                   help="replace each decode step by a sleep of this many ms yielding one token per request")
    b.add_argument("--stub-prefill-ms", type=float, default=None, help="with --stub-step-ms: each prefill step sleeps this long")
    add_flags(s.add_argument_group("cluster"), CLUSTER)
    add_flags(s.add_argument_group("prefill"), PREFILL)
    add_flags(s.add_argument_group("prefix cache (prefill side; docs/prefix-cache.md)"), PREFIX_CACHE)
    add_flags(s.add_argument_group("KV tier (decode side)"), TIER)
    add_flags(s.add_argument_group("decode step"), STEP)

    plan_cmd.add_parser(sub)
    bench_cmd.add_parser(sub)
    train_cmd.add_parser(sub)
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
        if args.command == "plan":
            return plan_cmd.run(args)
        if args.command == "bench":
            return bench_cmd.run(args)
        if args.command == "train":
            return train_cmd.run(args)
        if args.command == "serve":
            return _serve(args)
    except KeyboardInterrupt:
        return 130
    return 1


def _serve(args: argparse.Namespace) -> int:
    from hisparse import preflight

    try:
        config = serve_config(args)
        preflight.check_serve(config)  # before Ray: what can never serve is refused in seconds, in one line
    except ValueError as e:
        print(refusal("serve", e), file=sys.stderr)
        return 2
    from cluster.auth import choose_auth_mode

    choose_auth_mode(config.cluster.address)  # before ray is first imported
    from api.server import run_server  # the serve command is where the gateway comes in

    return run_server(config)


def _generate(args: argparse.Namespace) -> int:
    from cluster.inprocess import InProcessEngine
    from core.request import Request
    from hisparse import preflight
    from model.builtin import resolve_model_dir
    from model.loader import load_model
    from model.tokenizer import load_tokenizer

    try:
        params = config(SamplingParams, args)
        tier, step = tier_config(args), step_config(args)
        what = config(ServeConfig, args)  # the model flags: model, dtype, weights, kv_format
        preflight.check_generate(what, tier)
    except ValueError as e:
        print(refusal("generate", e), file=sys.stderr)
        return 2
    from core import device

    model_dir = resolve_model_dir(what.model)
    dev = device.current()
    device.configure_math(dev.kind)
    model = load_model(model_dir, dtype=device.serving_dtype(what.dtype, dev.kind), device=dev.torch_device,
                       weights=what.weights, kv_format=what.kv_format, mtp=tier.speculative_tokens > 0)
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
    from model.config import end_of_sequence_ids

    eos_ids = end_of_sequence_ids(model_dir, model.cfg, tok.eos_token_ids if tok is not None else ())
    try:
        engine = InProcessEngine(model, tier, eos_ids=eos_ids, step=step)
        from cluster.describe import describe_worker

        logging.getLogger("hisparse.generate").info("generating on %s", describe_worker(model, engine.decode.runner.mode))
        done = engine.generate([Request("generate-0", tuple(prompt_ids), params)])["generate-0"]
    except Exception as e:  # configuration and admission errors carry their remedy in the message
        from core.types import HisparseError

        if isinstance(e, (HisparseError, ValueError, MemoryError)):
            print(f"hisparse generate: {e}", file=sys.stderr)
            return 2
        raise
    engine.decode.check_integrity()
    stats = engine.decode.stats()
    engine.close()
    ids = done.token_ids
    text = tok.decode(ids) if tok is not None else None
    if args.json:
        tier_out = {k: stats[k] for k in ("hits", "misses", "evictions", "bytes_h2d", "bytes_d2h") if k in stats}
        tier_out.update(offload=tier.offload, hot_buffer_slots=engine.store.geo.lru if tier.offload else None,
                        device_budget_bytes=tier.device_budget_bytes)
        print(json.dumps({"prompt_token_ids": list(prompt_ids), "token_ids": ids, "text": text,
                          "finish_reason": done.finish_reason, "tier": tier_out, **tier_out,
                          "acceptance_length": (stats.get("speculation") or {}).get("acceptance_length"),
                          "speculation": stats.get("speculation"),
                          "decode_step": dataclasses.asdict(stats["step"]), "device": str(model.device),
                          "dtype": str(model.dtype).removeprefix("torch."), "kv_format": model.cfg.kv_format}))
    else:
        print(text if text is not None else " ".join(map(str, ids)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
