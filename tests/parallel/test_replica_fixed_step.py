"""Decode workers of an expert-parallel replica (real processes, gloo) in lockstep make the tokens one
process makes, with the fixed-shape step (what `auto` runs on a replica rank) and with the eager one.

Every rank is a `DecodeWorker` joined to its replica; requests arrive at given steps (`replica_harness`,
worker workload), so within one run:
- a rank has no request in some steps while the other decodes (it runs the agreed bucket over padding
  rows only), and in some steps nobody has work (no forward at all);
- the ranks need different buckets (3 short requests on one, one long one on the other), and both run
  the largest rows and the widest block table either needs;
- a `solo` request decodes in a forward of its own, so some steps have two rounds, the second in a bucket
  of its own (one row) on both ranks.
The fixed-shape step's exchanges are sized by that agreement: each step gathers once on the host (the
agreement) and no forward gathers row counts. Ranks that would step differently refuse to start.
"""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp
from replica_harness import WORKER_STEPS, Arrival, run_worker_reference, run_worker_replica

from model.builtin import tiny_config
from model.loader import load_model

pytestmark = pytest.mark.timeout(300)

LAYOUT = "dp2+ep2"
SEED = 5
SCHEDULE = [
    # rank 0: three requests at once (rows bucket 4, 3 blocks of 64 tokens -> 4), then nothing for a while,
    # then one more
    [Arrival(150, 0, 10), Arrival(90, 0, 7), Arrival(40, 0, 4), Arrival(30, 14, 5)],
    # rank 1: nothing at first; a long request (301 tokens: 8 blocks) alone, a solo one beside it, one at the end
    [Arrival(300, 3, 12), Arrival(20, 5, 6, solo=True), Arrival(60, 20, 3)],
]


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return run_worker_reference(load_model(tiny_dir), SCHEDULE, SEED)


def _same_tokens(ranks, reference):
    for r, (got, want) in enumerate(zip(ranks, reference)):
        assert want["left"] == 0 and got["left"] == 0, "the schedule did not finish within its steps"
        assert got["tokens"] == want["tokens"], f"rank {r}: greedy tokens differ from one process's"


def test_fixed_shape_lockstep_makes_one_process_tokens(tiny_dir, tmp_path, reference):
    ranks = run_worker_replica(LAYOUT, str(tiny_dir), str(tmp_path), SCHEDULE, SEED, "auto")
    _same_tokens(ranks, reference)
    assert [got["mode"] for got in ranks] == ["fixed_eager", "fixed_eager"]

    # the agreement: every rank ran the same rounds in the same buckets, each at least what its own requests need
    agreed = [[plan[1:] for plan in got["plans"]] for got in ranks]
    assert agreed[0] == agreed[1] and len(agreed[0]) == WORKER_STEPS
    assert ranks[0]["steps_by_bucket"] == ranks[1]["steps_by_bucket"]
    for got in ranks:
        for need, rounds, first, *_ in got["plans"]:
            if rounds:
                assert first[0] >= need[0] and first[1] >= need[1]
    # in one step, one rank ran more rows than it needs and the other a wider block table than it needs
    steps = list(zip(ranks[0]["plans"], ranks[1]["plans"]))
    assert any(a[0][0] < a[2][0] and 0 < b[0][1] < b[2][1] or b[0][0] < b[2][0] and 0 < a[0][1] < a[2][1]
               for a, b in steps if a[1]), f"the ranks never needed different buckets: {steps}"
    # both ranks had steps with no request of their own while the other decoded: padding rows only
    for r, got in enumerate(ranks):
        assert got["idle_forwards"] > 0, f"rank {r} never ran a padding-only forward"
        assert any(not busy and other for busy, other in zip(got["busy"], ranks[1 - r]["busy"]))
    # a second round (the solo request) in a bucket of its own
    rests = {rest for _, rounds, _, rest, _ in ranks[0]["plans"] if rounds > 1}
    assert rests == {(1, 1)}
    assert any(rounds == 0 for _, rounds, *_ in ranks[0]["plans"]), "no step without work: the schedule changed"

    # collectives: one gather per step (the agreement) plus the prefill's; none inside a decode forward
    cfg = tiny_config()
    forwards = sum(rounds for _, rounds, *_ in ranks[0]["plans"])
    assert forwards == sum(ranks[0]["steps_by_bucket"].values())
    for got in ranks:
        calls = got["stats"]["calls"]
        assert calls["meta_all_gather"] == WORKER_STEPS + 1
        assert calls["ep_all_gather"] == calls["ep_reduce_scatter"] == cfg.num_layers * (forwards + 1)


def test_speculative_lockstep_makes_one_process_tokens(tiny_dir, tmp_path, reference):
    """Every rank with the MTP head, two drafts a step: the ranks agree on each step's span with its bucket, the rank
    without work runs the agreed speculative round over padding rows, and the tokens are one process's without
    speculation."""
    ranks = run_worker_replica(LAYOUT, str(tiny_dir), str(tmp_path), SCHEDULE, SEED, "auto",
                               step_kw={"speculative_adaptive": False}, spec=2)
    _same_tokens(ranks, reference)
    assert ranks[0]["spans"] == ranks[1]["spans"] and 3 in ranks[0]["spans"], ranks[0]["spans"]
    assert [plan[1:] for plan in ranks[0]["plans"]] == [plan[1:] for plan in ranks[1]["plans"]]
    assert all(got["speculation"]["steps"] > 0 for got in ranks)
    assert any(isinstance(k, tuple) and k[0] == "spec" for k in ranks[0]["steps_by_bucket"])


def test_eager_lockstep_makes_one_process_tokens(tiny_dir, tmp_path, reference):
    ranks = run_worker_replica(LAYOUT, str(tiny_dir), str(tmp_path), SCHEDULE, SEED, "eager")
    _same_tokens(ranks, reference)
    assert [got["mode"] for got in ranks] == ["eager", "eager"]
    forwards = sum(rounds for _, rounds, *_ in ranks[0]["plans"])
    for got in ranks:
        assert got["plans"] and all(first is None for _, _, first, *_ in got["plans"])
        assert got["idle_forwards"] == 0 and got["steps_by_bucket"] == {}
        # one gather per step (forwards to run) and one inside every forward (its row counts), prefill included
        assert got["stats"]["calls"]["meta_all_gather"] == WORKER_STEPS + forwards + 1


def test_ranks_that_would_step_differently_refuse_to_start(tiny_dir, tmp_path):
    """One rank fixed-shape and one eager would wait on each other's gathers for ever: both refuse at join."""
    with pytest.raises(mp.ProcessRaisedException, match="would run their decode steps differently"):
        run_worker_replica(LAYOUT, str(tiny_dir), str(tmp_path), SCHEDULE, SEED, ["auto", "eager"])
    assert not list(tmp_path.glob("rank*.pt"))
