"""`python -m bench.elastic --quick`: one JSON object, the two admission policies give the same tokens, and the
estimating one runs more requests at once under the same budget."""

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
    assert set(result["not_measured"]) == {"step_ratio_at_low_load", "tokens_admitted_under_full_load",
                                           "shared_prefix_bytes", "handoff_bytes_per_turn"}
