"""`python -m bench.speculative --quick`: the one JSON object has every part, its figures agree with each other and
with the worker's own counters, the hot-buffer rule decides which (B, N) ran, and greedy tokens are identical."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from bench import speculative


@pytest.fixture(scope="module")
def result():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the shared CPU runs the tiny step far faster without threads contending for it
    try:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            speculative.main(["--quick"])
        return json.loads(out.getvalue())  # stdout holds the one JSON object and nothing else
    finally:
        torch.set_num_threads(before)


def test_every_part_and_identity(result):
    assert result["bench"] == "speculative" and result["quick"] is True
    assert {"acceptance", "throughput", "miss_rate", "notes", "env"} <= set(result)
    assert result["greedy_identical"] is True
    assert result["acceptance"]["identical_to_off"] == {"1": True, "2": True, "3": True}
    assert result["throughput"]["identical_to_off"] is True and result["miss_rate"]["identical_to_off"] is True
    assert any("partial ring" in note for note in result["notes"])


def test_acceptance_agrees_with_the_worker(result):
    acc = result["acceptance"]
    w = acc["sliding_window"]
    for n, row in acc["by_draft_tokens"].items():
        # the bench's count from the step events and the worker's own counters are the same figure
        assert row["acceptance_length"] == pytest.approx(row["worker_acceptance_length"], abs=1e-4)
        assert 1.0 <= row["acceptance_length"] <= int(n) + 1
        first, after = row[f"first_{w}_decode_tokens"], row[f"after_{w}_decode_tokens"]
        assert first["request_steps"] + after["request_steps"] == row["request_steps"]
        kept = first["acceptance_length"] * first["request_steps"] + after["acceptance_length"] * after["request_steps"]
        assert kept / row["request_steps"] == pytest.approx(row["acceptance_length"], abs=1e-3)
        assert row["steps"] <= row["steps_off"]
        rates = row["kept_rate_per_draft_position"]
        assert set(rates) == {str(k) for k in range(1, int(n) + 1)}
        assert all(r is None or 0.0 <= r <= 1.0 for r in rates.values())


def test_throughput_rows(result):
    th = result["throughput"]
    assert set(th["by_batch"]) == {"1", "2"}
    assert set(th["workers"]) == {"off", "off_twin", "on_n3", "on_adaptive"}
    assert all(w["eager_steps"] == 0 for w in th["workers"].values())
    for row in th["by_batch"].values():
        for key in ("off", "off_twin", "on_n3", "on_adaptive"):
            assert row[f"tokens_per_s_{key}"] > 0
        assert row["ratio_on_n3_off"] == pytest.approx(row["tokens_per_s_on_n3"] / row["tokens_per_s_off"], rel=0.01)
        # the noise is the twin's largest distance from off over the lockstep rounds, and the verdict reads it
        assert row["noise"] == pytest.approx(max(abs(1 - r) for r in row["ratio_off_twin_off_by_repeat"]), abs=2e-3)
        assert row["adaptive_within_noise_of_off"] == (row["ratio_on_adaptive_off"] >= 1 - row["noise"] - 1e-3) or \
            abs(row["ratio_on_adaptive_off"] - (1 - row["noise"])) < 2e-3
        # the adaptive policy probed its candidate counts, each of them at most N = 3
        assert row["adaptive_draft_choices"] and all(0 <= int(n) <= 3 for per in row["adaptive_draft_choices"].values() for n in per)


def test_miss_rate_follows_the_hot_buffer_rule(result):
    mr = result["miss_rate"]
    k = mr["index_topk"]
    assert [row["hot_buffer_slots"] for row in mr["by_hot_buffer"].values()] == [k, 2 * k, 4 * k]
    for row in mr["by_hot_buffer"].values():
        b = row["hot_buffer_slots"]
        for n in range(4):
            cell = row["off" if n == 0 else f"on_n{n}"]
            if b < (n + 1) * k:
                assert isinstance(cell, str) and cell.startswith("not allowed")
                continue
            for part in ("whole_run", "steady"):
                fig = cell[part]
                assert fig["misses_per_request_step"] == pytest.approx(fig["misses"] / fig["request_steps"], abs=1e-4)
                assert fig["misses_per_token"] == pytest.approx(fig["misses"] / fig["tokens"], abs=1e-4)
                if n == 0:  # one token per request-step
                    assert fig["tokens"] == fig["request_steps"]
                else:
                    assert fig["tokens"] >= fig["request_steps"]
