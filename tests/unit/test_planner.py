"""The capacity planner reproduces the published V4 KV figures and answers `hisparse plan` correctly."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cachetier import planner
from cachetier.planner import PlanError, PlanInputs, compressor_state_bytes, estimate_weights, plan
from core.config import CSA, HCA, SLIDING, ModelConfig
from core.presets import V4_FLASH, V4_PRO
from hisparse import plan_cmd

ROOT = Path(__file__).resolve().parents[2]
GiB, MiB, KiB = 2**30, 2**20, 2**10
ONE_M = 2**20


def _device_bytes_per_token(cfg, kv, idx) -> float:
    return planner.token_bytes(cfg, kv, idx).device_without_tier


# ------------------------------------------------------------------ the published figures (v4-attention.md, section 6)


@pytest.mark.parametrize("cfg", [V4_FLASH, V4_PRO], ids=["flash", "pro"])
def test_entry_formats(cfg):
    assert planner.kv_entry_bytes(cfg, "bf16") == 1024
    assert planner.kv_entry_bytes(cfg, "fp8") == 584  # 448 e4m3 + 64 bf16 rope + 7 scales + 1 pad
    assert planner.index_key_bytes(cfg, "bf16") == 256
    assert planner.index_key_bytes(cfg, "fp8") == 132
    assert planner.index_key_bytes(cfg, "fp4") == 68


def test_layer_counts_of_the_presets():
    assert (len(V4_FLASH.csa_layers), len(V4_FLASH.hca_layers), V4_FLASH.num_layers) == (21, 20, 43)
    assert (len(V4_PRO.csa_layers), len(V4_PRO.hca_layers), V4_PRO.num_layers) == (30, 31, 61)


@pytest.mark.parametrize(
    "cfg, kv, idx, published, gib_at_1m",
    [
        (V4_FLASH, "bf16", "bf16", 6880, 6.72),
        (V4_FLASH, "fp8", "fp4", 3514, 3.43),
        (V4_FLASH, "fp8", "fp8", 3850, 3.76),
        (V4_PRO, "bf16", "bf16", 9848, 9.62),
        (V4_PRO, "fp8", "fp4", 5031, 4.91),
        (V4_PRO, "fp8", "fp8", 5511, 5.38),
    ],
)
def test_published_bytes_per_token_and_totals(cfg, kv, idx, published, gib_at_1m):
    per_token = _device_bytes_per_token(cfg, kv, idx)
    # The table rounds: the HCA term (#HCA x entry / 128) has a fraction with the 584-byte rows.
    assert round(per_token) == published
    assert abs(per_token - published) < 0.5
    r = planner.request_bytes(cfg, ONE_M, kv, idx, 2 * cfg.index_topk, 8)
    proportional = r.c4 + r.index_keys + r.hca
    assert proportional == per_token * ONE_M  # 2^20 is a multiple of both rates: no partial entries
    assert round(proportional / GiB, 2) == gib_at_1m


def test_exact_per_token_fractions():
    assert _device_bytes_per_token(V4_FLASH, "fp8", "fp4") == 21 * (584 + 68) / 4 + 20 * 584 / 128 == 3514.25
    assert _device_bytes_per_token(V4_PRO, "fp8", "fp4") == 5031.4375


def test_pro_mxfp4_total_in_decimal_gigabytes():
    r = planner.request_bytes(V4_PRO, ONE_M, "fp8", "fp4", 2048, 8)
    assert round((r.c4 + r.index_keys + r.hca) / 1e9, 2) == 5.28


@pytest.mark.parametrize(
    "cfg, kv, swa_mib",
    [(V4_FLASH, "bf16", 5.4), (V4_FLASH, "fp8", 3.1), (V4_PRO, "bf16", 7.6), (V4_PRO, "fp8", 4.35)],
)
def test_constant_swa_part(cfg, kv, swa_mib):
    fixed = planner.fixed_bytes(cfg, kv, 2 * cfg.index_topk, 8)
    assert fixed.swa == cfg.num_layers * 128 * planner.kv_entry_bytes(cfg, kv)
    # The spec's table says 4.4 MiB for Pro with 584-byte rows: 61 x 128 x 584 B = 4.349 MiB, i.e. 4.35
    # rounded once more. The other three figures round directly.
    assert round(fixed.swa / MiB, len(str(swa_mib).split(".")[1])) == swa_mib


@pytest.mark.parametrize("cfg", [V4_FLASH, V4_PRO], ids=["flash", "pro"])
def test_compressor_rings_are_64_16_512_kib(cfg):
    s = compressor_state_bytes(cfg)
    assert (s.csa_main, s.csa_indexer, s.hca) == (64 * KiB, 16 * KiB, 512 * KiB)


def test_compressor_state_totals_per_request():
    flash = planner.fixed_bytes(V4_FLASH, "fp8", 1024, 8).compressor_state
    pro = planner.fixed_bytes(V4_PRO, "fp8", 2048, 8).compressor_state
    assert flash == 21 * 80 * KiB + 20 * 512 * KiB and round(flash / MiB, 1) == 11.6
    assert pro == 30 * 80 * KiB + 31 * 512 * KiB and round(pro / MiB, 1) == 17.8


def test_v32_comparison_ratios():
    # V3.2: 61 layers, one 576-wide MLA latent (512 e4m3 + 4 fp32 scales + 64 bf16 rope = 656 B) and a
    # 128-wide FP8 indexer key (132 B) per layer and token.
    v32_fp8 = 61 * ((512 + 4 * 4 + 64 * 2) + 132)
    assert v32_fp8 == 48068
    assert round(v32_fp8 * ONE_M / 1e9, 1) == 50.4
    pro = _device_bytes_per_token(V4_PRO, "fp8", "fp4")
    flash = _device_bytes_per_token(V4_FLASH, "fp8", "fp4")
    assert round(v32_fp8 / pro, 2) == 9.55
    assert round(v32_fp8 / flash, 1) == 13.7
    assert round(100 * pro / v32_fp8, 1) == 10.5
    v32_bf16 = 61 * (576 + 128) * 2
    assert v32_bf16 == 85888 and round(v32_bf16 * ONE_M / GiB, 2) == 83.88
    assert round(v32_bf16 / _device_bytes_per_token(V4_PRO, "bf16", "bf16"), 2) == 8.72


# ------------------------------------------------------------------ weights


def test_weight_estimate_lands_near_the_published_checkpoints():
    flash, pro = estimate_weights(V4_FLASH), estimate_weights(V4_PRO)
    assert abs(flash.checkpoint_bytes / 160e9 - 1) < 0.01
    assert abs(pro.checkpoint_bytes / 865e9 - 1) < 0.01
    # Parameter counts match the paper's 284B and 1.6T totals.
    assert abs(flash.served_params / 284e9 - 1) < 0.01
    assert abs(pro.checkpoint_params / 1.6e12 - 1) < 0.01
    # Serving leaves the MTP block out.
    assert flash.served_bytes < flash.checkpoint_bytes and estimate_weights(V4_FLASH, 0).mtp_bytes == 0


# ------------------------------------------------------------------ the plan on a case small enough to check by hand


def _small() -> ModelConfig:
    return ModelConfig(
        name="small", vocab_size=64, hidden_size=64, layer_types=(SLIDING, CSA, HCA), num_heads=4, head_dim=32,
        rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=8, csa_rate=4, hca_rate=8,
        index_n_heads=8, index_head_dim=16, index_topk=2, max_position_embeddings=1 << 20,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
    )


def test_small_case_by_hand():
    cfg = _small()
    # bf16 entries are 64 B, bf16 index keys 32 B.
    inputs = PlanInputs(context_len=4096, device_bytes_per_gpu=2_000_000, num_gpus=2, kv_format="bf16",
                        index_format="bf16", activation_reserve=0.25, weight_bytes=1_000_000)
    p = plan(cfg, inputs)
    # Per token: C4 64/4 = 16, index keys 32/4 = 8, HCA 64/8 = 8, slot map 4/4 = 1.
    assert (p.bytes_per_token.c4, p.bytes_per_token.index_keys, p.bytes_per_token.hca, p.bytes_per_token.slot_map) == (
        16, 8, 8, 1)
    assert p.ceiling_ratio == 32 / 17
    # Fixed: SWA 3 layers x 8 x 64 = 1536; state 8x(64+64)x4 + 8x(32+32)x4 + 8x(32+32)x4 = 8192;
    # hot buffer (2 x topk 2 + 8 reserved) x 64 = 768.
    f = p.fixed_bytes_per_request
    assert (f.swa, f.compressor_state, f.hot_buffer) == (1536, 8192, 768)
    # 4096 tokens: 1024 C4 entries, 512 HCA entries.
    r = p.request_bytes
    assert (r.c4, r.index_keys, r.hca, r.slot_map) == (65536, 32768, 32768, 4096)
    assert r.device_without_tier == 140800 and r.device_with_tier == 80128 and r.host_with_tier == 65536
    # Per GPU: 2e6 - 25% = 1.5e6, minus half the weights = 1e6 for KV.
    assert p.kv_budget_bytes_per_gpu == 1_000_000
    assert p.requests_without_tier == 2 * 7 and p.requests_with_tier == 2 * 12
    assert p.tokens_without_tier == 14 * 4096 and p.tokens_with_tier == 24 * 4096
    assert p.ratio == 12 / 7
    assert p.host_bytes_needed == 24 * 65536


def test_host_memory_limit_is_flagged():
    cfg = _small()
    base = dict(context_len=4096, device_bytes_per_gpu=1_000_000, num_gpus=1, kv_format="bf16", index_format="bf16",
                activation_reserve=0.0, weight_bytes=0)
    assert plan(cfg, PlanInputs(**base)).host_fits is None
    p = plan(cfg, PlanInputs(**base, host_memory_bytes=5 * 65536 + 1))
    assert p.host_fits is False and p.requests_with_tier_host_limited == 5
    assert any("host memory is the limit" in n for n in p.notes)
    assert plan(cfg, PlanInputs(**base, host_memory_bytes=12 * 65536)).host_fits is True


def test_plan_errors():
    cfg = _small()
    base = dict(device_bytes_per_gpu=1_000_000, num_gpus=1, activation_reserve=0.0, weight_bytes=0)
    with pytest.raises(PlanError, match="does not fit"):
        plan(cfg, PlanInputs(context_len=1 << 20, **base))
    with pytest.raises(PlanError, match="nothing left for KV"):
        plan(cfg, PlanInputs(context_len=64, device_bytes_per_gpu=1000, num_gpus=1, weight_bytes=2000))
    with pytest.raises(PlanError, match="top-2"):
        plan(cfg, PlanInputs(context_len=64, hot_buffer_slots=1, **base))
    with pytest.raises(PlanError, match="positions"):
        plan(cfg, PlanInputs(context_len=(1 << 20) + 1, **base))
    with pytest.raises(PlanError, match="kv format"):
        PlanInputs(context_len=64, kv_format="fp4", **base)


def test_cache_kind_names_match_the_layout():
    from cachetier import layout

    assert (planner.C4, planner.INDEX_KEYS, planner.HCA_ENTRIES, planner.SWA, planner.COMPRESSOR_STATE) == (
        layout.C4, layout.INDEX_KEYS, layout.HCA_ENTRIES, layout.SWA, layout.COMPRESSOR_STATE)


def test_planner_needs_no_torch():
    code = "import sys, cachetier.planner, hisparse.plan_cmd; assert 'torch' not in sys.modules, 'torch imported'"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------------ the command


def _parse(*argv: str) -> argparse.Namespace:
    """Parse as `hisparse plan ...` does once `add_parser` is wired into the CLI."""
    parser = argparse.ArgumentParser(prog="hisparse")
    sub = parser.add_subparsers(dest="command", required=True)
    plan_cmd.add_parser(sub)
    return parser.parse_args(["plan", *argv])


def _run_json(capsys, *argv: str) -> dict:
    rc = plan_cmd.run(_parse(*argv, "--json"))
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out)


def test_json_fields(capsys):
    out = _run_json(capsys, "--model", "v4-flash", "--gpu", "h200", "--context", "1M")
    assert out["context_len"] == ONE_M
    assert out["tokens_with_tier"] == out["requests_with_tier"] * ONE_M > 0
    assert out["tokens_without_tier"] == out["requests_without_tier"] * ONE_M > 0
    assert out["ratio"] == out["tokens_with_tier"] / out["tokens_without_tier"]
    assert out["bytes_per_token"] == {"c4": 3066.0, "index_keys": 357.0, "hca": 91.25, "slot_map": 21.0}
    assert out["device_bytes_per_token"] == {"without_tier": 3514.25, "with_tier": 469.25}
    assert out["ceiling_ratio"] == 3514.25 / 469.25
    assert out["ratio"] <= out["ceiling_ratio"]
    assert out["fixed_bytes_per_request"]["hot_buffer"] == 21 * (1024 + 8) * 584
    assert out["formats"]["kv_entry_bytes"] == 584 and out["formats"]["index_key_bytes"] == 68
    assert out["compressor_state_per_layer"] == {"csa_main": 65536, "csa_indexer": 16384, "hca": 524288}
    dev = out["device"]
    assert dev["gpu"] == "h200" and dev["bytes_per_gpu"] == 141 * 10**9 and dev["num_gpus"] == 8
    assert dev["kv_budget_bytes_per_gpu"] == 141 * 10**9 - 14_100_000_000 - dev["weight_bytes_per_gpu"]
    assert out["weights"]["published_checkpoint_bytes"] == 160 * 10**9
    assert out["host_bytes_needed"] == out["requests_with_tier"] * out["host_bytes_per_request"]


def test_json_with_other_formats_and_flags(capsys):
    out = _run_json(capsys, "--model", "v4-pro", "--gpu", "180e9", "--context", "131072", "--num-gpus", "16",
                    "--kv-format", "bf16", "--index-format", "fp8", "--hot-buffer-slots", "4096",
                    "--reserved-slots", "0", "--activation-reserve", "5%", "--host-memory", "4TiB")
    assert out["device"]["gpu"] is None and out["device"]["num_gpus"] == 16
    assert out["device"]["activation_reserve"] == 0.05
    assert out["formats"]["kv_entry_bytes"] == 1024 and out["formats"]["index_key_bytes"] == 132
    assert out["hot_buffer"] == {"slots": 4096, "reserved_slots": 0}
    assert out["bytes_per_token"]["c4"] == 30 * 1024 / 4
    assert out["host_memory_bytes"] == 4 * 2**40 and out["host_fits"] in (True, False)


def test_model_directory_gives_the_same_plan_as_the_preset(capsys, tmp_path):
    from model.config import to_hf_dict

    (tmp_path / "config.json").write_text(json.dumps(to_hf_dict(V4_FLASH)))
    from_dir = _run_json(capsys, "--model", str(tmp_path), "--gpu", "h200", "--context", "128K")
    preset = _run_json(capsys, "--model", "v4-flash", "--gpu", "h200", "--context", "128K")
    for key in ("tokens_with_tier", "tokens_without_tier", "ratio", "bytes_per_token", "fixed_bytes_per_request"):
        assert from_dir[key] == preset[key], key
    assert from_dir["weights"]["served_bytes"] == preset["weights"]["served_bytes"]


def test_fits_only_with_the_tier(capsys):
    # 1000 GB of weights leave ~1.9 GB per H200: one 1M request needs 3.7 GB without the tier, 0.52 GB with it.
    out = _run_json(capsys, "--model", "v4-flash", "--gpu", "h200", "--context", "1M", "--weight-bytes", "1000GB")
    assert out["requests_without_tier"] == 0 and out["requests_with_tier"] > 0
    assert out["ratio"] is None and any("only with the tier" in n for n in out["notes"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--model", "v4-flash", "--gpu", "a100", "--context", "1M"), "unknown --gpu 'a100'"),
        (("--model", "v4-ultra", "--gpu", "h200", "--context", "1M"), "unknown --model 'v4-ultra'"),
        (("--model", "v4-flash", "--gpu", "h200", "--context", "1M", "--weight-bytes", "1015GB"), "does not fit"),
        (("--model", "v4-pro", "--gpu", "h200", "--context", "1M", "--num-gpus", "4"), "nothing left for KV"),
        (("--model", "v4-flash", "--gpu", "h200", "--context", "2M"), "positions"),
    ],
)
def test_clear_errors(capsys, argv, message):
    rc = plan_cmd.run(_parse(*argv))
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.startswith("hisparse plan: ")


def test_directory_without_config_is_a_clear_error(capsys, tmp_path):
    rc = plan_cmd.run(_parse("--model", str(tmp_path), "--gpu", "h200", "--context", "1M"))
    assert rc == 2 and "config.json" in capsys.readouterr().err


def test_module_entry_point_prints_a_table():
    r = subprocess.run(
        [sys.executable, "-m", "hisparse.plan_cmd", "--model", "v4-flash", "--gpu", "h200", "--context", "1M"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env=dict(os.environ),
    )
    assert r.returncode == 0, r.stderr
    for text in ("without tier", "with tier", "ceiling as context -> infinity 7.49x", "3,514.25", "469.25",
                 "published checkpoint: ~160 GB"):
        assert text in r.stdout, text


def test_token_counts_accept_k_and_m():
    assert plan_cmd.parse_tokens("1M") == 1 << 20 and plan_cmd.parse_tokens("128k") == 131072
    assert plan_cmd.parse_tokens("4096") == 4096
    with pytest.raises(argparse.ArgumentTypeError):
        plan_cmd.parse_tokens("1.5M")
