"""A decode replica over nccl, every rank's fixed-shape step one CUDA graph with its MoE exchanges inside,
makes the tokens one process makes (the worker schedule of `test_replica_fixed_step`, one GPU per rank).

Needs two GPUs: nccl puts one rank on each (skipped below two; one GPU checks the captured rank step with
a stand-in communicator instead, tests/integration/test_capture_safety.py).
"""

from __future__ import annotations

import pytest
import torch
from replica_harness import run_worker_reference, run_worker_replica
from test_replica_fixed_step import LAYOUT, SCHEDULE, SEED

from model.builtin import tiny_config
from model.loader import load_model

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an nccl replica needs two GPUs")]


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return run_worker_reference(load_model(tiny_dir, device="cuda:0"), SCHEDULE, SEED)


def _forwards(got) -> int:
    return sum(rounds for _, rounds, *_ in got["plans"])


def test_captured_replica_makes_one_process_tokens(tiny_dir, tmp_path, reference):
    ranks = run_worker_replica(LAYOUT, str(tiny_dir), str(tmp_path), SCHEDULE, SEED, "auto", device_kind="cuda")
    for r, (got, want) in enumerate(zip(ranks, reference)):
        assert got["tokens"] == want["tokens"], f"rank {r}: greedy tokens differ from one process's"
        assert got["mode"] == "cuda_graphs"
        assert got["uncaptured"] == 0, "a step ran uncaptured: its bucket was not captured before serving"
    assert ranks[0]["graphs"] == ranks[1]["graphs"] and ranks[0]["graphs"]
    assert ranks[0]["steps_by_bucket"] == ranks[1]["steps_by_bucket"]
    # every replayed forward counted its exchanges (the capture recorded them; replays run no Python)
    layers = tiny_config().num_layers
    for got in ranks:
        calls = got["stats"]["calls"]
        assert calls["ep_all_gather"] == calls["ep_reduce_scatter"] == layers * (_forwards(got) + 1)
        assert calls["meta_all_gather"] == len(got["plans"]) + 1


def test_buckets_found_uncaptured_are_captured_by_every_rank_when_nobody_has_work(tiny_dir, tmp_path, reference):
    # warm-up captures one-block tables only: the schedule's wider buckets run uncaptured, then are captured
    # in the steps where no rank has a request, every rank the same bucket at the same step
    ranks = run_worker_replica(LAYOUT, str(tiny_dir), str(tmp_path), SCHEDULE, SEED, "auto", device_kind="cuda",
                               step_kw={"capture_context_tokens": 64})
    for r, (got, want) in enumerate(zip(ranks, reference)):
        assert got["tokens"] == want["tokens"], f"rank {r}: greedy tokens differ from one process's"
        assert got["uncaptured"] > 0 and got["pending"] == []
    captures = [[(step, plan[4]) for step, plan in enumerate(got["plans"]) if plan[4] is not None] for got in ranks]
    assert captures[0] == captures[1] and captures[0], "the ranks did not capture the same buckets at the same steps"
    assert all(bucket[1] > 1 for _, bucket in captures[0])
    assert ranks[0]["graphs"] == ranks[1]["graphs"]
    assert {bucket for _, bucket in captures[0]} <= set(ranks[0]["graphs"])
