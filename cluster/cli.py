"""The `hisparse` command line: serve, generate, plan, bench.

Heavy imports (torch, ray, fastapi) happen inside each command so `hisparse --help` stays instant
and `generate` never starts Ray.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from cluster import bench_cmd, plan_cmd, train_cmd
from core.roles import COMPILE_BACKENDS, DECODE_MODES


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


def _on_off(s: str) -> bool:
    if s.lower() in ("on", "true", "1", "yes"):
        return True
    if s.lower() in ("off", "false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, got {s!r}")


def _bytes(s: str) -> int:
    from core.roles import parse_bytes

    try:
        return parse_bytes(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_weights(p: argparse.ArgumentParser) -> None:
    from core.device import DTYPES

    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="what the model computes in and stores bf16-format KV as: auto (default) is bfloat16 on a GPU "
                        "and float32 on the CPU")
    p.add_argument("--weights", choices=["packed", "dequantize"], default="packed",
                   help="quantized checkpoints: keep FP8/FP4 weights packed and compute on them (default), or "
                        "dequantize them at load")
    p.add_argument("--kv-format", choices=["auto", "bf16", "v4"], default="auto",
                   help="KV storage: v4 = FP8 rows (UE8M0 scale per 64 channels, bf16 RoPE) and Hadamard-rotated "
                        "MXFP4 indexer keys, stored and moved packed; bf16 = the compute dtype; auto (default): what "
                        "the checkpoint was trained for (v4 for DeepSeek-V4 checkpoints, bf16 for the built-in model)")


def _add_tier(p: argparse.ArgumentParser, decode_mode: str = "auto") -> None:
    t = p.add_argument_group("KV tier (decode side)")
    t.add_argument("--offload", type=_on_off, default=True, metavar="on|off",
                   help="keep C4 entries in host memory with a device hot buffer (default on)")
    t.add_argument("--hot-buffer-slots", type=int, default=None, metavar="B",
                   help="LRU hot-buffer slots per request and CSA layer (default 2 x index_topk)")
    t.add_argument("--reserved-slots", type=int, default=8, help="hot-buffer slots for the newest C4 entries (default 8)")
    t.add_argument("--device-budget", type=_bytes, default=256 * 2**20, metavar="BYTES",
                   help="device bytes for KV (e.g. 2GiB; default 256MiB)")
    t.add_argument("--host-pool-bytes", type=_bytes, default=None, metavar="BYTES",
                   help="host bytes for the C4 pool (default 8 x the device budget)")
    t.add_argument("--block-tokens", type=int, default=None, help="tokens per classical KV block")
    t.add_argument("--max-running", type=int, default=64, help="most requests decoding at once per decode worker")
    t.add_argument("--decode-mode", choices=DECODE_MODES, default=decode_mode,
                   help=f"compiled: fixed-shape steps per batch bucket, CUDA graphs on a GPU, torch.compile on the CPU, "
                        f"made before the server is ready (on a CPU minutes the first time, seconds from Inductor's "
                        f"on-disk cache); eager: op by op; auto: compiled where the model allows it (default {decode_mode})")
    t.add_argument("--compile-backend", choices=COMPILE_BACKENDS, default="inductor",
                   help="with --decode-mode compiled on CPU: inductor (fused C++) or eager (capture only)")
    t.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="with --decode-mode compiled on CUDA: run the fixed-shape step without capturing graphs")
    t.add_argument("--compile-cache-dir", default=None, help="torch.compile's on-disk cache (kept across restarts)")


def _add_prefix_cache(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group("prefix cache (prefill side; docs/prefix-cache.md)")
    c.add_argument("--prefix-cache", type=_on_off, default=False, metavar="on|off",
                   help="resume prefill from the longest cached prefix of each prompt (default off)")
    c.add_argument("--prefix-cache-host-bytes", type=_bytes, default=1 << 30, metavar="BYTES",
                   help="host memory per prefill actor for cached pages and state snapshots (default 1GiB)")
    c.add_argument("--prefix-cache-disk-bytes", type=_bytes, default=0, metavar="BYTES",
                   help="disk tier budget per prefill actor; 0 = no disk tier (default)")
    c.add_argument("--prefix-cache-dir", default=None, metavar="DIR",
                   help="directory of the disk tier; kept across restarts (with several prefill actors, each "
                        "uses DIR/<actor name>)")
    c.add_argument("--prefix-cache-page-tokens", type=int, default=None, metavar="N",
                   help="tokens per cached page (a multiple of both compress rates; default: the KV block size)")
    c.add_argument("--prefix-cache-state-policy", choices=["last", "every"], default="last",
                   help="page boundaries that keep a state snapshot: last (of each prompt, and where a prompt leaves "
                        "a cached one; default) or every page")


def prefix_cache_config(args: argparse.Namespace):
    from core.roles import PrefixCacheConfig

    return PrefixCacheConfig(
        enabled=args.prefix_cache, host_bytes=args.prefix_cache_host_bytes, disk_bytes=args.prefix_cache_disk_bytes,
        directory=args.prefix_cache_dir, page_tokens=args.prefix_cache_page_tokens,
        state_policy=args.prefix_cache_state_policy,
    )


def tier_config(args: argparse.Namespace):
    from core.roles import TierConfig

    return TierConfig(
        offload=args.offload, hot_buffer_slots=args.hot_buffer_slots, reserved_slots=args.reserved_slots,
        device_budget_bytes=args.device_budget, host_pool_bytes=args.host_pool_bytes,
        block_tokens=args.block_tokens, max_running=args.max_running,
    )


def step_config(args: argparse.Namespace):
    from core.roles import StepConfig

    return StepConfig(decode_mode=args.decode_mode, compile_backend=args.compile_backend,
                      cuda_graphs=args.cuda_graphs, compile_cache_dir=args.compile_cache_dir)


def serve_config(args: argparse.Namespace):
    import os

    if args.api_workers > 1 and args.transport in ("gloo", "nccl"):
        raise ValueError(f"--transport {args.transport} moves layouts from the process that set the collective up, "
                         "so it needs --api-workers 1 (or use --transport object_store or nixl)")
    from core.roles import ClusterConfig, DeadlineConfig, PrefillConfig, ServeConfig, ServerConfig

    stub = None
    if args.stub_step_ms is not None:
        from core.roles import StubConfig

        stub = StubConfig(decode_step_s=args.stub_step_ms / 1000, prefill_s=(args.stub_prefill_ms or 0.0) / 1000)
    return ServeConfig(
        model=args.model,
        weights=args.weights,
        kv_format=args.kv_format,
        dtype=args.dtype,
        tier=tier_config(args),
        step=step_config(args),
        prefill=PrefillConfig(max_batch_tokens=args.max_batch_tokens, entry_tile=args.entry_tile,
                              prefix_cache=prefix_cache_config(args)),
        stub=stub,
        cluster=ClusterConfig(
            address=args.address, num_prefill=args.num_prefill, num_decode=args.num_decode,
            prefill_layout=args.prefill_layout, decode_layout=args.decode_layout,
            prefill_num_cpus=args.prefill_num_cpus, decode_num_cpus=args.decode_num_cpus,
            prefill_num_gpus=args.prefill_num_gpus, decode_num_gpus=args.decode_num_gpus,
            placement=args.placement or ("any" if args.address is None else "resources"),
            max_restarts=args.max_restarts, transport=args.transport,
        ),
        server=ServerConfig(host=args.host, port=args.port, served_model_name=args.served_model_name,
                            max_concurrent_requests=args.max_concurrent_requests,
                            max_sequences_per_request=args.max_sequences_per_request, max_body_bytes=args.max_body_bytes,
                            api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                            stream_interval=args.stream_interval, api_workers=args.api_workers),
        deadlines=DeadlineConfig(
            queue_timeout_s=args.queue_timeout_s, max_queued_requests=args.max_queued_requests,
            prefill_timeout_s=args.prefill_timeout_s, handoff_timeout_s=args.handoff_timeout_s,
            token_timeout_s=args.token_timeout_s, max_request_retries=args.max_request_retries,
            subscriber_timeout_s=args.subscriber_timeout_s, step_hang_s=args.step_hang_s,
        ),
    )


API_KEY_ENV = "HISPARSE_API_KEY"


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
    _add_weights(g)
    _add_sampling(g)
    _add_tier(g, decode_mode="eager")  # one generation does not pay for compiling a step it runs a few times

    s = sub.add_parser("serve", help="start the cluster and the OpenAI-compatible HTTP server")
    s.add_argument("--model", default="tiny", help="`tiny` (built-in) or a model directory")
    s.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    s.add_argument("--served-model-name", default=None, help="model name the API answers to")
    _add_weights(s)
    s.add_argument("--max-concurrent-requests", type=int, default=512,
                   help="in-flight requests per gateway process before 429 (default 512)")
    s.add_argument("--max-sequences-per-request", type=int, default=64,
                   help="most sequences one request may fan out to, len(prompt) x n (default 64; more is a 400)")
    s.add_argument("--max-body-bytes", type=_bytes, default=16 * 2**20,
                   help="largest request body; larger ones get 413 before parsing (default 16MiB)")
    s.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on every /v1 route (or set HISPARSE_API_KEY); "
                        "/health and /metrics stay open")
    s.add_argument("--stream-interval", type=int, default=1,
                   help="tokens per streamed chunk; the first and last chunk are sent at once (default 1)")
    s.add_argument("--api-workers", type=int, default=1,
                   help="gateway processes on the same port, sharing the actors (default 1)")
    d = s.add_argument_group("deadlines (see docs: every stage of a request has one)")
    d.add_argument("--queue-timeout-s", type=float, default=30.0,
                   help="wait for decode capacity before a 503 with Retry-After (default 30)")
    d.add_argument("--max-queued-requests", type=int, default=1024,
                   help="requests waiting for capacity per gateway process; more get 503 at once (default 1024)")
    d.add_argument("--prefill-timeout-s", type=float, default=1800.0,
                   help="prefill of one request, its queueing included (default 1800)")
    d.add_argument("--handoff-timeout-s", type=float, default=60.0,
                   help="from a finished prefill until the decode actor holds the request (default 60)")
    d.add_argument("--token-timeout-s", type=float, default=60.0,
                   help="most time between two tokens; a silent stream ends with an error (default 60)")
    d.add_argument("--max-request-retries", type=int, default=1,
                   help="times a request is prefilled again after a lost worker or failed step (default 1)")
    d.add_argument("--subscriber-timeout-s", type=float, default=30.0,
                   help="decode actors drop a gateway that stopped collecting output for this long (default 30)")
    d.add_argument("--step-hang-s", type=float, default=120.0,
                   help="a step thread stuck in one step this long is taken out of routing (default 120)")
    b = s.add_argument_group("benchmark mode (measures the serving path alone; not for serving a model)")
    b.add_argument("--stub-step-ms", type=float, default=None,
                   help="replace each decode step by a sleep of this many ms yielding one token per request")
    b.add_argument("--stub-prefill-ms", type=float, default=None, help="with --stub-step-ms: each prefill step sleeps this long")
    c = s.add_argument_group("cluster")
    c.add_argument("--address", default=None,
                   help="Ray cluster to join (auto, host:6379); omitted: start an embedded local Ray instance")
    c.add_argument("--num-prefill", type=int, default=1, help="prefill actors (default 1)")
    c.add_argument("--num-decode", type=int, default=1,
                   help="decode actors (default 1), or decode replicas with a --decode-layout of several ranks")
    c.add_argument("--prefill-layout", default="dp1", metavar="LAYOUT",
                   help="how one prefill replica splits the model over its ranks, like --decode-layout (default dp1)")
    c.add_argument("--decode-layout", default="dp1", metavar="LAYOUT",
                   help="how one decode replica splits the model over its ranks (one device and one actor each): "
                        "dp1 (default: one rank, the whole model), dp2, dp8+ep8 (DP attention, routed experts split "
                        "over all ranks); a replica's ranks are placed on one node. See docs/parallel.md")
    c.add_argument("--prefill-num-cpus", type=float, default=1.0)
    c.add_argument("--decode-num-cpus", type=float, default=1.0)
    c.add_argument("--prefill-num-gpus", type=float, default=None,
                   help="GPUs each prefill actor reserves (default: 1 where the cluster has GPUs, else 0)")
    c.add_argument("--decode-num-gpus", type=float, default=None,
                   help="GPUs each decode actor reserves (default: 1 where the cluster has GPUs, else 0)")
    c.add_argument("--placement", choices=["resources", "any"], default=None,
                   help="resources: actors need the node resources hisparse_prefill / hisparse_decode "
                        "(default when joining a cluster); any: anywhere (default for the embedded instance)")
    c.add_argument("--max-restarts", type=int, default=3, help="restarts of a dead actor (default 3)")
    c.add_argument("--transport", choices=["object_store", "gloo", "nccl", "nixl"], default="object_store",
                   help="layout handoff: the Ray object store (default) or Ray's direct tensor transport "
                        "(nccl/nixl between GPU actors, gloo between CPU actors)")
    c.add_argument("--max-batch-tokens", type=int, default=2048, help="prompt tokens per prefill forward")
    c.add_argument("--entry-tile", type=int, default=512,
                   help="compressed entries a prefill chunk reads at once (bounds its memory at any context; default 512)")
    _add_prefix_cache(s)
    _add_tier(s)

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
    try:
        config = serve_config(args)
    except ValueError as e:
        print(f"hisparse serve: {e}", file=sys.stderr)
        return 2
    from cluster.auth import choose_auth_mode

    choose_auth_mode(config.cluster.address)  # before ray is first imported
    from api.server import run_server  # the serve command is where the gateway comes in

    return run_server(config)


def _generate(args: argparse.Namespace) -> int:
    from cluster.inprocess import InProcessEngine
    from core.types import GenerateRequest, SamplingParams
    from model.builtin import resolve_model_dir
    from model.loader import load_model
    from model.tokenizer import load_tokenizer

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            seed=args.seed, ignore_eos=args.ignore_eos,
        )
        tier, step = tier_config(args), step_config(args)
    except ValueError as e:
        print(f"hisparse generate: {e}", file=sys.stderr)
        return 2
    from core import device

    model_dir = resolve_model_dir(args.model)
    dev = device.current()
    device.configure_math(dev.kind)
    model = load_model(model_dir, dtype=device.serving_dtype(args.dtype, dev.kind), device=dev.torch_device,
                       weights=args.weights, kv_format=args.kv_format)
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
        done = engine.generate([GenerateRequest("generate-0", tuple(prompt_ids), params)])["generate-0"]
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
                          "decode_step": stats.get("step"), "device": str(model.device),
                          "dtype": str(model.dtype).removeprefix("torch."), "kv_format": model.cfg.kv_format}))
    else:
        print(text if text is not None else " ".join(map(str, ids)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
