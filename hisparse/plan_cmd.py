"""`hisparse plan`: how many tokens of a given context fit on some GPUs, with and without the C4 tier.

The arithmetic lives in `cachetier.planner`; this module reads the flags, resolves the model (a preset
name or a model directory's config.json) and the GPU (a preset name or a byte count), and prints.
Also runnable on its own: `python -m hisparse.plan_cmd --model v4-flash --gpu h200 --context 1M`.
`--layout dp8+ep8` plans replicas split that way (per-rank weights, KV and host figures); several layouts
separated by commas print one comparison row each.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from types import MappingProxyType

from cachetier.planner import GPU_MEMORY_BYTES, INDEX_FORMATS, KV_FORMATS, Plan, PlanError, PlanInputs, plan
from core.config import WEIGHT_MODES, WEIGHTS_PACKED, ModelConfig
from core.configs import TierConfig, format_bytes, parse_bytes
from core.parallel import ParallelLayout
from core.presets import PRESETS

PUBLISHED_CHECKPOINT_BYTES = MappingProxyType({"v4-flash": 160 * 10**9, "v4-pro": 865 * 10**9})
"""Published checkpoint sizes of the presets (about 160 GB and 865 GB), to compare the weight estimate with."""

_TOKEN_UNITS = MappingProxyType({"": 1, "k": 2**10, "m": 2**20})


def parse_tokens(text: str) -> int:
    """`4096`, `128K` (= 131072), `1M` (= 1048576, the models' "1M" context) -> tokens."""
    m = re.fullmatch(r"\s*([0-9]+)\s*([kKmM]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as a token count (examples: 4096, 128K, 1M)")
    return int(m.group(1)) * _TOKEN_UNITS[m.group(2).lower()]


def _bytes(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _fraction(text: str) -> float:
    try:
        value = float(text.rstrip("%")) / (100.0 if text.endswith("%") else 1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction such as 0.1 or 10%, got {text!r}") from None
    return value


def parse_layouts(text: str) -> tuple[ParallelLayout, ...]:
    """`dp8+ep8` or `dp8+ep8,tp8+ep8,dp8` -> layouts (`ParallelLayout.parse` each)."""
    try:
        return tuple(ParallelLayout.parse(part) for part in text.split(","))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="v4-flash, v4-pro, or a model directory with a config.json")
    p.add_argument("--gpu", required=True,
                   help="h200 (141e9 B), b200 (180e9 B), or one GPU's memory as a byte count (e.g. 96GB, 80GiB, 141e9)")
    p.add_argument("--context", type=parse_tokens, required=True, metavar="TOKENS",
                   help="tokens per request (K = 1024, M = 1048576: 1M is the models' full context)")
    p.add_argument("--num-gpus", type=int, default=8,
                   help="GPUs (default 8): the weights split evenly over them, or with --layout whole replicas "
                        "of the layout")
    p.add_argument("--kv-format", choices=KV_FORMATS, default="fp8",
                   help="SWA/C4/HCA entries: fp8 = 584-byte rows for V4 (default), bf16 = 2 x head_dim")
    p.add_argument("--index-format", choices=INDEX_FORMATS, default="fp4",
                   help="indexer keys: fp4 = 68 B for V4 (default), fp8 = 132 B, bf16 = 256 B")
    p.add_argument("--hot-buffer-slots", type=int, default=None, metavar="B",
                   help="LRU hot-buffer slots per request and CSA layer (default 2 x index_topk)")
    p.add_argument("--reserved-slots", type=int, default=TierConfig.reserved_slots, metavar="R",
                   help=f"hot-buffer slots for the newest C4 entries (default {TierConfig.reserved_slots})")
    p.add_argument("--activation-reserve", type=_fraction, default=0.10, metavar="FRACTION",
                   help="share of each GPU's memory kept for activations (default 0.10)")
    p.add_argument("--weight-bytes", type=_bytes, default=None, metavar="BYTES",
                   help="whole-model weight bytes, replacing the estimate (e.g. a measured checkpoint size)")
    p.add_argument("--weights", choices=WEIGHT_MODES, default=WEIGHTS_PACKED,
                   help="packed: FP8/FP4 matrices stay packed on the GPUs (default, as the loader does); "
                        "dequantize: expanded to bf16 at load")
    p.add_argument("--host-memory", type=_bytes, default=None, metavar="BYTES",
                   help="host memory for the C4 pool across these GPUs' machines (e.g. 2TiB); flags when exceeded")
    p.add_argument("--layout", type=parse_layouts, default=None, metavar="LAYOUT[,LAYOUT...]",
                   help="plan replicas split this way: dpN (attention data-parallel groups), tpN (attention-TP ranks "
                        "per group), +epW (routed experts over all dp*tp ranks), e.g. dp8+ep8, tp8+ep8, dp8, "
                        "dp4xtp2+ep8; --num-gpus must be a multiple of dp*tp. Each GPU holds one rank's weights. "
                        "Several layouts separated by commas print one comparison row each")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `plan` on the `hisparse` command's subparsers."""
    p = subparsers.add_parser(
        "plan", help="capacity planner: tokens that fit with and without the C4 tier",
        description="How many tokens and concurrent requests of a context fit on some GPUs, with and "
                    "without the HiSparse tier (C4 entries in host memory).",
    )
    add_flags(p)
    return p


def resolve_model(name: str) -> ModelConfig:
    """A preset name or a model directory -> its geometry. Raises PlanError with a readable message."""
    if name in PRESETS:
        return PRESETS[name]
    path = Path(name)
    if path.is_dir():
        from model.config import ConfigError, load_config

        try:
            return load_config(path)
        except ConfigError as e:
            raise PlanError(str(e)) from None
    raise PlanError(f"unknown --model {name!r}: use one of {sorted(PRESETS)} or a model directory with a config.json")


def checkpoint_packed(name: str) -> bool | None:
    """Whether the model's checkpoint stores FP8/FP4 tensors: presets do; a directory is read (headers
    only); None for a directory without safetensors files."""
    if name in PRESETS:
        return True
    from model.loader import CheckpointError, checkpoint_is_packed

    try:
        return checkpoint_is_packed(name)
    except CheckpointError as e:
        raise PlanError(str(e)) from None


def resolve_gpu(text: str) -> tuple[int, str | None]:
    """A GPU preset name or a byte count -> (bytes per GPU, preset name or None)."""
    key = text.strip().lower()
    if key in GPU_MEMORY_BYTES:
        return GPU_MEMORY_BYTES[key], key
    try:
        return parse_bytes(text), None
    except ValueError:
        raise PlanError(
            f"unknown --gpu {text!r}: use one of {sorted(GPU_MEMORY_BYTES)} or a byte count such as 96GB or 141e9"
        ) from None


def _plan(args: argparse.Namespace, cfg: ModelConfig, layout: ParallelLayout | None) -> Plan:
    device_bytes, gpu_name = resolve_gpu(args.gpu)
    inputs = PlanInputs(
        context_len=args.context, device_bytes_per_gpu=device_bytes, num_gpus=args.num_gpus, gpu_name=gpu_name,
        kv_format=args.kv_format, index_format=args.index_format, hot_buffer_slots=args.hot_buffer_slots,
        reserved_slots=args.reserved_slots, activation_reserve=args.activation_reserve,
        weight_bytes=args.weight_bytes, host_memory_bytes=args.host_memory,
        weights=args.weights, checkpoint_packed=checkpoint_packed(args.model), layout=layout,
    )
    return plan(cfg, inputs)


def run(args: argparse.Namespace) -> int:
    layouts = getattr(args, "layout", None) or (None,)
    if len(layouts) > 1:
        return run_table(args, layouts)
    try:
        result = _plan(args, resolve_model(args.model), layouts[0])
    except PlanError as e:
        print(f"hisparse plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        out = result.to_dict()
        out["weights"]["published_checkpoint_bytes"] = PUBLISHED_CHECKPOINT_BYTES.get(args.model)
        print(json.dumps(out))
    else:
        print(render(result, PUBLISHED_CHECKPOINT_BYTES.get(args.model)))
    return 0


def run_table(args: argparse.Namespace, layouts: tuple[ParallelLayout, ...]) -> int:
    """One row per layout; a layout that cannot be planned gets its reason instead of figures. Exit 2 when
    none can be planned (or the model or GPU is unknown)."""
    try:
        cfg = resolve_model(args.model)
        resolve_gpu(args.gpu)
    except PlanError as e:
        print(f"hisparse plan: {e}", file=sys.stderr)
        return 2
    results: list[tuple[ParallelLayout, Plan | PlanError]] = []
    for layout in layouts:
        try:
            results.append((layout, _plan(args, cfg, layout)))
        except PlanError as e:
            results.append((layout, e))
    if args.json:
        rows = [{"layout": layout.describe(), "plan": r.to_dict() if isinstance(r, Plan) else None,
                 "error": None if isinstance(r, Plan) else str(r)} for layout, r in results]
        print(json.dumps({"model": cfg.name, "gpu": args.gpu, "num_gpus": args.num_gpus, "context_len": args.context,
                          "layouts": rows}))
    else:
        print(render_table(cfg.name, args, results))
    return 0 if any(isinstance(r, Plan) for _, r in results) else 2


# --------------------------------------------------------------------------------------------- text output


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB"


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def _table(rows: list[tuple[str, ...]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        out.append("  " + "  ".join(cells).rstrip())
    return out


def render(p: Plan, published_checkpoint_bytes: int | None = None) -> str:
    """The plan as a readable report."""
    i, w = p.inputs, p.weights
    gpu = f"{i.gpu_name} ({_gb(i.device_bytes_per_gpu)} each, vendor spec)" if i.gpu_name else _gb(i.device_bytes_per_gpu)
    layout = i.layout
    lines = [
        f"hisparse plan: {p.model_name} ({p.num_layers} layers: {p.num_csa_layers} CSA, {p.num_hca_layers} HCA), "
        f"{i.num_gpus} x {gpu}, context {i.context_len:,} tokens",
    ]
    if layout is not None:
        lines.append(
            f"layout: {layout.describe()}, {i.replicas} replica(s) of {layout.world} GPUs: {layout.dp} attention DP "
            f"group(s) of {layout.tp} rank(s) each; routed experts "
            + (f"split over {layout.ep} ranks" if layout.expert_parallel else "whole on every rank")
        )
    lines += [
        f"formats: kv {i.kv_format} ({p.kv_entry_bytes} B per SWA/C4/HCA entry), indexer keys {i.index_format} "
        f"({p.index_key_bytes} B), compressor state fp32; hot buffer {p.hot_buffer_slots} + {i.reserved_slots} "
        f"slots per CSA layer",
        "",
        "weights (estimate from the geometry):",
    ]
    rw = p.rank_weights
    rows = [("group", "storage", "params (1e9)", "bytes") + (("one rank",) if rw else ())]
    rows += [(g.name, g.storage, f"{g.num_params / 1e9:.2f}", _gb(g.num_bytes)) + ((_gb(r.num_bytes),) if rw else ())
             for g, r in zip(w.groups, rw.groups if rw else w.groups)]
    rows.append(("served model", "(no MTP block)", f"{w.served_params / 1e9:.2f}", _gb(w.served_bytes))
                + ((_gb(rw.served_bytes),) if rw else ()))
    ckpt = f"+ {w.num_mtp_layers} MTP block" if w.num_mtp_layers else "(no MTP block)"
    rows.append(("checkpoint", ckpt, f"{w.checkpoint_params / 1e9:.2f}", _gb(w.checkpoint_bytes)) + (("",) if rw else ()))
    lines += _table(rows, {2, 3, 4})
    if published_checkpoint_bytes:
        delta = w.checkpoint_bytes / published_checkpoint_bytes - 1
        lines.append(f"  published checkpoint: ~{published_checkpoint_bytes / 1e9:.0f} GB (estimate {delta:+.1%})")
    by_mode = p.weight_bytes_per_gpu_by_mode
    over = f"one rank of {layout.describe()}" if layout is not None else f"served model over {i.num_gpus} GPUs"
    lines.append(
        f"  resident per GPU: packed {_gb(by_mode['packed'])} ({_gib(by_mode['packed'])}), dequantized to bf16 "
        f"{_gb(by_mode['dequantize'])} ({_gib(by_mode['dequantize'])}) ({over}; the budget uses {i.weight_mode})"
    )
    if i.weight_bytes is not None:
        lines.append(f"  the budget uses --weight-bytes {_gb(i.weight_bytes)} instead of the estimate")
    lines += [
        "",
        f"device per GPU: {_gb(i.device_bytes_per_gpu)} - {i.activation_reserve:.0%} activations "
        f"{_gb(p.activation_reserve_bytes_per_gpu)} - weights {_gb(p.weight_bytes_per_gpu)} "
        f"= {_gb(p.kv_budget_bytes_per_gpu)} for KV ({_gb(p.kv_budget_bytes_per_gpu * i.num_gpus)} on {i.num_gpus} GPUs)",
        "",
        f"cache kinds (per request at {i.context_len:,} tokens):",
    ]
    t, f, r = p.bytes_per_token, p.fixed_bytes_per_request, p.request_bytes
    rows = [("kind", "without tier", "with tier", "B/token", "fixed B/request", "per request")]
    rows += [
        ("c4", "device", "host", f"{t.c4:,.2f}", "-", format_bytes(r.c4)),
        ("index_keys", "device", "device", f"{t.index_keys:,.2f}", "-", format_bytes(r.index_keys)),
        ("hca", "device", "device", f"{t.hca:,.2f}", "-", format_bytes(r.hca)),
        ("slot_map", "-", "device", f"{t.slot_map:,.2f}", "-", format_bytes(r.slot_map)),
        ("swa", "device", "device", "-", f"{f.swa:,}", format_bytes(r.swa)),
        ("compressor_state", "device", "device", "-", f"{f.compressor_state:,}", format_bytes(r.compressor_state)),
        ("hot_buffer", "-", "device", "-", f"{f.hot_buffer:,}", format_bytes(r.hot_buffer)),
    ]
    lines += _table(rows, {3, 4, 5})
    ratio = "n/a (nothing fits without the tier)" if p.ratio is None else f"{p.ratio:.2f}x"
    rows = [
        ("", "without tier", "with tier"),
        ("device B/token", f"{t.device_without_tier:,.2f}", f"{t.device_with_tier:,.2f}"),
        ("device bytes/request", format_bytes(r.device_without_tier), format_bytes(r.device_with_tier)),
        ("host bytes/request", "-", format_bytes(r.host_with_tier)),
        ("concurrent requests", f"{p.requests_without_tier:,}", f"{p.requests_with_tier:,}"),
        ("tokens", f"{p.tokens_without_tier:,}", f"{p.tokens_with_tier:,}"),
    ]
    lines += ["", "capacity (all GPUs" + (", distinct requests" if i.kv_copies > 1 else "") + "):"]
    lines += _table(rows, {1, 2})
    if layout is not None:
        ctx = i.context_len
        rows = [
            ("", "without tier", "with tier"),
            ("requests", f"{p.requests_per_gpu_without_tier:,}", f"{p.requests_per_gpu_with_tier:,}"),
            ("tokens", f"{p.requests_per_gpu_without_tier * ctx:,}", f"{p.requests_per_gpu_with_tier * ctx:,}"),
            ("host bytes for C4", "-", _gb(p.host_bytes_per_gpu)),
        ]
        lines += ["", f"per GPU (one rank; weights {_gb(p.weight_bytes_per_gpu)} = {_gib(p.weight_bytes_per_gpu)}, "
                      f"KV budget {_gb(p.kv_budget_bytes_per_gpu)} = {_gib(p.kv_budget_bytes_per_gpu)}; "
                      f"whole model {_gb(p.weight_bytes)}):"]
        lines += _table(rows, {1, 2})
    lines += [
        "",
        f"ratio (tokens with / without tier): {ratio}; per request before rounding {p.request_ratio:.2f}x; "
        f"ceiling as context -> infinity {p.ceiling_ratio:.2f}x",
        f"host memory for C4 entries with the tier: {_gb(p.host_bytes_needed)} ({format_bytes(r.host_with_tier)} per request"
        + (f", one copy on each of its {i.kv_copies} TP ranks)" if i.kv_copies > 1 else ")"),
    ]
    if i.host_memory_bytes is not None:
        verdict = "fits" if p.host_fits else f"EXCEEDED: {p.requests_with_tier_host_limited:,} requests fit"
        lines.append(f"  host memory given: {_gb(i.host_memory_bytes)} -> {verdict}")
    lines += [f"note: {n}" for n in p.notes]
    if layout is None:
        lines.append("assumptions: data-parallel attention (a request's KV on one GPU), weights split evenly over the "
                     "GPUs, MTP block not loaded, C4 entries in host memory only with the tier.")
    else:
        lines.append(f"assumptions: each GPU holds one rank of {layout.describe()} (routed experts / EP, wq_b, sinks, "
                     "wo_a, wo_b / TP, everything else whole), a request's KV on every rank of its DP group, one host "
                     "copy of its C4 entries per such rank, MTP block not loaded, no memory for collectives' buffers.")
    return "\n".join(lines)


def render_table(model_name: str, args: argparse.Namespace, results: list) -> str:
    """One row per layout: replicas, per-GPU weights and KV budget, requests per GPU, tokens on all GPUs."""
    first = next((r for _, r in results if isinstance(r, Plan)), None)
    lines = [f"hisparse plan: {model_name}, {args.num_gpus} x {args.gpu}, context {args.context:,} tokens, "
             f"weights {args.weights}, kv {args.kv_format} / index {args.index_format}"]
    if first is not None:
        lines.append(f"whole model (served): {_gb(first.weight_bytes)} = {_gib(first.weight_bytes)}")
    lines.append("")
    rows = [("layout", "replicas", "weights/GPU", "KV budget/GPU", "req/GPU", "req/GPU tier",
             "tokens", "tokens tier", "host/GPU tier")]
    failures = []
    for layout, r in results:
        if isinstance(r, Plan):
            rows.append((layout.describe(), str(r.inputs.replicas), _gib(r.weight_bytes_per_gpu),
                         _gib(r.kv_budget_bytes_per_gpu), f"{r.requests_per_gpu_without_tier:,}",
                         f"{r.requests_per_gpu_with_tier:,}", f"{r.tokens_without_tier:,}", f"{r.tokens_with_tier:,}",
                         _gb(r.host_bytes_per_gpu)))
        else:
            rows.append((layout.describe(), "-", "-", "-", "-", "-", "-", "-", "-"))
            failures.append(f"{layout.describe()}: {r}")
    lines += _table(rows, set(range(1, 9)))
    lines += ["",
              "tokens: all GPUs, distinct requests (with attention-TP a group's ranks hold the same KV); tier: C4 "
              "entries in host memory (host/GPU: one rank's copy)"]
    lines += [f"does not fit: {f}" for f in failures]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hisparse plan", description=__doc__.splitlines()[0])
    add_flags(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
