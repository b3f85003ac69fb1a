"""Checkpoint loading: a directory of safetensors files (optionally with an index json) -> `V4Model`.

Accepted weight spellings, all mapped onto this project's (= DeepSeek's) names:
- DeepSeek's own (`layers.0.attn.wq_a.weight`, per-expert `ffn.experts.3.w1.weight`, `mtp.*` ignored);
- HF's module names (`model.layers.0.self_attn.q_a_proj.weight`, stacked `mlp.experts.gate_up_proj`);
- what HF `save_pretrained` writes (DeepSeek names under `model.`, `attn.norm` for the KV norm).
FP8 (e4m3) weights with 128x128 block scales and FP4 (e2m1, two per byte) expert weights with
32-wide block scales either stay packed (`weights="packed"`, the default: `model.packed` modules compute
on them) or are dequantized to the model dtype (`weights="dequantize"`, the reference path). Formats:
`kernels.formats`; what stays packed: linears stored as FP8 and routed-expert stacks stored as FP4.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from core.config import WEIGHT_MODES, WEIGHTS_DEQUANTIZE, WEIGHTS_PACKED, ModelConfig
from core.kv_format import AUTO
from core.parallel import WHOLE, ParallelLayout, Shard
from kernels.formats import FP4_BLOCK, FP8_BLOCK, dequant_fp4, dequant_fp8, e8m0_to_float, float_to_e8m0
from model.config import load_config, to_hf_dict, trained_kv_format
from model.model import V4Model
from model.packed import FP4_EXPERTS, FP8, resident_bytes, swap_in_packed
from model.parallel import take_shard
from model.rope import rotaries

__all__ = ["dequant_fp4", "dequant_fp8"]  # the format decoders live in kernels.formats; re-exported for callers

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint that does not match the model; the message names the tensor."""


# Ordered renames from HF spellings to ours; each is (pattern, replacement) applied with re.sub.
_RENAMES: list[tuple[str, str]] = [
    (r"^model\.", ""),
    (r"^embed_tokens\.", "embed."),
    (r"^lm_head\.", "head."),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"\.attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.compressor\.kv_proj\.", ".compressor.wkv."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.compressor\.position_bias$", ".compressor.ape"),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.attn\.kv_proj\.", ".attn.wkv."),
    (r"\.attn\.q_a_proj\.", ".attn.wq_a."),
    (r"\.attn\.q_b_proj\.", ".attn.wq_b."),
    (r"\.attn\.q_a_norm\.", ".attn.q_norm."),
    (r"\.attn\.o_a_proj\.", ".attn.wo_a."),
    (r"\.attn\.o_b_proj\.", ".attn.wo_b."),
    (r"\.attn\.norm\.", ".attn.kv_norm."),  # save_pretrained's spelling of the main KV norm
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.experts\.gate_up_proj$", ".experts.gate_up"),
    (r"\.experts\.down_proj$", ".experts.down"),
]
_RENAMES_RE = [(re.compile(p), r) for p, r in _RENAMES]
_EXPERT = re.compile(r"^(layers\.\d+\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")
_SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
_HC_SCALE = re.compile(r"(attn|ffn)_hc\.scale$")  # hyper-connection parameters, not quantization scales
_IGNORED = re.compile(r"^(mtp\.|model\.mtp\.)")


def canonical_name(name: str) -> str:
    for pat, rep in _RENAMES_RE:
        name = pat.sub(rep, name)
    return name


def _files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from None
        files = sorted({model_dir / f for f in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"{f} is listed in the index but missing")
    return files


_PACKED_DTYPES = ("F8_E4M3", "F8_E8M0")


def checkpoint_is_packed(model_dir: str | Path) -> bool | None:
    """Whether a checkpoint stores FP8/FP4 tensors (read from the safetensors headers only; no weights are
    loaded). None when the directory holds no safetensors files (a config alone)."""
    model_dir = Path(model_dir)
    try:
        files = _files(model_dir)
    except CheckpointError:
        return None
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for k in fh.keys():
                    dtype = fh.get_slice(k).get_dtype()
                    if dtype in _PACKED_DTYPES or (dtype in ("I8", "U8") and _EXPERT.match(canonical_name(k))):
                        return True
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"cannot read {f}: {e}") from None
    return False


def _our_name(raw: str) -> str:
    """A checkpoint tensor's name in our spelling; a quantization scale is named `<module>.scale`."""
    if raw.endswith(_SCALE_SUFFIXES) and not _HC_SCALE.search(raw):
        base = raw[: -len("_scale_inv")] if raw.endswith("_scale_inv") else raw[: -len(".scale")] + ".weight"
        return canonical_name(base)[: -len(".weight")] + ".scale"
    return canonical_name(raw)


def _read_shard(fh, raw: str, cfg: ModelConfig, shard: Shard) -> torch.Tensor | None:
    """Only what `shard` keeps of tensor `raw` (read as a slice; None: another rank's expert)."""
    name = _our_name(raw)
    m = _EXPERT.match(name if not name.endswith(".scale") else name[: -len(".scale")] + ".weight")
    if m:
        first, count = shard.experts(cfg)
        return fh.get_tensor(raw) if first <= int(m.group(2)) < first + count else None
    try:
        whole = fh.get_slice(raw)
        part = take_shard(name, whole, cfg, shard)
        return fh.get_tensor(raw) if part is whole else part
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def read_tensors(model_dir: Path, cfg: ModelConfig | None = None, shard: Shard = WHOLE) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, or with a `shard` (and the model's `cfg`) only that rank's slices: other
    ranks' experts are never read, split projections are read as slices."""
    tensors: dict[str, torch.Tensor] = {}
    for f in _files(model_dir):
        try:
            with safe_open(str(f), framework="pt") as fh:
                for k in fh.keys():
                    if _IGNORED.match(k):  # not served (the multi-token-prediction block)
                        continue
                    if shard.whole:
                        tensors[k] = fh.get_tensor(k)
                    elif (t := _read_shard(fh, k, cfg, shard)) is not None:
                        tensors[k] = t
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"cannot read {f}: {e}") from None
    return tensors


def _check_scale(name: str, t: torch.Tensor, scale: torch.Tensor) -> None:
    """The scale layouts this loader reads: FP8 one per 128x128 tile, FP4 one per 32 inputs."""
    if t.dtype == torch.float8_e4m3fn:
        want = (-(-t.shape[0] // FP8_BLOCK), -(-t.shape[1] // FP8_BLOCK))
        layout = f"one per {FP8_BLOCK}x{FP8_BLOCK} tile"
    elif t.dtype in (torch.int8, torch.uint8):
        want = (*t.shape[:-1], -(-2 * t.shape[-1] // FP4_BLOCK))
        layout = f"one per {FP4_BLOCK} inputs of packed e2m1"
    else:
        raise CheckpointError(f"tensor {name} has a scale but dtype {t.dtype} (expected FP8 or packed FP4)")
    if tuple(scale.shape) != want:
        raise CheckpointError(f"scale of {name} has shape {tuple(scale.shape)}, expected {want} ({layout})")


def _dequant(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return dequant_fp8(t, scale) if t.dtype == torch.float8_e4m3fn else dequant_fp4(t, scale)


def _fp8_packable(module: str, cfg: ModelConfig | None) -> bool:
    # The grouped output projection runs one FP8 linear per group, so groups must end on scale tiles.
    if module.endswith(".attn.wo_a") and cfg is not None and cfg.o_lora_rank % FP8_BLOCK:
        log.info("%s stays dequantized: o_lora_rank %d is not a multiple of %d", module, cfg.o_lora_rank, FP8_BLOCK)
        return False
    return True


def _stack_experts(
    prefix: str, by_id: dict[int, dict[str, tuple]], packed: bool, first: int = 0
) -> tuple[dict[str, torch.Tensor], bool]:
    """Per-expert (w1, w3, w2) -> stacked gate_up/down, kept as FP4 (+ `_scale`) when all of them can be.
    The ids run contiguously from `first` (non-zero on an expert-parallel rank)."""
    ids = sorted(by_id)
    if ids != list(range(first, first + len(ids))):
        raise CheckpointError(f"{prefix}: expert ids are not contiguous from {first} (found {ids[:8]}...)")
    try:
        parts = [[by_id[e][w] for w in ("w1", "w3", "w2")] for e in ids]
    except KeyError as e:
        raise CheckpointError(f"{prefix}: an expert lacks its {e.args[0]} weight") from None
    flat = [p for expert in parts for p in expert]
    if packed and all(s is not None and t.dtype in (torch.int8, torch.uint8) for t, s in flat):
        try:
            flat = [(t.view(torch.int8), float_to_e8m0(s)) for t, s in flat]
        except ValueError:
            log.warning("%s: FP4 scales are not UE8M0 powers of two; these experts are dequantized", prefix)
        else:
            parts = [flat[i : i + 3] for i in range(0, len(flat), 3)]
            out = {}
            for name, pick in (("gate_up", lambda p: torch.cat((p[0], p[1]))), ("down", lambda p: p[2])):
                out[f"{prefix}.{name}"] = torch.stack([pick([t for t, _ in p]) for p in parts])
                out[f"{prefix}.{name}_scale"] = torch.stack([pick([s for _, s in p]) for p in parts])
            return out, True
    dense = [[t if s is None else _dequant(t, s) for t, s in p] for p in parts]
    return {
        f"{prefix}.gate_up": torch.stack([torch.cat((p[0], p[1])) for p in dense]),
        f"{prefix}.down": torch.stack([p[2] for p in dense]),
    }, False


def _to_canonical(
    raw: dict[str, torch.Tensor], weights: str = WEIGHTS_DEQUANTIZE, cfg: ModelConfig | None = None,
    shard: Shard = WHOLE,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Rename, keep packed or dequantize, and stack experts; `mtp.*` dropped.

    Returns (tensors in our names, module path -> packed kind for the modules that stay packed).
    """
    if weights not in WEIGHT_MODES:
        raise ValueError(f"unknown weights mode {weights!r}; expected one of {WEIGHT_MODES}")
    packed = weights == WEIGHTS_PACKED
    scales = {}
    plain = {}
    for name, t in raw.items():
        if _IGNORED.match(name):
            continue
        if name.endswith(_SCALE_SUFFIXES) and not _HC_SCALE.search(name):
            base = name[: -len(".scale")] if name.endswith(".scale") else name[: -len("_scale_inv")]
            scales[base] = t
            continue
        plain[name] = t
    out: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    experts: dict[str, dict[int, dict[str, tuple]]] = defaultdict(lambda: defaultdict(dict))
    for name, t in plain.items():
        stem = name[: -len(".weight")] if name.endswith(".weight") else name
        scale = scales.pop(stem, None)
        if scale is None:
            scale = scales.pop(name, None)
        if scale is not None:
            _check_scale(name, t, scale)
        elif t.dtype == torch.float8_e4m3fn:
            raise CheckpointError(f"FP8 tensor {name} has no block scale ({stem}.scale or {name}_scale_inv)")
        cname = canonical_name(name)
        m = _EXPERT.match(cname)
        if m:
            experts[m.group(1)][int(m.group(2))][m.group(3)] = (t, scale)
            continue
        module = cname[: -len(".weight")] if cname.endswith(".weight") else None
        if scale is not None and packed and t.dtype == torch.float8_e4m3fn and module and _fp8_packable(module, cfg):
            out[cname] = t
            out[f"{module}.scale"] = e8m0_to_float(scale)
            kinds[module] = FP8
        else:
            out[cname] = t if scale is None else _dequant(t, scale)
    if scales:
        raise CheckpointError(f"scale tensors without a weight: {sorted(scales)[:5]}")
    for prefix, by_id in experts.items():
        stacked, kept = _stack_experts(prefix, by_id, packed, shard.experts(cfg)[0] if not shard.whole else 0)
        out.update(stacked)
        if kept:
            kinds[prefix] = FP4_EXPERTS
    return out, kinds


def _copy_state(model: V4Model, got: dict[str, torch.Tensor]) -> None:
    want = model.state_dict()
    missing = sorted(set(want) - set(got))
    unexpected = sorted(set(got) - set(want))
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} tensor(s), first: {missing[:5]}")
    if unexpected:
        raise CheckpointError(f"checkpoint has {len(unexpected)} unexpected tensor(s), first: {unexpected[:5]}")
    for name, target in want.items():
        src = got[name]
        if tuple(src.shape) != tuple(target.shape):
            raise CheckpointError(f"tensor {name}: checkpoint shape {tuple(src.shape)}, model expects {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(src.to(target.dtype))


def load_state(model: V4Model, tensors: dict[str, torch.Tensor], weights: str = WEIGHTS_DEQUANTIZE) -> None:
    """Load checkpoint tensors into a built model; with `weights="packed"` packed modules are swapped in first."""
    got, kinds = _to_canonical(tensors, weights, model.cfg)
    swap_in_packed(model, kinds)
    _copy_state(model, got)


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    device=None,
    name: str | None = None,
    weights: str = WEIGHTS_PACKED,
    kv_format: str | None = None,
    shard: Shard = WHOLE,
) -> V4Model:
    """Build the model from `model_dir/config.json` and load its weights.

    `kv_format` (`core.kv_format`): how KV rows are rounded and stored; None: `bf16`, what the config says;
    `auto`: what the checkpoint was trained for (`model.config.trained_kv_format`).

    `weights`: `packed` (default) keeps the linears the checkpoint stores as FP8 and the routed experts it
    stores as FP4 in those formats, computing on them with `kernels.fp8_linear` / `kernels.fp4_moe`;
    `dequantize` expands them to `dtype` at load (the reference, and today's bf16 memory figures). A
    checkpoint without packed tensors loads the same in both modes. `dtype` applies to everything that is
    not packed (norms, sinks and the like stay fp32).

    `shard` (`core.parallel.Shard`): build and read only one rank's part of the model (its experts, its
    slices of the attention-TP projections); the whole model is never in memory.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory {model_dir} does not exist")
    cfg = load_config(model_dir, name=name)
    if kv_format == AUTO:
        kv_format = trained_kv_format(cfg)
    if kv_format is not None:
        cfg = dataclasses.replace(cfg, kv_format=kv_format)
    if not shard.whole:
        try:
            ParallelLayout(tp=shard.tp).check(cfg)
            if shard.ep > 1:
                ParallelLayout(dp=shard.ep, expert_parallel=True).check(cfg)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
    got, kinds = _to_canonical(read_tensors(model_dir, cfg, shard), weights, cfg, shard)
    model = build_empty(cfg, dtype, device, packed=kinds, shard=shard)
    _copy_state(model, got)
    log.info(
        "loaded %s (%d layers, %.1fM parameters, %d modules packed, %.1f MB resident%s)",
        model_dir, cfg.num_layers, num_params(model) / 1e6, len(kinds), resident_bytes(model) / 1e6,
        "" if shard.whole else f"; shard tp {shard.tp_rank}/{shard.tp}, ep {shard.ep_rank}/{shard.ep}",
    )
    return model.eval()


def build_empty(
    cfg: ModelConfig, dtype: torch.dtype = torch.float32, device=None, packed: dict[str, str] | None = None,
    shard: Shard = WHOLE,
) -> V4Model:
    """A model of `cfg`: dense weights in `dtype` (norms and the like fp32), default-initialised.

    With `packed` (module path -> kind, as the loader decides) those modules are packed ones instead, and
    the model is built on the meta device first so that no dense copy of a packed weight is ever
    allocated: its weights are then uninitialised, to be loaded next.
    """
    target = torch.device(device or "cpu")
    with torch.device("meta" if packed else target):
        model = V4Model(cfg, shard)
    keep_fp32 = ("norm", "attn_sink", "ape", "hc_", "gate.bias")
    for n, p in model.named_parameters():
        if not any(k in n for k in keep_fp32):
            p.data = p.data.to(dtype)
    if packed:
        swap_in_packed(model, packed)
        model.to_empty(device=target)
        # The rotary tables are plain tensors computed at construction, so they were made on meta: redo them.
        with torch.device(target):
            fresh = rotaries(cfg)
        for kind, rot in model.rope.items():
            rot.inv_freq = fresh[kind].inv_freq
        loaded = set(model.state_dict())
        unloaded = [n for n, _ in model.named_buffers() if n not in loaded]
        if unloaded:
            raise RuntimeError(f"non-persistent buffers {unloaded[:3]} would stay uninitialised; rebuild them here")
    return model


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def deepseek_state(model: V4Model) -> dict[str, torch.Tensor]:
    """The model's weights in DeepSeek's checkpoint spelling (per-expert tensors; packed ones keep their
    formats, with UE8M0 scales as `float8_e8m0fnu` wherever the scales are powers of two)."""
    out = {}
    for name, t in model.state_dict().items():
        m = re.match(r"^(layers\.\d+\.ffn\.experts)\.(gate_up|down)(_scale)?$", name)
        if not m:
            out[name] = _scale_for_checkpoint(t) if name.endswith(".scale") else t.contiguous()
            continue
        suffix = "scale" if m.group(3) else "weight"
        for e in range(t.shape[0]):
            parts = dict(zip(("w1", "w3"), t[e].chunk(2, dim=0))) if m.group(2) == "gate_up" else {"w2": t[e]}
            for w, part in parts.items():
                out[f"{m.group(1)}.{e}.{w}.{suffix}"] = _scale_for_checkpoint(part) if m.group(3) else part.contiguous()
    return out


def _scale_for_checkpoint(scale: torch.Tensor) -> torch.Tensor:
    try:
        return float_to_e8m0(scale).contiguous().view(torch.float8_e8m0fnu)
    except ValueError:  # not powers of two (an fp32-scale checkpoint): keep fp32
        return scale.float().contiguous()


def save_checkpoint(model: V4Model, model_dir: str | Path, dtype: torch.dtype | None = None) -> None:
    """Write config.json (HF spelling) and model.safetensors (DeepSeek names); both we and HF read it.

    With `dtype`, floating-point matrices are stored in it (e.g. bf16 to halve the file); norms,
    sinks, position biases, hyper-connection and routing parameters stay fp32, as they load.
    """
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(to_hf_dict(model.cfg), indent=2) + "\n")
    state = {}
    for k, v in deepseek_state(model).items():
        v = v.detach().cpu()
        dense = v.dtype in (torch.float32, torch.float16, torch.bfloat16)  # packed codes and scales keep their dtype
        if dtype is not None and dense and v.dim() >= 2 and not k.startswith("hc_") and ".hc_" not in k and not k.endswith(".scale"):
            v = v.to(dtype)
        state[k] = v.contiguous()
    save_file(state, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
