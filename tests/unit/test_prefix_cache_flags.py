"""The prefix cache's flags reach the prefill config; its numbers reach /metrics."""

from __future__ import annotations

import pytest

from api.metrics import Metrics
from core.configs import PrefixCacheConfig
from hisparse.cli import build_parser, serve_config


def test_flags_build_the_prefix_cache_config(tmp_path):
    args = ["serve", "--prefix-cache", "on", "--prefix-cache-host-bytes", "2GiB", "--prefix-cache-disk-bytes", "10GB",
            "--prefix-cache-dir", str(tmp_path), "--prefix-cache-page-tokens", "512", "--prefix-cache-state-policy", "every"]
    pc = serve_config(build_parser().parse_args(args)).prefill.prefix_cache
    assert pc == PrefixCacheConfig(enabled=True, host_bytes=2 * 2**30, disk_bytes=10**10, directory=str(tmp_path),
                                   page_tokens=512, state_policy="every")
    assert pc.disk_enabled
    default = serve_config(build_parser().parse_args(["serve"])).prefill.prefix_cache
    assert default.enabled is None and default.wanted and not default.disk_enabled  # on wherever it can run
    off = serve_config(build_parser().parse_args(["serve", "--prefix-cache", "off"])).prefill.prefix_cache
    assert off.enabled is False and not off.wanted


def test_a_disk_tier_needs_a_directory():
    with pytest.raises(ValueError, match="directory"):
        PrefixCacheConfig(enabled=True, disk_bytes=1)
    with pytest.raises(ValueError, match="state_policy"):
        PrefixCacheConfig(state_policy="sometimes")


def test_metrics_show_the_prefix_cache():
    pc = {"lookups": 4, "prompt_tokens": 1000, "hit_tokens": 750, "nodes": 5, "state_snapshots": 2,
          "host_seg_bytes": 100, "host_state_bytes": 200, "disk_seg_bytes": 300, "disk_state_bytes": 400,
          "state_bytes_every_page": 500, "evictions": 6, "disk_drops": 1, "disk_reads": 7, "disk_writes": 8,
          "disk_read_bytes": 70, "disk_write_bytes": 80, "disk_errors": 5, "disk_read_errors": 2, "disk_write_errors": 3}
    text = Metrics("m", lambda: {"prefix_cache": pc, "prefix_routing": {"affinity": 3, "capped": 1},
                                 "prefill_tokens_computed": 250}).render().decode()
    for line in ('hisparse_prefix_cache_hit_rate{model="m"} 0.75',
                 'hisparse_prefix_cache_bytes{model="m",part="state",tier="disk"} 400.0',
                 'hisparse_prefix_cache_bytes{model="m",part="classical",tier="host"} 100.0',
                 'hisparse_prefix_cache_evictions_total{model="m"} 6.0',
                 'hisparse_prefix_cache_disk_ops_total{model="m",op="read"} 7.0',
                 'hisparse_prefix_cache_disk_ops_total{model="m",op="write"} 8.0',
                 'hisparse_prefix_cache_disk_errors_total{model="m"} 5.0',
                 'hisparse_prefix_cache_disk_op_errors_total{model="m",op="read"} 2.0',
                 'hisparse_prefix_cache_disk_op_errors_total{model="m",op="write"} 3.0',
                 'hisparse_prefix_routing_total{decision="affinity",model="m"} 3.0',
                 'hisparse_prefill_computed_tokens_total{model="m"} 250.0'):
        assert line in text, line
    assert "hisparse_prefix_cache_hit_rate" not in Metrics("m", lambda: {}).render().decode()


def test_every_prefix_cache_counter_reaches_the_frontends_sums(tiny_model, tmp_path):
    """What an actor reports is summed over actors for /metrics: a counter missing from PREFIX_SUMS (as the disk
    tier's write failures once were) never reaches the gateway. Not summed: the ratio, the page size (the
    largest is shown) and one snapshot's size."""
    from cachetier.layout import layout_format
    from cachetier.prefix import PrefixCache
    from cluster.frontend import PREFIX_SUMS

    pc = PrefixCacheConfig(enabled=True, page_tokens=64, disk_bytes=1 << 20, directory=str(tmp_path))
    cache = PrefixCache(tiny_model.cfg, pc, layout_format(tiny_model.cfg, tiny_model.dtype))
    stats = cache.stats()
    cache.close()
    reported = set(stats.as_dict()) - {"hit_rate", "page_tokens", "state_snapshot_bytes"}
    assert {"disk_read_errors", "disk_write_errors", "disk_errors"} <= reported
    assert reported <= set(PREFIX_SUMS), reported - set(PREFIX_SUMS)
    assert all(isinstance(getattr(stats, k), int) for k in PREFIX_SUMS)  # readable from the stats object too
