"""The MTP block in checkpoints: DeepSeek's `mtp.0.*` and the layer-index spelling with HF module names, V3's
fused `eh_proj`, round trips (`save_checkpoint`, `save_mtp` beside untouched main weights), FP8/FP4 packing like
the published checkpoints, the planner's bytes against the loaded block, and checkpoints without one."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from cachetier.planner import estimate_weights
from core.config import WEIGHTS_DEQUANTIZE
from kernels.formats import FP8_BLOCK, quantize_fp8
from model.builtin import random_init, tiny_config
from model.config import to_hf_dict
from model.loader import MTP_FILE, CheckpointError, build_empty, deepseek_state, load_model, save_checkpoint, save_mtp
from model.packed import FP4Experts, FP8Linear, pack_like_checkpoint, resident_bytes
from model.realformat import _checkpoint_dtype, deepseek_config_json, realformat_config


@pytest.fixture(scope="module")
def with_mtp():
    m = build_empty(replace(tiny_config(), vocab_size=300), mtp=True)
    random_init(m, 21)
    return m.eval()


def _same(a, b, prefix=""):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        if k.startswith(prefix):
            assert torch.equal(sa[k], sb[k]), k


def _write(tmp, cfg_json: dict, state: dict) -> None:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(cfg_json))
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"))


def test_round_trip_in_deepseeks_names(with_mtp, tmp_path):
    save_checkpoint(with_mtp, tmp_path)
    names = load_file(str(tmp_path / "model.safetensors")).keys()
    assert {"mtp.0.e_proj.weight", "mtp.0.h_proj.weight", "mtp.0.enorm.weight", "mtp.0.hnorm.weight", "mtp.0.norm.weight",
            "mtp.0.hc_head_fn", "mtp.0.attn.wq_a.weight", "mtp.0.ffn.experts.3.w2.weight", "mtp.0.hc_ffn_fn"} <= set(names)
    assert not any(n.startswith("mtp.0.embed") or n.startswith("mtp.0.head") or "compressor" in n for n in names if n.startswith("mtp."))
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    loaded = load_model(tmp_path, mtp=True)
    _same(with_mtp, loaded)
    assert load_model(tmp_path).mtp is None  # not read unless asked for, as serving without speculation wants


def test_save_mtp_adds_a_file_beside_untouched_main_weights(with_mtp, tmp_path):
    main = build_empty(with_mtp.cfg)
    main.load_state_dict({k: v for k, v in with_mtp.state_dict().items() if not k.startswith("mtp.")})
    save_checkpoint(main, tmp_path)
    assert load_model(tmp_path, mtp=True).mtp is None  # a checkpoint without a block loads as before
    digest = hashlib.sha256((tmp_path / "model.safetensors").read_bytes()).hexdigest()
    save_mtp(with_mtp, tmp_path)
    assert hashlib.sha256((tmp_path / "model.safetensors").read_bytes()).hexdigest() == digest
    assert all(k.startswith("mtp.0.") for k in load_file(str(tmp_path / MTP_FILE)))
    _same(with_mtp, load_model(tmp_path, mtp=True))
    save_checkpoint(main, tmp_path)  # the whole model again: the separate block file is gone with it
    assert not (tmp_path / MTP_FILE).exists() and load_model(tmp_path, mtp=True).mtp is None


_HF_BLOCK = [  # our names inside a block -> HF module names (the loader's renames, inverted)
    (".attn.wq_a.", ".self_attn.q_a_proj."), (".attn.wq_b.", ".self_attn.q_b_proj."), (".attn.q_norm.", ".self_attn.q_a_norm."),
    (".attn.wkv.", ".self_attn.kv_proj."), (".attn.kv_norm.", ".self_attn.kv_norm."), (".attn.wo_a.", ".self_attn.o_a_proj."),
    (".attn.wo_b.", ".self_attn.o_b_proj."), (".attn.attn_sink", ".self_attn.sinks"), (".attn_norm.", ".input_layernorm."),
    (".ffn_norm.", ".post_attention_layernorm."), (".hc_attn_", ".attn_hc."), (".hc_ffn_", ".ffn_hc."),
    (".ffn.gate.bias", ".mlp.gate.e_score_correction_bias"), (".ffn.gate.", ".mlp.gate."),
    (".ffn.experts.gate_up", ".mlp.experts.gate_up_proj"), (".ffn.experts.down", ".mlp.experts.down_proj"),
    (".ffn.shared_experts.w1.", ".mlp.shared_experts.gate_proj."), (".ffn.shared_experts.w2.", ".mlp.shared_experts.down_proj."),
    (".ffn.shared_experts.w3.", ".mlp.shared_experts.up_proj."),
    (".norm.weight", ".shared_head.norm.weight"), (".hc_head_fn", ".hc_head.hc_fn"), (".hc_head_base", ".hc_head.hc_base"),
    (".hc_head_scale", ".hc_head.hc_scale"),
]


def test_the_layer_index_spelling_with_hf_module_names(with_mtp, tmp_path):
    """`model.layers.{num_hidden_layers}.*` as engines and V3's HF repositories name the block, HF module names
    inside it, `shared_head.norm` for its final norm, and copies of the embedding and head that are dropped."""
    n = with_mtp.cfg.num_layers
    state = {}
    for name, t in with_mtp.state_dict().items():
        if not name.startswith("mtp."):
            state[name] = t
            continue
        hf = "." + name[len("mtp.") :]
        for a, b in _HF_BLOCK:
            if a in hf:
                hf = hf.replace(a, b)
                break
        state[f"model.layers.{n}{hf}"] = t
    state[f"model.layers.{n}.embed_tokens.weight"] = with_mtp.embed.weight.clone()  # safetensors stores no shared memory
    state[f"model.layers.{n}.shared_head.head.weight"] = with_mtp.head.weight.clone()
    assert f"model.layers.{n}.self_attn.q_a_proj.weight" in state and f"model.layers.{n}.shared_head.norm.weight" in state
    assert f"model.layers.{n}.mlp.experts.gate_up_proj" in state and f"model.layers.{n}.hc_head.hc_fn" in state
    _write(tmp_path, to_hf_dict(with_mtp.cfg), state)
    _same(with_mtp, load_model(tmp_path, mtp=True))


def test_v3s_fused_eh_proj_is_split_into_e_proj_and_h_proj(with_mtp, tmp_path):
    state = deepseek_state(with_mtp)
    e, h = state.pop("mtp.0.e_proj.weight"), state.pop("mtp.0.h_proj.weight")
    state["mtp.0.eh_proj.weight"] = torch.cat((e, h), dim=1)  # inputs [enorm(embedding) | hnorm(hidden)]
    _write(tmp_path, to_hf_dict(with_mtp.cfg), state)
    _same(with_mtp, load_model(tmp_path, mtp=True))


def _packed_with_mtp():
    cfg = realformat_config()
    model = build_empty(cfg, mtp=True)
    random_init(model, 31)
    return pack_like_checkpoint(model)


@pytest.fixture(scope="module")
def packed_dir(tmp_path_factory):
    """The real-format checkpoint (FP8 / FP4, DeepSeek's names and dtypes) with an MTP block."""
    model = _packed_with_mtp()
    d = tmp_path_factory.mktemp("packed-mtp")
    _write(d, deepseek_config_json(model.cfg), {k: _checkpoint_dtype(k, v) for k, v in deepseek_state(model).items()})
    return d


def test_a_packed_block_stays_packed_and_computes_like_the_dequantized_one(packed_dir):
    packed, dense = load_model(packed_dir, mtp=True), load_model(packed_dir, weights=WEIGHTS_DEQUANTIZE, mtp=True)
    mtp = packed.mtp
    for mod in (mtp.e_proj, mtp.h_proj, mtp.attn.wq_a, mtp.attn.wq_b, mtp.attn.wkv, mtp.attn.wo_b, mtp.ffn.shared_experts.w1):
        assert isinstance(mod, FP8Linear)
    assert isinstance(mtp.ffn.experts, FP4Experts) and isinstance(dense.mtp.e_proj, torch.nn.Linear)
    ids = torch.randint(2, packed.cfg.vocab_size, (30,), generator=torch.Generator().manual_seed(2))
    out = []
    for m in (packed, dense):
        with torch.inference_mode():
            _, _, hidden = m.prefill(ids, hidden_tail=30)
            state = m.mtp.teacher_rings(m, hidden[:-1], ids[1:], torch.tensor([10, 25]), 2)
            out.append(m.draft(state, hidden[[10, 25]], ids[[11, 26]], torch.tensor([10, 25]), 2, with_logits=True)[1])
    assert (out[0] - out[1]).abs().max() < 1e-3 and out[1].abs().max() > 1e-2


def test_a_packed_fused_eh_proj_splits_on_its_scale_tiles(tmp_path):
    model = _packed_with_mtp()
    state = {k: _checkpoint_dtype(k, v) for k, v in deepseek_state(model).items()}
    e, h = model.mtp.e_proj.dequantized(), model.mtp.h_proj.dequantized()
    for k in ("e_proj", "h_proj"):
        state.pop(f"mtp.0.{k}.weight"), state.pop(f"mtp.0.{k}.scale")
    q, s = quantize_fp8(torch.cat((e, h), dim=1))
    state["mtp.0.eh_proj.weight"], state["mtp.0.eh_proj.scale"] = q, s
    _write(tmp_path, deepseek_config_json(model.cfg), state)
    got = load_model(tmp_path, mtp=True).mtp
    hidden = model.cfg.hidden_size
    assert hidden % FP8_BLOCK == 0 and isinstance(got.e_proj, FP8Linear)
    assert torch.equal(got.e_proj.weight.view(torch.uint8), q[:, :hidden].contiguous().view(torch.uint8))
    assert torch.equal(got.h_proj.weight.view(torch.uint8), q[:, hidden:].contiguous().view(torch.uint8))
    dense = load_model(tmp_path, weights=WEIGHTS_DEQUANTIZE, mtp=True).mtp
    assert torch.allclose(dense.e_proj.weight, got.e_proj.dequantized()) and torch.allclose(dense.h_proj.weight, got.h_proj.dequantized())


def test_the_planner_counts_the_loaded_block(packed_dir):
    """`estimate_weights`' MTP bytes are the checkpoint's `mtp.*` bytes exactly, its parameters the block's, and
    a packed load holds those bytes plus what the loader widens (FP8 tile scales to fp32, bf16 norms to fp32)."""
    est = estimate_weights(realformat_config())
    file = load_file(str(packed_dir / "model.safetensors"))
    assert sum(v.numel() * v.element_size() for k, v in file.items() if k.startswith("mtp.")) == est.mtp_bytes
    model = load_model(packed_dir, dtype=torch.bfloat16, mtp=True)
    stored = {k: _checkpoint_dtype(k, v) for k, v in deepseek_state(model).items() if k.startswith("mtp.")}
    assert sum(v.numel() * v.element_size() for v in stored.values()) == est.mtp_bytes
    tiles = sum(m.scale.numel() for m in model.mtp.modules() if isinstance(m, FP8Linear))
    norms = sum(p.numel() for n, p in model.mtp.named_parameters() if n.endswith("norm.weight"))
    assert resident_bytes(model.mtp) == est.mtp_bytes + 3 * tiles + 2 * norms
    dense = build_empty(realformat_config(), mtp=True)
    assert sum(p.numel() for p in dense.mtp.parameters()) + dense.mtp.ffn.gate.bias.numel() == est.mtp_params  # the bias is a buffer


def test_a_partial_block_is_named_and_unread_unless_asked_for(tiny_dir, tmp_path):
    state = load_file(str(tiny_dir / "model.safetensors"))
    state["mtp.0.attn.wq_a.weight"] = torch.zeros(2)
    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text())
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"lacks \d+ tensor.*mtp\."):
        load_model(tmp_path, mtp=True)
    assert load_model(tmp_path).mtp is None
