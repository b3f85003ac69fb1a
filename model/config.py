"""Reading a DeepSeek-V4 `config.json` in either spelling into `core.config.ModelConfig`.

Two spellings exist in the wild: the HuggingFace one (`layer_types`, `compress_rates`,
`rope_parameters`, `mlp_layer_types`, `partial_rotary_factor`) and DeepSeek's own
(`compress_ratios` with 0/4/128 per layer, `compress_rate_csa/hca`, `rope_scaling`,
`qk_rope_head_dim`, `num_hash_layers`). Both map onto the same fields here.
"""

from __future__ import annotations

import json
from pathlib import Path

from core.config import CSA, HASH_MOE, HCA, MOE, SLIDING, ModelConfig, YarnScaling
from core.kv_format import BF16, V4

_HF_LAYER = {
    "sliding_attention": SLIDING,
    "compressed_sparse_attention": CSA,
    "heavily_compressed_attention": HCA,
}
_HF_LAYER_INV = {v: k for k, v in _HF_LAYER.items()}
_USED = {
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "layer_types",
    "compress_rates", "compress_ratios", "compress_rate_csa", "compress_rate_hca", "index_n_heads",
    "index_head_dim", "index_topk", "rope_theta", "compress_rope_theta", "rope_parameters",
    "rope_scaling", "partial_rotary_factor", "qk_rope_head_dim", "max_position_embeddings",
    "rms_norm_eps", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
    "moe_intermediate_size", "scoring_func", "routed_scaling_factor", "mlp_layer_types",
    "num_hash_layers", "swiglu_limit", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "bos_token_id",
    "eos_token_id", "tie_word_embeddings", "num_nextn_predict_layers", "norm_topk_prob",
}


class ConfigError(ValueError):
    """A config.json that cannot describe a DeepSeek-V4 model."""


def _layer_types(raw: dict, n: int) -> tuple[str, ...]:
    if raw.get("layer_types") is not None:
        try:
            types = [_HF_LAYER[t] if t in _HF_LAYER else t for t in raw["layer_types"]]
        except TypeError as e:
            raise ConfigError(f"layer_types must be a list of strings: {e}") from None
    elif raw.get("compress_ratios") is not None:
        csa = raw.get("compress_rate_csa", 4)
        hca = raw.get("compress_rate_hca", 128)
        by_ratio = {0: SLIDING, 1: SLIDING, csa: CSA, hca: HCA}
        try:
            types = [by_ratio[int(r)] for r in raw["compress_ratios"]]
        except KeyError as e:
            raise ConfigError(f"compress_ratios holds {e.args[0]}, expected 0, {csa} or {hca}") from None
    else:
        raise ConfigError(
            "config has neither `layer_types` nor `compress_ratios`; name every layer's attention kind "
            "(a silent default would guess the wrong model)"
        )
    if len(types) < n:
        raise ConfigError(f"{len(types)} layer types for {n} layers")
    # DeepSeek's list carries a trailing entry for the multi-token-prediction block; it is not served.
    return tuple(types[:n])


def _yarn(raw: dict) -> YarnScaling | None:
    rp = raw.get("rope_parameters") or {}
    if isinstance(rp.get("compress"), dict):
        rp = rp["compress"]
    scaling = raw.get("rope_scaling") or rp
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind != "yarn":
        raise ConfigError(f"rope scaling type {kind!r} is not supported; DeepSeek-V4 uses 'yarn'")
    try:
        return YarnScaling(
            factor=float(scaling["factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            beta_fast=float(scaling.get("beta_fast") or 32),
            beta_slow=float(scaling.get("beta_slow") or 1),
            truncate=bool(scaling.get("truncate", True)),
        )
    except KeyError as e:
        raise ConfigError(f"yarn rope scaling lacks {e.args[0]!r}") from None


def parse_config(raw: dict, name: str = "deepseek-v4") -> ModelConfig:
    """Normalise a config dict (HF or DeepSeek spelling) into a `ModelConfig`."""
    try:
        n = int(raw["num_hidden_layers"])
        head_dim = int(raw["head_dim"])
        if raw.get("qk_rope_head_dim") is not None:
            rope_dim = int(raw["qk_rope_head_dim"])
        else:
            rope_dim = int(round(head_dim * float(raw.get("partial_rotary_factor") or 64 / 512)))
        rates = dict(raw.get("compress_rates") or {})
        csa_rate = int(raw.get("compress_rate_csa", rates.get("compressed_sparse_attention", 4)))
        hca_rate = int(raw.get("compress_rate_hca", rates.get("heavily_compressed_attention", 128)))
        if raw.get("mlp_layer_types") is not None:
            mlp = tuple(HASH_MOE if t == "hash_moe" else MOE for t in raw["mlp_layer_types"])[:n]
        else:
            n_hash = int(raw.get("num_hash_layers", 3))
            mlp = tuple(HASH_MOE if i < n_hash else MOE for i in range(n))
        eos = raw.get("eos_token_id", 1)
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        if int(raw.get("num_key_value_heads", 1)) != 1:
            raise ConfigError("DeepSeek-V4 attention has exactly one shared key/value head")
        if raw.get("norm_topk_prob") is False:
            raise ConfigError("norm_topk_prob=false is not supported (V4 always normalises routing weights)")
        raw_types = dict(raw, compress_rate_csa=csa_rate, compress_rate_hca=hca_rate)
        return ModelConfig(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            layer_types=_layer_types(raw_types, n),
            num_heads=int(raw["num_attention_heads"]),
            head_dim=head_dim,
            rope_head_dim=rope_dim,
            q_lora_rank=int(raw["q_lora_rank"]),
            o_groups=int(raw["o_groups"]),
            o_lora_rank=int(raw["o_lora_rank"]),
            sliding_window=int(raw["sliding_window"]),
            csa_rate=csa_rate,
            hca_rate=hca_rate,
            index_n_heads=int(raw.get("index_n_heads", 64)),
            index_head_dim=int(raw.get("index_head_dim", 128)),
            index_topk=int(raw.get("index_topk", 512)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            compress_rope_theta=float(raw.get("compress_rope_theta", 160000.0)),
            yarn=_yarn(raw),
            max_position_embeddings=int(raw.get("max_position_embeddings", 1048576)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            n_routed_experts=int(raw.get("n_routed_experts", 256)),
            num_experts_per_tok=int(raw.get("num_experts_per_tok", 6)),
            n_shared_experts=int(raw.get("n_shared_experts", 1)),
            moe_intermediate_size=int(raw.get("moe_intermediate_size", 2048)),
            scoring_func=str(raw.get("scoring_func", "sqrtsoftplus")),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.5)),
            mlp_layer_types=mlp,
            swiglu_limit=float(raw.get("swiglu_limit") or 0.0),
            hc_mult=int(raw.get("hc_mult", 4)),
            hc_sinkhorn_iters=int(raw.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(raw.get("hc_eps", 1e-6)),
            bos_token_id=raw.get("bos_token_id", 0),
            eos_token_ids=eos_ids,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            name=name,
            extra={k: v for k, v in raw.items() if k not in _USED},
        )
    except KeyError as e:
        raise ConfigError(f"config.json lacks the field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"config.json has a bad value: {e}") from None


def trained_kv_format(cfg: ModelConfig) -> str:
    """The KV format a checkpoint was trained for: `v4` for DeepSeek-V4 checkpoints (recognised by their
    FP8 `quantization_config`, which the quantization-aware trained releases carry), `bf16` otherwise
    (the built-in model and plain test checkpoints)."""
    q = cfg.extra.get("quantization_config")
    return V4 if isinstance(q, dict) and str(q.get("quant_method", "")).lower() == "fp8" else BF16


def load_config(model_dir: str | Path, name: str | None = None) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path} not found: a model directory needs a config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    return parse_config(raw, name=name or Path(model_dir).name)


def to_hf_dict(cfg: ModelConfig) -> dict:
    """The HF spelling of `cfg` (what `transformers` reads and our loader reads back)."""
    compress = {"rope_theta": cfg.compress_rope_theta, "partial_rotary_factor": cfg.rope_head_dim / cfg.head_dim}
    if cfg.yarn is not None:
        compress.update(
            rope_type="yarn",
            factor=cfg.yarn.factor,
            original_max_position_embeddings=cfg.yarn.original_max_position_embeddings,
            beta_fast=cfg.yarn.beta_fast,
            beta_slow=cfg.yarn.beta_slow,
            attention_factor=1.0,
        )
    else:
        compress["rope_type"] = "default"
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": 1,
        "head_dim": cfg.head_dim,
        "partial_rotary_factor": cfg.rope_head_dim / cfg.head_dim,
        "q_lora_rank": cfg.q_lora_rank,
        "o_groups": cfg.o_groups,
        "o_lora_rank": cfg.o_lora_rank,
        "sliding_window": cfg.sliding_window,
        "layer_types": [_HF_LAYER_INV[t] for t in cfg.layer_types],
        "compress_rates": {"compressed_sparse_attention": cfg.csa_rate, "heavily_compressed_attention": cfg.hca_rate},
        "index_n_heads": cfg.index_n_heads,
        "index_head_dim": cfg.index_head_dim,
        "index_topk": cfg.index_topk,
        "rope_theta": cfg.rope_theta,
        "compress_rope_theta": cfg.compress_rope_theta,
        "rope_parameters": {
            "main": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                     "partial_rotary_factor": cfg.rope_head_dim / cfg.head_dim},
            "compress": compress,
        },
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "n_routed_experts": cfg.n_routed_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "n_shared_experts": cfg.n_shared_experts,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "scoring_func": cfg.scoring_func,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "norm_topk_prob": True,
        "mlp_layer_types": [cfg.mlp_kind(i) for i in range(cfg.num_layers)],
        "swiglu_limit": cfg.swiglu_limit,
        "hc_mult": cfg.hc_mult,
        "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters,
        "hc_eps": cfg.hc_eps,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids) if len(cfg.eos_token_ids) != 1 else cfg.eos_token_ids[0],
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "num_nextn_predict_layers": 0,
        "torch_dtype": "float32",
    }


def end_of_sequence_ids(model_dir: str | Path | None, cfg: ModelConfig, tokenizer_eos: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The one set of token ids that end a request: config.json's `eos_token_id`, generation_config.json's
    (an int or a list) and the tokenizer's end-of-sequence token. Computed once when a server or engine
    starts and handed to everything that stops requests."""
    ids = set(cfg.eos_token_ids) | set(tokenizer_eos)
    path = Path(model_dir) / "generation_config.json" if model_dir is not None else None
    if path is not None and path.is_file():
        try:
            eos = json.loads(path.read_text()).get("eos_token_id")
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(i) for i in eos)
    return tuple(sorted(ids))
