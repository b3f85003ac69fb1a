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
    # the adaptive worker's costs timed before serving, per build: what each bucket's first probe followed
    assert set(th["workers"]["on_adaptive"]["seeded_costs"]) == set(th["builds"])
    assert all("seeded_costs" not in th["workers"][name] for name in ("off", "off_twin", "on_n3"))
    # each worker ran in a process of its own; the adaptive one reported, per build and bucket, the choice it ended on
    # and the paired ratios its measured runs gave (at most `window` kept per count), each count's steps beside them
    assert th["workers_in"].startswith("a process each")
    measured = th["workers"]["on_adaptive"]["measured"]
    assert set(measured) == set(th["builds"])
    for per_bucket in measured.values():
        assert set(per_bucket) <= {"1", "2"} and per_bucket
        for known in per_bucket.values():
            assert 0 <= known["choice"] <= 3 and known["ratios"]
            assert all(0 < len(rs) <= 7 and all(r > 0 for r in rs) for rs in known["ratios"].values())
            assert all(known["steps"][n] >= 3 for n in known["ratios"])  # each ratio came from a run of `probe` steps
    for row in th["by_batch"].values():
        for key in ("off", "off_twin", "on_n3", "on_adaptive"):
            assert row[f"tokens_per_s_{key}"] > 0
        assert row["ratio_on_n3_off"] == pytest.approx(row["tokens_per_s_on_n3"] / row["tokens_per_s_off"], rel=0.01)
        # the noise is the twin's largest distance from off over the lockstep rounds, and the verdict reads it
        assert row["noise"] == pytest.approx(max(abs(1 - r) for r in row["ratio_off_twin_off_by_repeat"]), abs=2e-3)
        assert row["adaptive_within_noise_of_off"] == (row["ratio_on_adaptive_off"] >= 1 - row["noise"] - 1e-3) or \
            abs(row["ratio_on_adaptive_off"] - (1 - row["noise"])) < 2e-3
        # the headline figures are at the batch's concurrency; the whole pool's, its drain included, stand beside them
        pool = row["whole_pool"]
        assert pool["ratio_on_adaptive_off"] == pytest.approx(pool["tokens_per_s_on_adaptive"] / pool["tokens_per_s_off"],
                                                              rel=0.01)
        # both builds ran (the second swaps off's and adaptive's arenas and build places) and the pooled ratios lie
        # between theirs: a worker's arena alone moves its speed, so neither build alone is the figure
        orders = row["by_build_order"]
        assert set(orders) == set(th["builds"]) == {"off_built_first", "off_built_last"}
        assert len(row["ratio_off_twin_off_by_repeat"]) == 2 * th["repeats_per_build"]
        for key in ("on_n3", "on_adaptive", "off_twin"):
            each = [o[f"ratio_{key}_off"] for o in orders.values()]
            for o in orders.values():
                assert o[f"ratio_{key}_off"] == pytest.approx(o[f"tokens_per_s_{key}"] / o["tokens_per_s_off"], rel=0.01)
            # pooled over both (a weighted mediant of theirs; the weights differ a little where the workers' steady
            # token counts do)
            assert min(each) - 0.02 <= row[f"ratio_{key}_off"] <= max(each) + 0.02
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


class _Lanes:
    """A stand-in lane: every running request gains one token a step, except on step `burst`, where every one but
    the first gains three (a speculative step that keeps drafts for most rows)."""

    def __init__(self, tokens: int, burst: int | None) -> None:
        self.tokens, self.burst, self.steps, self.queue, self.running, self.rows = tokens, burst, 0, [], {}, []

    def give(self, request_id: str) -> None:
        self.queue.append(request_id)

    def has_work(self) -> bool:
        return bool(self.queue or self.running)

    def timed_step(self) -> tuple[float, list, int]:
        while self.queue:
            self.running[self.queue.pop(0)] = self.tokens
        self.rows.append(len(self.running))
        events = []
        for i, rid in enumerate(list(self.running)):
            gain = 3 if self.steps == self.burst and i else 1
            for _ in range(min(gain, self.running[rid])):
                self.running[rid] -= 1
                events.append((rid, 7, self.running[rid] == 0))
            if not self.running[rid]:
                del self.running[rid]
        self.steps += 1
        return 0.001, events, len(self.running)


def test_lockstep_counts_steady_concurrency_apart_from_the_drain():
    """Six requests, three in flight. Without the burst every lane finishes together: every step is steady. After
    it, two lanes run ahead and run out of requests first; the steps that follow run fewer rows (the drain), and the
    steady figures leave them out while the whole run's keep them."""
    ids = [f"r{i}" for i in range(6)]
    lanes = {"plain": _Lanes(10, None), "burst": _Lanes(10, 3)}
    runs = speculative.lockstep(lanes, ids, warmup_steps=0, in_flight=3)
    plain, burst = runs["plain"], runs["burst"]
    assert plain.steady_tokens == plain.timed_tokens == 60 and plain.steady_seconds == plain.seconds
    assert all(len(t) == 10 for t in burst.tokens.values())
    drained = [rows for rows in lanes["burst"].rows if rows < 3]
    assert drained and burst.steady_tokens == 60 - sum(drained)
    assert burst.steady_seconds < burst.seconds


def test_build_plan_alternates_the_two_orders_and_labels_each_build_apart():
    plan = speculative.build_plan(5)
    labels = [label for label, _ in plan]
    assert labels == ["off_built_first", "off_built_last", "off_built_first_2", "off_built_last_2", "off_built_first_3"]
    first, last = speculative.BUILDS["off_built_first"], speculative.BUILDS["off_built_last"]
    assert [order for _, order in plan] == [first, last, first, last, first]
    # over two builds off and adaptive swap arenas, and every build gives each worker an arena of its own
    first, last = dict(plan[0][1]), dict(plan[1][1])
    assert first["off"] == last["on_adaptive"] and first["on_adaptive"] == last["off"]
    assert all(len(set(dict(order).values())) == len(order) for _, order in plan)
