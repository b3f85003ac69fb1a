"""Packed sizes in the tier's accounting: the runtime's pools and `hisparse plan` agree on bytes per token."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cachetier import planner
from cachetier.geometry import Geometry
from cachetier.store import TieredStore
from core.config import CSA, HCA, SLIDING
from core.configs import TierConfig
from model.builtin import tiny_config


def v4_proportioned(kv_format: str):
    """V4's KV dimensions (512-d rows with 64 rotary channels, 128-d indexer keys, rates 4 and 128, window
    128) on a few layers."""
    return dataclasses.replace(tiny_config(), layer_types=(SLIDING, CSA, HCA, CSA, HCA, CSA), head_dim=512, rope_head_dim=64,
                               index_head_dim=128, hca_rate=128, sliding_window=128, index_topk=64,
                               mlp_layer_types=(), kv_format=kv_format)


CASES = [
    (tiny_config, "v4", torch.float32),
    (tiny_config, "bf16", torch.bfloat16),
    (v4_proportioned, "v4", torch.bfloat16),
    (v4_proportioned, "bf16", torch.bfloat16),
]


@pytest.mark.parametrize("make, fmt, dtype", CASES)
@pytest.mark.parametrize("offload", [False, True])
def test_plan_and_runtime_agree_on_bytes_per_token(make, fmt, dtype, offload):
    cfg = make(fmt) if make is v4_proportioned else dataclasses.replace(make(), kv_format=fmt)
    kv, idx = planner.entry_formats(fmt)
    per_token = planner.token_bytes(cfg, kv, idx)
    tier = TierConfig(offload=offload, device_budget_bytes=64 * 2**20, host_pool_bytes=64 * 2**20)
    store = TieredStore(cfg, tier, dtype)
    g = store.geo
    # the runtime's own tensors are what the geometry says they are
    assert store.arena.numel() * store.arena.element_size() == g.arena_pages * g.page_elems * g.elem
    runtime = g.page_bytes / g.block_tokens
    plan = per_token.device_with_tier if offload else per_token.device_without_tier
    # equal up to the page's alignment padding (less than one main row per page)
    assert plan <= runtime < plan + g.main_bytes / g.block_tokens
    if offload:
        assert store.hot.host.kv.numel() * store.hot.host.kv.element_size() == (g.num_host_blocks + 1) * g.host_block_bytes
        assert g.host_block_bytes / g.block_tokens == per_token.c4
    assert g.main_bytes == planner.kv_entry_bytes(cfg, kv) and g.index_bytes == planner.index_key_bytes(cfg, idx)
    store.close()


def test_v4_rows_at_v4_dims_and_the_packed_saving():
    cfg = v4_proportioned("v4")
    g = Geometry(cfg, TierConfig(offload=False, device_budget_bytes=64 * 2**20), torch.bfloat16)
    assert (g.main_bytes, g.index_bytes) == (584, 68)
    plain = Geometry(dataclasses.replace(cfg, kv_format="bf16"), TierConfig(offload=False, device_budget_bytes=64 * 2**20),
                     torch.bfloat16)
    assert (plain.main_bytes, plain.index_bytes) == (1024, 256)
    # the same budget holds more pages of packed rows
    assert g.page_bytes < plain.page_bytes and g.num_pages > plain.num_pages


def test_trained_format_is_v4_for_v4_checkpoints_only():
    from model.builtin import tiny_config
    from model.config import parse_config, to_hf_dict, trained_kv_format

    raw = to_hf_dict(tiny_config())
    assert trained_kv_format(parse_config(raw)) == "bf16"
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    assert trained_kv_format(parse_config(raw)) == "v4"
    assert parse_config(raw).kv_format == "bf16"  # parsing alone never changes numerics; `--kv-format auto` does


def test_cli_generate_with_packed_kv_matches_the_dense_reference(tiny_dir):
    import json
    import os
    import subprocess
    import sys

    from core.types import SamplingParams
    from model.generate import generate_plain
    from model.loader import load_model

    r = subprocess.run([sys.executable, "-m", "hisparse.cli", "generate", "--kv-format", "v4", "--prompt-ids", "5,6,7,8,9",
                        "--max-tokens", "10", "--json", "--ignore-eos"], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    ref, _, _ = generate_plain(load_model(tiny_dir, kv_format="v4-dense"), [5, 6, 7, 8, 9],
                               SamplingParams(max_tokens=10, ignore_eos=True))
    assert json.loads(r.stdout)["token_ids"] == [t.token_id for t in ref]
