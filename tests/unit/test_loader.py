"""Checkpoint loading: spellings, sharding, FP8/FP4 dequantization, and clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.loader import (
    CheckpointError,
    canonical_name,
    deepseek_state,
    dequant_fp4,
    dequant_fp8,
    load_model,
    save_checkpoint,
)


def _copy_dir(src, dst, tensors):
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(tensors, str(dst / "model.safetensors"))


def _same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_builtin_round_trip(tiny_model, tmp_path):
    save_checkpoint(tiny_model, tmp_path)
    _same_weights(tiny_model, load_model(tmp_path))


def test_hf_module_names_load(tiny_dir, tiny_model, tmp_path):
    """HF's in-memory names (`model.layers.0.self_attn.q_a_proj.weight`, stacked experts) map onto ours."""
    hf_names = {}
    inverse = {
        "embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight", "norm.weight": "model.norm.weight",
        "hc_head_fn": "model.hc_head.hc_fn", "hc_head_base": "model.hc_head.hc_base", "hc_head_scale": "model.hc_head.hc_scale",
    }
    swaps = [
        (".attn.indexer.weights_proj.", ".self_attn.compressor.indexer.scorer.weights_proj."),
        (".attn.indexer.wq_b.", ".self_attn.compressor.indexer.q_b_proj."),
        (".attn.indexer.compressor.wkv.", ".self_attn.compressor.indexer.kv_proj."),
        (".attn.indexer.compressor.wgate.", ".self_attn.compressor.indexer.gate_proj."),
        (".attn.indexer.compressor.ape", ".self_attn.compressor.indexer.position_bias"),
        (".attn.indexer.compressor.norm.", ".self_attn.compressor.indexer.kv_norm."),
        (".attn.compressor.wkv.", ".self_attn.compressor.kv_proj."),
        (".attn.compressor.wgate.", ".self_attn.compressor.gate_proj."),
        (".attn.compressor.ape", ".self_attn.compressor.position_bias"),
        (".attn.compressor.norm.", ".self_attn.compressor.kv_norm."),
        (".attn.wq_a.", ".self_attn.q_a_proj."), (".attn.wq_b.", ".self_attn.q_b_proj."),
        (".attn.q_norm.", ".self_attn.q_a_norm."), (".attn.wkv.", ".self_attn.kv_proj."),
        (".attn.kv_norm.", ".self_attn.kv_norm."), (".attn.wo_a.", ".self_attn.o_a_proj."),
        (".attn.wo_b.", ".self_attn.o_b_proj."), (".attn.attn_sink", ".self_attn.sinks"),
        (".attn_norm.", ".input_layernorm."), (".ffn_norm.", ".post_attention_layernorm."),
        (".hc_attn_", ".attn_hc."), (".hc_ffn_", ".ffn_hc."),
        (".ffn.gate.bias", ".mlp.gate.e_score_correction_bias"), (".ffn.gate.", ".mlp.gate."),
        (".ffn.experts.gate_up", ".mlp.experts.gate_up_proj"), (".ffn.experts.down", ".mlp.experts.down_proj"),
        (".ffn.shared_experts.w1.", ".mlp.shared_experts.gate_proj."),
        (".ffn.shared_experts.w2.", ".mlp.shared_experts.down_proj."),
        (".ffn.shared_experts.w3.", ".mlp.shared_experts.up_proj."),
    ]
    for name, t in tiny_model.state_dict().items():
        if name in inverse:
            hf = inverse[name]
        else:
            hf = "model." + name
            for a, b in swaps:
                if a in hf:
                    hf = hf.replace(a, b)
                    break
        assert canonical_name(hf) == name, (hf, name)
        hf_names[hf] = t.contiguous()
    _copy_dir(tiny_dir, tmp_path, hf_names)
    _same_weights(tiny_model, load_model(tmp_path))


def test_sharded_with_index(tiny_dir, tiny_model, tmp_path):
    state = deepseek_state(tiny_model)
    names = sorted(state)
    half = len(names) // 2
    parts = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in parts.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / fname))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: f for f, ks in parts.items() for k in ks}})
    )
    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text())
    _same_weights(tiny_model, load_model(tmp_path))


def _quantize_fp8(w: torch.Tensor, block: int = 128):
    """Synthetic block quantization with power-of-two (e8m0) scales."""
    out, inn = w.shape
    rows, cols = -(-out // block), -(-inn // block)
    scale = torch.empty(rows, cols)
    q = torch.empty_like(w)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * block : (i + 1) * block, j * block : (j + 1) * block]
            s = 2.0 ** torch.ceil(torch.log2(tile.abs().max() / 448.0))
            scale[i, j] = s
            q[i * block : (i + 1) * block, j * block : (j + 1) * block] = tile / s
    return q.to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)


def test_fp8_block_dequant_exact():
    w = torch.randn(200, 300)
    q, s = _quantize_fp8(w)
    deq = dequant_fp8(q, s)
    # exact reference: each tile's fp8 values times its power-of-two scale
    ref = q.float() * s.float().repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    assert torch.equal(deq, ref)
    assert (deq - w).abs().max() <= w.abs().max() * 0.07  # e4m3 keeps ~3 mantissa bits


def test_fp8_weight_in_checkpoint(tiny_dir, tiny_model, tmp_path):
    state = deepseek_state(tiny_model)
    name = "layers.1.attn.wq_b.weight"
    q, s = _quantize_fp8(state[name])
    state[name] = q
    state["layers.1.attn.wq_b.scale"] = s
    _copy_dir(tiny_dir, tmp_path, state)
    got = load_model(tmp_path, weights="dequantize")
    assert torch.equal(got.state_dict()[name], dequant_fp8(q, s))
    # packed (the default): the same codes and scales, kept as they are
    packed = load_model(tmp_path).layers[1].attn.wq_b
    assert packed.weight.dtype == torch.float8_e4m3fn and packed.weight.view(torch.uint8).equal(q.view(torch.uint8))
    assert torch.equal(packed.scale, s.float())
    # HF's spelling of the scale works as well
    state.pop("layers.1.attn.wq_b.scale")
    state["layers.1.attn.wq_b.weight_scale_inv"] = s
    _copy_dir(tiny_dir, tmp_path, state)
    assert torch.equal(load_model(tmp_path, weights="dequantize").state_dict()[name], dequant_fp8(q, s))


def test_fp4_expert_dequant():
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    codes = torch.randint(0, 16, (8, 64))
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    scale = torch.exp2(torch.randint(-3, 3, (8, 2)).float())
    got = dequant_fp4(packed, scale.to(torch.float8_e8m0fnu))
    ref = table[codes] * scale.repeat_interleave(32, 1)
    assert torch.equal(got, ref)


def test_dequantizing_in_strips_gives_the_whole_tensors_values(monkeypatch):
    """The loader decodes packed tensors a strip of rows at a time; strips ending inside the matrix and partial
    last tiles (FP8 both ways, FP4 a short last strip) give what decoding the whole tensor gives."""
    from kernels.formats import quantize_fp4, quantize_fp8
    from model import loader

    monkeypatch.setattr(loader, "DEQUANT_STEP", 1000)  # FP8: one 128-row strip at a time; FP4: 10 rows
    q, s = quantize_fp8(torch.randn(328, 456) * torch.logspace(-3, 3, 328)[:, None])  # a scale of its own per tile row
    out = torch.empty(328, 456, dtype=torch.bfloat16)
    loader._put_dequantized(out, q, s)
    assert torch.equal(out, dequant_fp8(q, s).to(torch.bfloat16))
    codes, scale = quantize_fp4(torch.randn(3, 71, 96) * torch.logspace(-3, 3, 71)[:, None])
    out = torch.empty(3, 71, 96)
    loader._put_dequantized(out, codes, scale)
    assert torch.equal(out, dequant_fp4(codes, scale))


def test_missing_tensor_is_named(tiny_dir, tmp_path):
    state = load_file(str(tiny_dir / "model.safetensors"))
    state.pop("layers.2.attn.compressor.ape")
    _copy_dir(tiny_dir, tmp_path, state)
    with pytest.raises(CheckpointError, match=r"lacks 1 tensor.*layers\.2\.attn\.compressor\.ape"):
        load_model(tmp_path)


def test_unexpected_tensor_is_named(tiny_dir, tmp_path):
    state = load_file(str(tiny_dir / "model.safetensors"))
    state["layers.0.attn.bogus.weight"] = torch.zeros(2)
    state["mtp.0.attn.wq_a.weight"] = torch.zeros(2)  # the MTP block is ignored, not an error
    _copy_dir(tiny_dir, tmp_path, state)
    with pytest.raises(CheckpointError, match=r"1 unexpected tensor.*layers\.0\.attn\.bogus\.weight"):
        load_model(tmp_path)


def test_wrong_shape_is_named(tiny_dir, tmp_path):
    state = load_file(str(tiny_dir / "model.safetensors"))
    state["layers.1.attn.wkv.weight"] = torch.zeros(3, 3)
    _copy_dir(tiny_dir, tmp_path, state)
    with pytest.raises(CheckpointError, match=r"layers\.1\.attn\.wkv\.weight: checkpoint shape \(3, 3\)"):
        load_model(tmp_path)


def test_experts_that_do_not_stack_are_named(tiny_dir, tmp_path):
    state = load_file(str(tiny_dir / "model.safetensors"))
    state["layers.2.ffn.experts.1.w2.weight"] = state["layers.2.ffn.experts.1.w2.weight"][:, :-2].contiguous()
    _copy_dir(tiny_dir, tmp_path, state)
    named = r"layers\.2\.ffn\.experts\.down: expert 1 has w2 of shape \(128, 126\), expert 0 \(128, 128\)"
    with pytest.raises(CheckpointError, match=named):
        load_model(tmp_path)


def test_unreadable_file_is_named(tiny_dir, tmp_path):
    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"\x00not a safetensors file")
    with pytest.raises(CheckpointError, match=r"model\.safetensors is not a safetensors file"):  # found from its length field
        load_model(tmp_path)


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")
    from model.config import ConfigError

    with pytest.raises(ConfigError, match="config.json not found"):
        load_model(tmp_path)


# ------------------------------------------------------------------ host memory while loading

LOAD_PEAK_RATIO = 1.2
"""Most a load may add to the process's anonymous memory, over the bytes of the shard it loads (model included:
on a CPU target the model is host memory)."""


@pytest.mark.slow
@pytest.mark.parametrize("weights,ep,experts", [("packed", 1, 64), ("dequantize", 2, 32)])
def test_a_load_holds_little_more_than_its_shard(weights, ep, experts, tmp_path):
    """A real-format checkpoint with many experts (50-60 MB as loaded), loaded in a fresh interpreter whose
    RssAnon and malloc in-use bytes are sampled during the load (`bench.load_memory`): packed whole, and
    dequantized to bf16 as rank 0 of EP2 (a sharded read, every expert decoded). The loader before it (every
    tensor read, the experts stacked beside them, then copied into the model) measured 1.77x and 3.03x here."""
    from bench.load_memory import measure, write_synthetic

    got = measure(write_synthetic(tmp_path, experts, 512), weights, ep=ep, dtype="bf16")
    assert got["shard_bytes"] > 50e6  # large enough that the interpreter's own allocations are noise
    assert got["ratio"] <= LOAD_PEAK_RATIO, got  # RssAnon
    assert got.get("malloc_ratio", 0.0) <= LOAD_PEAK_RATIO, got  # malloc's own count (glibc), reused memory included
