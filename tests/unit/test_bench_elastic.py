"""`python -m bench.elastic --quick`: one JSON object; tier off, on and on with residency give the same tokens, the
resident worker misses nothing and admits as many at full load as the tier on; the two admission policies give the
same tokens, and the estimating one runs more requests at once under the same budget; requests sharing a prefix hold
and hand over a fraction of the bytes."""

from __future__ import annotations

import contextlib
import io
import json

import torch

from bench import elastic


def test_quick_run():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            elastic.main(["--quick"])
        result = json.loads(out.getvalue())
    finally:
        torch.set_num_threads(before)
    assert result["bench"] == "elastic"
    sw = result["swap_out"]
    assert sw["identical_tokens"] is True
    final, estimate = sw["by_policy"]["final"], sw["by_policy"]["estimate"]
    assert final["completed"] == estimate["completed"] == sw["requests"]
    assert final["tokens"] == estimate["tokens"]
    assert estimate["most_decoding_at_once"] > final["most_decoding_at_once"]
    assert estimate["resumes"] == estimate["pauses"]
    assert "not_measured" not in result
    shared = result["shared_prefix"]
    for tier in ("on", "off"):  # 16 requests over 8,192 shared tokens: a fraction of the bytes, in every measure
        ratio = shared[f"ratio_{tier}"]
        assert 0 < ratio["device_bytes"] < 0.5 and 0 < ratio["handoff_bytes"] < 0.5
    assert 0 < shared["ratio_on"]["host_bytes"] < 0.5 and shared["by_tier"]["off"]["host_bytes"] == 0
    assert set(result["measured_elsewhere"]) == {"handoff_bytes_per_turn"}
    low = result["low_load"]
    assert low["identical_tokens"] is True and set(low["by_batch"]) == {"1", "2"}
    assert low["on_resident_view_kinds"].get("resident", 0) > 0
    assert all(row["on_resident_misses_last_repeat"] == 0 for row in low["by_batch"].values())
    for row in low["by_batch"].values():  # the noise: the twin of off's largest distance from it, round by round
        assert abs(row["noise"] - max(abs(1 - r) for r in row["ratio_off_twin_off_by_repeat"])) < 2e-3
    full = result["full_load"]["by_tier"]
    assert full["on_resident"]["requests"] == full["on"]["requests"] > full["off"]["requests"]
    assert full["on_resident"]["promotions"] > 0 and full["on_resident"]["resident_requests"] == 0
