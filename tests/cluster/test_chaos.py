"""A short chaos run (`bench.chaos` at small size): a mixed load while actors are SIGKILLed. Nothing hangs,
every completed request equals its undisturbed twin, no client input produces a 500, and once idle
nothing is held anywhere."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_chaos_short(tiny_dir, monkeypatch):
    from bench.chaos import run

    monkeypatch.setenv("HISPARSE_CACHE", str(tiny_dir.parent.parent))
    out = run(requests=32, kills=2, seed=7, concurrency=12, timeout_s=120.0)
    assert out["hung"] == 0
    assert out["completed_different"] == 0 and out["completed_equal_to_undisturbed"] > 0
    assert not any(s.startswith("5") and s not in ("503",) for s in out["by_status"]), out["by_status"]
    assert set(out["undisturbed_by_status"]) <= {"200", "400", "422"}
    assert out["by_status"].get("400", 0) + out["by_status"].get("422", 0) == out["invalid_sent"]
    assert not any(out["held_after"].values()), out["held_after"]
    assert out["integrity_errors"] == 0 and out["integrity_checks"] >= 1
    assert len(out["kills"]) >= 1
