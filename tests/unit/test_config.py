"""Config parsing: DeepSeek's spelling and HF's give the same model; bad configs fail clearly."""

from __future__ import annotations

import json

import pytest

from core.presets import V4_FLASH, V4_PRO
from model.config import ConfigError, load_config, parse_config, to_hf_dict


def _deepseek_spelling(flash: bool) -> dict:
    n = 43 if flash else 61
    first = [0, 0] if flash else [128, 128]
    ratios = first + [4 if i % 2 == 0 else 128 for i in range(2, n)] + [0]  # trailing MTP slot
    return {
        "vocab_size": 129280, "hidden_size": 4096 if flash else 7168, "num_hidden_layers": n,
        "num_attention_heads": 64 if flash else 128, "num_key_value_heads": 1, "head_dim": 512,
        "qk_rope_head_dim": 64, "q_lora_rank": 1024 if flash else 1536, "o_groups": 8 if flash else 16,
        "o_lora_rank": 1024, "sliding_window": 128, "compress_ratios": ratios, "compress_rope_theta": 160000,
        "rope_theta": 10000, "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                                              "beta_fast": 32, "beta_slow": 1},
        "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512 if flash else 1024,
        "n_routed_experts": 256 if flash else 384, "num_experts_per_tok": 6, "n_shared_experts": 1,
        "moe_intermediate_size": 2048 if flash else 3072, "scoring_func": "sqrtsoftplus",
        "routed_scaling_factor": 1.5 if flash else 2.5, "norm_topk_prob": True, "num_hash_layers": 3,
        "swiglu_limit": 10.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 1,
        "bos_token_id": 0, "eos_token_id": 1, "expert_dtype": "fp4",
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
    }


@pytest.mark.parametrize("flash", [True, False])
def test_deepseek_spelling_matches_published_geometry(flash):
    preset = V4_FLASH if flash else V4_PRO
    cfg = parse_config(_deepseek_spelling(flash), name=preset.name)
    assert cfg == preset
    assert len(cfg.csa_layers) == (21 if flash else 30)
    assert len(cfg.hca_layers) == (20 if flash else 31)
    assert cfg.yarn is not None and cfg.yarn.factor == 16.0
    assert "quantization_config" in cfg.extra


@pytest.mark.parametrize("preset", [V4_FLASH, V4_PRO])
def test_hf_spelling_round_trip(preset):
    assert parse_config(to_hf_dict(preset), name=preset.name) == preset


def test_hf_nested_rope_parameters_and_legacy_rates():
    raw = to_hf_dict(V4_FLASH)
    raw.pop("compress_rates")
    raw["compress_rate_csa"], raw["compress_rate_hca"] = 4, 64
    raw["layer_types"] = None
    raw["compress_ratios"] = [0, 0] + [4 if i % 2 == 0 else 64 for i in range(2, 43)]
    cfg = parse_config(raw)
    assert cfg.hca_rate == 64 and len(cfg.hca_layers) == 20


def test_missing_layer_kinds_is_an_error():
    raw = to_hf_dict(V4_FLASH)
    raw.pop("layer_types")
    with pytest.raises(ConfigError, match="layer_types"):
        parse_config(raw)


def test_missing_field_and_bad_json(tmp_path):
    raw = to_hf_dict(V4_FLASH)
    raw.pop("head_dim")
    with pytest.raises(ConfigError, match="head_dim"):
        parse_config(raw)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(to_hf_dict(V4_FLASH), rope_parameters={
        "main": {"rope_type": "default"}, "compress": {"rope_type": "longrope", "factor": 2}})))
    with pytest.raises(ConfigError, match="longrope"):
        load_config(tmp_path)
