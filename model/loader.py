"""Checkpoint loading: a directory of safetensors files (optionally with an index json) -> `V4Model`.

Accepted weight spellings, all mapped onto this project's (= DeepSeek's) names:
- DeepSeek's own (`layers.0.attn.wq_a.weight`, per-expert `ffn.experts.3.w1.weight`, `mtp.*` ignored);
- HF's module names (`model.layers.0.self_attn.q_a_proj.weight`, stacked `mlp.experts.gate_up_proj`);
- what HF `save_pretrained` writes (DeepSeek names under `model.`, `attn.norm` for the KV norm).
FP8 (e4m3) weights with 128x128 block scales and FP4 (e2m1, two per byte) expert weights with
32-wide block scales are dequantized on load.
"""

from __future__ import annotations

import json
import logging
import re
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from core.config import ModelConfig
from model.config import load_config, to_hf_dict
from model.model import V4Model

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
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def canonical_name(name: str) -> str:
    for pat, rep in _RENAMES_RE:
        name = pat.sub(rep, name)
    return name


def _scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        return scale.float()
    if scale.dtype == torch.uint8:  # raw e8m0 exponents
        return torch.exp2(scale.float() - 127)
    return scale.float()


def dequant_fp8(weight: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """e4m3 weight [out, in] with one scale per block x block tile -> fp32."""
    s = _scale_to_float(scale)
    out, inn = weight.shape
    s = s.repeat_interleave(block, 0)[:out].repeat_interleave(block, 1)[:, :inn]
    return weight.float() * s


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """e2m1 pairs packed in int8 [out, in/2] (low nibble first) with one scale per `block` inputs -> fp32."""
    b = packed.view(torch.uint8)
    lo, hi = (b & 0x0F).long(), (b >> 4).long()
    vals = _E2M1.to(packed.device)[torch.stack((lo, hi), dim=-1).flatten(-2)]  # [out, in]
    s = _scale_to_float(scale).repeat_interleave(block, dim=-1)[..., : vals.shape[-1]]
    return vals * s


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


def read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in _files(model_dir):
        try:
            with safe_open(str(f), framework="pt") as fh:
                for k in fh.keys():
                    tensors[k] = fh.get_tensor(k)
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"cannot read {f}: {e}") from None
    return tensors


def _to_canonical(raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename, dequantize and stack experts; scales are consumed, `mtp.*` dropped."""
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
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    for name, t in plain.items():
        stem = name[: -len(".weight")] if name.endswith(".weight") else name
        scale = scales.pop(stem, None)
        if scale is None:
            scale = scales.pop(name, None)
        if scale is not None:
            if t.dtype == torch.float8_e4m3fn:
                t = dequant_fp8(t, scale)
            elif t.dtype in (torch.int8, torch.uint8):
                t = dequant_fp4(t, scale)
            else:
                raise CheckpointError(f"tensor {name} has a scale but dtype {t.dtype} (expected FP8 or packed FP4)")
        elif t.dtype == torch.float8_e4m3fn:
            raise CheckpointError(f"FP8 tensor {name} has no block scale ({stem}.scale or {name}_scale_inv)")
        cname = canonical_name(name)
        m = _EXPERT.match(cname)
        if m:
            experts[m.group(1)][int(m.group(2))][m.group(3)] = t
        else:
            out[cname] = t
    if scales:
        raise CheckpointError(f"scale tensors without a weight: {sorted(scales)[:5]}")
    for prefix, by_id in experts.items():
        ids = sorted(by_id)
        if ids != list(range(len(ids))):
            raise CheckpointError(f"{prefix}: expert ids are not contiguous from 0 (found {ids[:8]}...)")
        try:
            out[f"{prefix}.gate_up"] = torch.stack([torch.cat((by_id[e]["w1"], by_id[e]["w3"])) for e in ids])
            out[f"{prefix}.down"] = torch.stack([by_id[e]["w2"] for e in ids])
        except KeyError as e:
            raise CheckpointError(f"{prefix}: an expert lacks its {e.args[0]} weight") from None
    return out


def load_state(model: V4Model, tensors: dict[str, torch.Tensor]) -> None:
    want = model.state_dict()
    got = _to_canonical(tensors)
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


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32, device=None, name: str | None = None) -> V4Model:
    """Build the model from `model_dir/config.json` and load its weights."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory {model_dir} does not exist")
    cfg = load_config(model_dir, name=name)
    model = build_empty(cfg, dtype, device)
    load_state(model, read_tensors(model_dir))
    log.info("loaded %s (%d layers, %.1fM parameters)", model_dir, cfg.num_layers, num_params(model) / 1e6)
    return model.eval()


def build_empty(cfg: ModelConfig, dtype: torch.dtype = torch.float32, device=None) -> V4Model:
    with torch.device(device or "cpu"):
        model = V4Model(cfg)
    keep_fp32 = ("norm", "attn_sink", "ape", "hc_", "gate.bias")
    for n, p in model.named_parameters():
        if not any(k in n for k in keep_fp32):
            p.data = p.data.to(dtype)
    return model


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def deepseek_state(model: V4Model) -> dict[str, torch.Tensor]:
    """The model's weights in DeepSeek's checkpoint spelling (per-expert tensors)."""
    out = {}
    for name, t in model.state_dict().items():
        m = re.match(r"^(layers\.\d+\.ffn\.experts)\.(gate_up|down)$", name)
        if not m:
            out[name] = t.contiguous()
            continue
        for e in range(t.shape[0]):
            if m.group(2) == "gate_up":
                w1, w3 = t[e].chunk(2, dim=0)
                out[f"{m.group(1)}.{e}.w1.weight"] = w1.contiguous()
                out[f"{m.group(1)}.{e}.w3.weight"] = w3.contiguous()
            else:
                out[f"{m.group(1)}.{e}.w2.weight"] = t[e].contiguous()
    return out


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
        if dtype is not None and v.is_floating_point() and v.dim() >= 2 and not k.startswith("hc_") and ".hc_" not in k:
            v = v.to(dtype)
        state[k] = v.contiguous()
    save_file(state, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
