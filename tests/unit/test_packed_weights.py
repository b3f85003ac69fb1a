"""Packed FP8/FP4 weights: formats, packed modules against their dense counterparts, sharding on tile
boundaries, the real-format checkpoint through the real loader in both modes, and the planner's bytes."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from torch import nn

from core.config import WEIGHTS_DEQUANTIZE
from core.presets import V4_FLASH, V4_PRO
from kernels.formats import (
    E2M1_VALUES,
    FP8_BLOCK,
    dequant_fp4,
    dequant_fp8,
    e8m0_to_float,
    encode_e2m1,
    float_to_e8m0,
    quantize_act_fp8,
    quantize_fp4,
    quantize_fp8,
)
from model.layers import Attention, Experts
from model.loader import CheckpointError, checkpoint_is_packed, deepseek_state, load_model
from model.packed import FP4Experts, FP8Linear, expert_range, resident_bytes, shard_fp8
from model.realformat import realformat_config, write_realformat_checkpoint

LOGIT_ATOL = 1e-4
"""Packed vs dequantized logits on the real-format checkpoint (fp32): the same products summed in another order."""


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------ formats


def test_e2m1_rounds_to_nearest_even_and_saturates():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, 7.0, -100.0, 0.26, 2.49])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.0, 6.0, -6.0, 0.5, 2.0])
    got = torch.tensor(E2M1_VALUES)[encode_e2m1(ties)]
    assert torch.equal(got, want)


def test_fp4_round_trip_is_exact_on_representable_values():
    codes = torch.randint(0, 16, (6, 64), generator=_gen(0))
    scale = torch.exp2(torch.randint(-5, 5, (6, 2), generator=_gen(1)).float())
    values = torch.tensor(E2M1_VALUES)[codes] * scale.repeat_interleave(32, 1)
    packed, s = quantize_fp4(values)
    assert torch.equal(dequant_fp4(packed, s), values.abs() * values.sign())  # -0.0 comes back as 0.0
    assert packed.dtype == torch.int8 and s.dtype == torch.uint8 and packed.shape == (6, 32) and s.shape == (6, 2)


def test_ue8m0_bytes_decode_like_torch_and_extremes():
    b = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    got = e8m0_to_float(b)
    assert torch.equal(got[:6], torch.tensor([2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]))
    assert torch.isnan(got[6])
    assert torch.equal(float_to_e8m0(got[:6]), b[:6])
    with pytest.raises(ValueError, match="powers of two"):
        float_to_e8m0(torch.tensor([0.75]))


def test_quantize_fp8_keeps_tiles_in_range_with_power_of_two_scales():
    w = torch.randn(200, 300, generator=_gen(2)) * torch.logspace(-3, 3, 300)
    q, s = quantize_fp8(w)
    assert s.shape == (2, 3) and torch.equal(s, torch.exp2(torch.log2(s).round()))
    assert (dequant_fp8(q, s) - w).abs().max() <= w.abs().max() * 2**-3  # e4m3 keeps 3 mantissa bits


def test_activation_groups_scale_per_token_and_group():
    x = torch.randn(3, 300, generator=_gen(3))
    x[1, 128:256] *= 1000
    xq, xs = quantize_act_fp8(x)
    assert xs.shape == (3, 3) and xq.dtype == torch.float8_e4m3fn
    back = xq.float() * xs.repeat_interleave(FP8_BLOCK, 1)[:, :300]
    assert ((back - x).abs() <= x.abs() * 2**-3 + 1e-6).all()
    assert xs[1, 1] > 100 * xs[1, 0]


# ------------------------------------------------------------------ packed modules vs dense


def _dense_linear(n_in: int, n_out: int, seed: int) -> nn.Linear:
    lin = nn.Linear(n_in, n_out, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n_out, n_in, generator=_gen(seed)) * n_in**-0.5)
    return lin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_equals_the_dequantized_linear(dtype):
    packed = FP8Linear.from_dense(_dense_linear(300, 200, 0))
    dense = nn.Linear(300, 200, bias=False).to(dtype)
    with torch.no_grad():
        dense.weight.copy_(packed.dequantized())  # exact in bf16 too: e4m3 times a power of two
    x = torch.randn(2, 5, 300, generator=_gen(1)).to(dtype)
    got, want = packed(x), dense(x)
    assert got.shape == (2, 5, 200) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()


def test_w8a8_stays_within_activation_quantization_error():
    packed = FP8Linear.from_dense(_dense_linear(256, 128, 2))
    x = torch.randn(4, 256, generator=_gen(3))
    w8a16 = packed(x)
    packed.act_fp8 = True
    w8a8 = packed(x)
    err = (w8a8 - w8a16).abs().max() / w8a16.abs().max()
    assert 0 < err < 0.05  # activations lose bits (so it differs) but only e4m3's worth


def _dense_experts(e: int, h: int, i: int, seed: int) -> Experts:
    class Geometry:
        n_routed_experts, hidden_size, moe_intermediate_size, swiglu_limit = e, h, i, 10.0

    ex = Experts(Geometry())
    with torch.no_grad():
        ex.gate_up.copy_(torch.randn(e, 2 * i, h, generator=_gen(seed)) * h**-0.5)
        ex.down.copy_(torch.randn(e, h, i, generator=_gen(seed + 1)) * i**-0.5)
    return ex


def _routing(tokens: int, e: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = _gen(seed)
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(tokens)])
    return idx, torch.rand(tokens, k, generator=gen)


def test_fp4_experts_equal_the_dequantized_experts():
    packed = FP4Experts.from_dense(_dense_experts(6, 64, 96, 0))
    dense = _dense_experts(6, 64, 96, 0)
    with torch.no_grad():
        dense.gate_up.copy_(packed.dequantized()[0])
        dense.down.copy_(packed.dequantized()[1])
    x = torch.randn(7, 64, generator=_gen(4))
    idx, w = _routing(7, 6, 2, 5)
    want = dense(x, idx, w)
    assert (packed(x, idx, w) - want).abs().max() <= 1e-5 * want.abs().max()


def test_expert_parallel_ranks_add_up_to_the_whole():
    full = FP4Experts.from_dense(_dense_experts(8, 64, 64, 1))
    x = torch.randn(5, 64, generator=_gen(6))
    idx, w = _routing(5, 8, 3, 7)
    shards = [full.shard(r, 4) for r in range(4)]
    assert [(s.first_expert, s.num_experts) for s in shards] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert torch.equal(shards[2].down_scale, full.down_scale[4:6])
    total = sum(s(x, idx, w) for s in shards)
    assert torch.allclose(total, full(x, idx, w), atol=1e-6)
    with pytest.raises(ValueError, match="do not split evenly"):
        expert_range(8, 0, 3)


def test_packed_forwards_compile_to_one_graph():
    lin = FP8Linear.from_dense(_dense_linear(160, 130, 3))
    ex = FP4Experts.from_dense(_dense_experts(4, 64, 64, 2))
    x = torch.randn(3, 160, generator=_gen(8))
    h = torch.randn(3, 64, generator=_gen(9))
    idx, w = _routing(3, 4, 2, 10)
    assert torch.equal(torch.compile(lin, fullgraph=True, backend="eager")(x), lin(x))
    assert torch.equal(torch.compile(ex, fullgraph=True, backend="eager")(h, idx, w), ex(h, idx, w))


def test_packed_wo_a_gives_the_dense_grouped_output():
    cfg = realformat_config()
    attn = Attention(cfg, 0)
    with torch.no_grad():
        for p in attn.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=_gen(11)) * p.shape[-1] ** -0.5)
    o = torch.randn(3, cfg.num_heads, cfg.head_dim, generator=_gen(12))
    for name in ("wo_a", "wo_b"):
        setattr(attn, name, FP8Linear.from_dense(getattr(attn, name)))
    got = attn.output(o, lambda t: t)
    for name in ("wo_a", "wo_b"):
        lin = nn.Linear(1, 1, bias=False)
        lin.weight = nn.Parameter(getattr(attn, name).dequantized())
        setattr(attn, name, lin)
    want = attn.output(o, lambda t: t)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


# ------------------------------------------------------------------ tensor-parallel cuts on tile boundaries


@pytest.mark.parametrize("dim", [0, 1])
def test_fp8_shards_keep_whole_tiles_and_add_up(dim):
    full = FP8Linear.from_dense(_dense_linear(328, 456, 4))  # 4 x 3 tiles, both last tiles partial
    x = torch.randn(3, 328, generator=_gen(13))
    world = 4 if dim == 0 else 3
    shards = [full.shard(dim, r, world) for r in range(world)]
    widths = [s.weight.shape[dim] for s in shards]
    assert widths == ([128, 128, 128, 72] if dim == 0 else [128, 128, 72])
    lo = 0
    for s, width in zip(shards, widths):
        assert torch.equal(s.dequantized(), full.dequantized().narrow(dim, lo, width))  # scales travelled along
        lo += width
    if dim == 0:  # column parallel: each rank owns outputs
        got = torch.cat([s(x) for s in shards], dim=-1)
    else:  # row parallel: each rank owns inputs, partial sums add up
        cuts = torch.tensor(widths).cumsum(0).tolist()
        got = sum(s(x[:, c - w : c]) for s, w, c in zip(shards, widths, cuts))
    assert (got - full(x)).abs().max() <= 1e-5 * full(x).abs().max()


def test_fp8_cut_off_the_tiles_is_refused():
    full = FP8Linear.from_dense(_dense_linear(128, 384, 5))  # 3 row tiles
    with pytest.raises(ValueError, match="3 tiles of 128, which do not split into 2"):
        shard_fp8(full.weight, full.scale, 0, 0, 2)


# ------------------------------------------------------------------ the real-format checkpoint through the loader


@pytest.fixture(scope="module")
def realformat_dir(tmp_path_factory):
    return write_realformat_checkpoint(tmp_path_factory.mktemp("realformat"))


def _header(path) -> dict:
    raw = path.read_bytes()
    return json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])


def test_realformat_checkpoint_uses_deepseeks_names_dtypes_and_scale_layouts(realformat_dir):
    head = _header(realformat_dir / "model.safetensors")
    cfg = json.loads((realformat_dir / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128] and cfg["expert_dtype"] == "fp4"
    assert cfg["compress_ratios"] == [0, 4, 16, 4, 0]  # DeepSeek spelling, with the MTP slot
    assert head["layers.1.attn.wq_b.weight"] == {**head["layers.1.attn.wq_b.weight"], "dtype": "F8_E4M3", "shape": [512, 128]}
    assert head["layers.1.attn.wq_b.scale"]["dtype"] == "F8_E8M0" and head["layers.1.attn.wq_b.scale"]["shape"] == [4, 1]
    assert head["layers.1.ffn.experts.7.w2.weight"]["dtype"] == "I8" and head["layers.1.ffn.experts.7.w2.weight"]["shape"] == [256, 64]
    assert head["layers.1.ffn.experts.7.w2.scale"]["dtype"] == "F8_E8M0" and head["layers.1.ffn.experts.7.w2.scale"]["shape"] == [256, 4]
    assert head["layers.1.ffn.shared_experts.w1.weight"]["dtype"] == "F8_E4M3"
    assert head["layers.1.attn.indexer.wq_b.scale"]["shape"] == [2, 1]
    assert head["embed.weight"]["dtype"] == "BF16" and head["layers.1.attn.compressor.wkv.weight"]["dtype"] == "BF16"
    assert head["layers.1.attn.attn_sink"]["dtype"] == "F32" and head["layers.0.ffn.gate.tid2eid"]["dtype"] == "I64"
    assert not any(k.startswith("model.") for k in head)
    assert checkpoint_is_packed(realformat_dir) is True


def test_packed_is_the_default_and_keeps_the_checkpoint_bytes(realformat_dir):
    packed = load_model(realformat_dir)
    dense = load_model(realformat_dir, weights=WEIGHTS_DEQUANTIZE)
    attn, ffn = packed.layers[1].attn, packed.layers[1].ffn
    for mod in (attn.wq_a, attn.wq_b, attn.wkv, attn.wo_a, attn.wo_b, attn.indexer.wq_b, ffn.shared_experts.w1):
        assert isinstance(mod, FP8Linear)
    assert isinstance(ffn.experts, FP4Experts) and isinstance(attn.compressor.wkv, nn.Linear)
    assert isinstance(dense.layers[1].attn.wq_b, nn.Linear) and isinstance(dense.layers[1].ffn.experts, Experts)
    # the packed codes are the file's, byte for byte
    from safetensors import safe_open

    with safe_open(str(realformat_dir / "model.safetensors"), framework="pt") as fh:
        raw = fh.get_tensor("layers.1.ffn.experts.3.w2.weight")
    assert torch.equal(ffn.experts.down[3], raw)
    assert resident_bytes(packed) < 0.3 * resident_bytes(dense)


def test_packed_and_dequantized_logits_agree(realformat_dir):
    packed = load_model(realformat_dir)
    dense = load_model(realformat_dir, weights=WEIGHTS_DEQUANTIZE)
    ids = torch.randint(2, packed.cfg.vocab_size, (40,), generator=_gen(14))
    lp, layout_p = packed.prefill(ids)
    ld, layout_d = dense.prefill(ids)
    assert (lp - ld).abs().max() <= LOGIT_ATOL and ld.abs().max() > 1
    assert torch.equal(lp.argmax(-1), ld.argmax(-1))
    for tok in (5, 9):
        sp, sd = packed.decode_layouts([layout_p], [tok]), dense.decode_layouts([layout_d], [tok])
        assert (sp - sd).abs().max() <= LOGIT_ATOL


def test_a_packed_model_saves_back_to_the_same_checkpoint(realformat_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    packed = load_model(realformat_dir)
    state = {k: v.contiguous() for k, v in deepseek_state(packed).items()}
    original = load_file(str(realformat_dir / "model.safetensors"))
    for k in ("layers.1.attn.wq_b.scale", "layers.3.ffn.experts.5.w3.weight", "layers.3.ffn.experts.5.w3.scale"):
        assert state[k].dtype == original[k].dtype and torch.equal(state[k].view(torch.uint8), original[k].view(torch.uint8))
    (tmp_path / "config.json").write_text((realformat_dir / "config.json").read_text())
    save_file(state, str(tmp_path / "model.safetensors"))
    again = load_model(tmp_path)
    for (k, a), b in zip(packed.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a, b.view(torch.uint8) if b.element_size() == 1 else b), k


def test_what_cannot_stay_packed_is_dequantized(tiny_dir, tiny_model, tmp_path):
    """wo_a with o_lora 32 (groups off the 128-row tiles) and FP4 experts with non-power-of-two scales."""
    from safetensors.torch import save_file

    state = deepseek_state(tiny_model)
    q, s = quantize_fp8(state["layers.1.attn.wo_a.weight"])
    state["layers.1.attn.wo_a.weight"], state["layers.1.attn.wo_a.scale"] = q, s
    for e in range(tiny_model.cfg.n_routed_experts):
        for w in ("w1", "w2", "w3"):
            packed, scale = quantize_fp4(state[f"layers.2.ffn.experts.{e}.{w}.weight"])
            state[f"layers.2.ffn.experts.{e}.{w}.weight"] = packed
            state[f"layers.2.ffn.experts.{e}.{w}.scale"] = e8m0_to_float(scale) * 1.5
    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text())
    save_file(state, str(tmp_path / "model.safetensors"))
    got = load_model(tmp_path)
    assert isinstance(got.layers[1].attn.wo_a, nn.Linear) and torch.equal(got.layers[1].attn.wo_a.weight, dequant_fp8(q, s))
    assert isinstance(got.layers[2].ffn.experts, Experts)


def test_bad_mode_and_bad_scale_layout_are_named(realformat_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    with pytest.raises(ValueError, match="unknown weights mode 'bf16'"):
        load_model(realformat_dir, weights="bf16")
    state = load_file(str(realformat_dir / "model.safetensors"))
    state["layers.1.attn.wq_b.scale"] = state["layers.1.attn.wq_b.scale"][:2]
    (tmp_path / "config.json").write_text((realformat_dir / "config.json").read_text())
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"scale of layers\.1\.attn\.wq_b\.weight has shape \(2, 1\), expected \(4, 1\)"):
        load_model(tmp_path)


def test_an_unpacked_checkpoint_loads_the_same_in_both_modes(tiny_dir, tiny_model):
    assert checkpoint_is_packed(tiny_dir) is False
    packed_mode = load_model(tiny_dir)
    assert all(torch.equal(a, b) for a, b in zip(packed_mode.state_dict().values(), tiny_model.state_dict().values()))


# ------------------------------------------------------------------ the planner's weight bytes


def test_planner_reports_packed_and_dequantized_bytes_per_gpu():
    from cachetier.planner import PlanInputs, estimate_weights, plan

    for cfg in (V4_FLASH, V4_PRO):
        packed, dense = estimate_weights(cfg), estimate_weights(cfg, weights=WEIGHTS_DEQUANTIZE)
        assert packed.served_params == dense.served_params
        assert 3.5 < dense.served_bytes / packed.served_bytes < 4.0  # FP4 experts dominate: ~0.53 B -> 2 B
    p = plan(V4_FLASH, PlanInputs(context_len=131072, device_bytes_per_gpu=141 * 10**9))
    by_mode = p.weight_bytes_per_gpu_by_mode
    assert by_mode["packed"] == p.weight_bytes_per_gpu
    assert 17e9 < by_mode["packed"] < 21e9 and 65e9 < by_mode["dequantize"] < 75e9  # research note: 18.1 / 66.2 GiB
    d = plan(V4_FLASH, PlanInputs(context_len=131072, device_bytes_per_gpu=141 * 10**9, weights=WEIGHTS_DEQUANTIZE))
    assert d.weight_bytes_per_gpu == by_mode["dequantize"] and d.requests_with_tier < p.requests_with_tier
    unpacked = plan(V4_FLASH, PlanInputs(context_len=131072, device_bytes_per_gpu=141 * 10**9, checkpoint_packed=False))
    assert unpacked.weight_bytes_per_gpu == by_mode["dequantize"] and any("no FP8/FP4" in n for n in unpacked.notes)


def test_plan_command_reads_packedness_from_the_checkpoint(realformat_dir, tiny_dir, capsys):
    from hisparse import plan_cmd

    def run(model: str) -> dict:
        assert plan_cmd.main(["--model", str(model), "--gpu", "1GB", "--context", "4K", "--num-gpus", "1", "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    packed, plain = run(realformat_dir), run(tiny_dir)
    assert packed["weights"]["mode"] == "packed" and plain["weights"]["mode"] == "dequantize"
    w = packed["weights"]
    assert w["bytes_used"] == w["served_bytes"] < w["dequantized_served_bytes"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine the script runs its checks instead")
def test_gpu_check_script_says_when_there_is_no_cuda(capsys):
    from bench import gpu_check_weights

    gpu_check_weights.main([])
    out = json.loads(capsys.readouterr().out)
    assert out["cuda"] is False and out["checks"] == [] and "no CUDA" in out["message"]
