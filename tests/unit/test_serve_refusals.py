"""What can never serve is refused by the configs and the pre-flight checks, before any Ray or actor work.

In-process halves of tests/e2e/test_serve_preflight.py: the range checks of the config dataclasses (named by
their flag on the command line), the loader's header-only check, the smallest device budget, and the prefix
cache's default (on wherever it can run, with a host budget that scales with the machine).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from core.configs import (
    PREFIX_HOST_CAP,
    ClusterConfig,
    FieldError,
    PrefillConfig,
    PrefixCacheConfig,
    ServeConfig,
    TierConfig,
    default_prefix_host_bytes,
    memory_limit_bytes,
)
from hisparse.cli import build_parser, refusal, serve_config

NEVER_SERVE = [  # flag, value: each starts nothing useful (503/429 for ever, no step, ...) or was silently changed
    ("--max-running", "0"), ("--num-decode", "0"), ("--num-prefill", "0"), ("--max-concurrent-requests", "0"),
    ("--stream-interval", "0"), ("--api-workers", "0"), ("--max-sequences-per-request", "0"),
    ("--max-body-bytes", "0"), ("--device-budget", "0"), ("--block-tokens", "0"), ("--max-batch-tokens", "0"),
    ("--entry-tile", "0"), ("--port", "0"), ("--port", "70000"), ("--max-queued-requests", "0"),
    ("--queue-timeout-s", "0"), ("--max-request-retries", "-1"), ("--decode-num-cpus", "-1"),
    ("--prefix-cache-page-tokens", "0"), ("--prefill-num-gpus", "-1"),
]


@pytest.mark.parametrize("flag,value", NEVER_SERVE)
def test_a_flag_that_can_never_serve_is_refused_by_name(flag, value):
    with pytest.raises(FieldError) as e:
        serve_config(build_parser().parse_args(["serve", flag, value]))
    line = refusal("serve", e.value)
    assert line.startswith(f"hisparse serve: {flag} must ") and f"got {value}" in line and "\n" not in line


def test_the_defaults_serve():
    cfg = serve_config(build_parser().parse_args(["serve"]))
    assert cfg.tier.max_running == 64 and cfg.server.stream_interval == 1 and cfg.cluster.num_decode == 1


# ------------------------------------------------------------------------------------------- pre-flight


def _copy_tiny(tiny_dir, tmp_path):
    d = tmp_path / "model"
    shutil.copytree(tiny_dir, d)
    return d


def test_header_check_reads_no_tensor(tiny_dir, monkeypatch):
    """`check_checkpoint` plans from the headers and checks against a meta model: reading a tensor fails here."""
    from model import loader

    def no_read(self, src):
        raise AssertionError(f"read {src.raw}")

    monkeypatch.setattr(loader._Checkpoint, "read", no_read)
    cfg = loader.check_checkpoint(tiny_dir)
    assert cfg.hidden_size == 128


def test_header_check_finds_a_config_that_does_not_match_the_weights(tiny_dir, tmp_path):
    from model.loader import CheckpointError, check_checkpoint

    d = _copy_tiny(tiny_dir, tmp_path)
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**raw, "hidden_size": 96}))
    with pytest.raises(CheckpointError, match="model expects"):
        check_checkpoint(d)


@pytest.mark.parametrize("cut", [4, 1000, -1000])
def test_a_cut_off_weights_file_is_found_by_its_size(tiny_dir, tmp_path, cut):
    from model.loader import CheckpointError, check_checkpoint, load_model

    d = _copy_tiny(tiny_dir, tmp_path)
    f = d / "model.safetensors"
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(cut if cut > 0 else size + cut)
    for check in (check_checkpoint, load_model):  # the loader refuses it the same way, before mapping it
        with pytest.raises(CheckpointError, match="model.safetensors (is truncated|is not a safetensors file)"):
            check(d)


def test_smallest_budget_is_exactly_what_the_store_accepts(tiny_dir):
    from cachetier.geometry import BudgetTooSmall, Geometry
    from hisparse.preflight import PreflightError, check_budget, smallest_budget
    from model.loader import model_config

    cfg = model_config(tiny_dir, kv_format="auto")
    for tier in (TierConfig(device_budget_bytes=1000), TierConfig(offload=False, device_budget_bytes=1000)):
        need = smallest_budget(cfg, tier, torch.float32)
        Geometry(cfg, dataclasses.replace(tier, device_budget_bytes=need), torch.float32)
        with pytest.raises(BudgetTooSmall):
            Geometry(cfg, dataclasses.replace(tier, device_budget_bytes=need - 1), torch.float32)
        with pytest.raises(PreflightError, match=f"smallest budget that holds one is {need} bytes") as e:
            check_budget(cfg, tier, torch.float32)
        assert "--device-budget" in str(e.value)
        check_budget(cfg, dataclasses.replace(tier, device_budget_bytes=need), torch.float32)


def test_a_tier_the_model_cannot_take_is_refused(tiny_dir):
    from hisparse.preflight import PreflightError, check_budget
    from model.loader import model_config

    cfg = model_config(tiny_dir)
    with pytest.raises(PreflightError, match="hot_buffer_slots"):  # a step's selection must fit in the hot buffer
        check_budget(cfg, TierConfig(hot_buffer_slots=cfg.index_topk - 1), torch.float32)


def test_preflight_names_the_model_flag(tmp_path):
    from hisparse.preflight import PreflightError, check_serve

    with pytest.raises(PreflightError, match=r"--model .*nowhere.* neither"):
        check_serve(ServeConfig(model=str(tmp_path / "nowhere")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(PreflightError, match="config.json not found"):
        check_serve(ServeConfig(model=str(tmp_path / "empty")))


def test_preflight_passes_the_defaults(tiny_dir):
    from hisparse.preflight import check_serve

    assert check_serve(ServeConfig()).hidden_size == 128


# ------------------------------------------------------------------------------------------- prefix cache


def test_prefix_cache_is_on_by_default(tiny_model):
    from prefill.worker import PrefillWorker

    pc = serve_config(build_parser().parse_args(["serve"])).prefill.prefix_cache
    assert pc.enabled is None and pc.wanted and pc == PrefixCacheConfig()
    assert PrefillWorker(tiny_model, PrefillConfig()).prefix_cache is not None
    off = serve_config(build_parser().parse_args(["serve", "--prefix-cache", "off"])).prefill
    assert PrefillWorker(tiny_model, off).prefix_cache is None
    on = serve_config(build_parser().parse_args(["serve", "--prefix-cache", "on"])).prefill.prefix_cache
    assert on.enabled is True


def test_prefix_cache_host_budget_scales_with_the_machine():
    limit = memory_limit_bytes()
    assert limit is not None and limit > 0  # Linux: MemTotal at least
    assert default_prefix_host_bytes() == min(PREFIX_HOST_CAP, limit // 16)
    assert PrefixCacheConfig().host_budget == default_prefix_host_bytes()
    assert PrefixCacheConfig(host_bytes=12345).host_budget == 12345
    assert PrefixCacheConfig(host_bytes=0).host_budget == 0


def test_an_attention_tp_prefill_layout_refuses_only_an_asked_for_prefix_cache():
    tp = ClusterConfig(placement="any", prefill_layout="tp2")
    ServeConfig(cluster=tp)  # the default: off there, no error
    ServeConfig(cluster=tp, prefill=PrefillConfig(prefix_cache=PrefixCacheConfig(enabled=False)))
    with pytest.raises(ValueError, match="prefix cache"):
        ServeConfig(cluster=tp, prefill=PrefillConfig(prefix_cache=PrefixCacheConfig(enabled=True)))


def _tp_worker(tiny_model, pc: PrefixCacheConfig):
    from prefill.worker import PrefillWorker

    comm = SimpleNamespace(ep=1, tp=2, shard=SimpleNamespace(tp_rank=0))
    model = SimpleNamespace(cfg=tiny_model.cfg, dtype=tiny_model.dtype, comm=comm)  # what join_replica reads
    return PrefillWorker(model, PrefillConfig(prefix_cache=pc))


def test_a_tp_group_drops_the_default_prefix_cache_and_refuses_an_asked_for_one(tiny_model, caplog):
    worker = _tp_worker(tiny_model, PrefixCacheConfig())
    assert worker.prefix_cache is not None
    with caplog.at_level("INFO", logger="prefill.worker"):
        worker.join_replica()
    assert worker.prefix_cache is None and worker.tp_role == "leader"
    assert [r.getMessage() for r in caplog.records if "prefix cache off" in r.getMessage()]
    asked = _tp_worker(tiny_model, PrefixCacheConfig(enabled=True))
    with pytest.raises(ValueError, match="without the prefix cache"):
        asked.join_replica()
