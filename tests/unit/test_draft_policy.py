"""The adaptive draft count (`decode.speculative.DraftPolicy`) against synthetic step times and acceptance."""

from __future__ import annotations

from decode.speculative import DraftPolicy


def _drive(p: DraftPolicy, steps: int, cost_of, kept: int, bucket: int = 1, first=None) -> list[int]:
    """Run the policy for `steps` steps; each request keeps `kept` drafts of those it verified (all its rows warm)."""
    chosen = []
    for i in range(steps):
        n = p.choose(bucket)
        seconds = first(n, i) if first is not None else cost_of(n)
        p.record(bucket, n, seconds, [n] * bucket if n else None, [min(n, kept)] * bucket if n else None)
        chosen.append(n)
    return chosen


def test_one_slow_first_probe_does_not_decide():
    """N = 3 pays (2.2 tokens a step for 1.5x a plain step), but its first probe is ten times slow: the median of its
    samples forgets it, where an average starting from it would keep N = 3 off for hundreds of steps."""
    p = DraftPolicy(3, counts=[0, 3])
    slow_once = {"done": False}

    def first(n, i):
        if n == 3 and not slow_once["done"]:
            slow_once["done"] = True
            return 15.0
        return 1.5 if n else 1.0

    chosen = _drive(p, 300, None, kept=2, first=first)
    assert chosen[-250:].count(3) >= 240, chosen[-250:].count(3)


def test_a_count_that_cannot_pay_is_never_run_again():
    """A speculative step costing 3.8 plain ones with about 2.6 tokens kept: after its probes it is not re-measured,
    even though it costs less than N + 1 plain steps (what could pay at certain acceptance)."""
    p = DraftPolicy(3, counts=[0, 3])
    chosen = _drive(p, 2000, lambda n: 3.8 if n else 1.0, kept=2)
    assert chosen.count(3) == p.probe
    assert p.could_pay(1) == [0]


def test_a_losing_count_is_re_measured_ever_less_often_in_runs():
    """N = 3 could pay were its acceptance higher (cost 2.1 plain steps, 2 tokens kept): it is re-measured in runs
    of `probe` steps, each run further from the last, and the choice stays plain in between (a budget of 1%, so
    that the doubling, not the budget, spaces the first runs)."""
    p = DraftPolicy(3, counts=[0, 3], explore_every=20, explore_budget=0.01)
    chosen = _drive(p, 3000, lambda n: 2.1 if n else 1.0, kept=1)
    starts = [i for i in range(1, len(chosen)) if chosen[i] == 3 and chosen[i - 1] == 0]
    assert len(starts) >= 4
    assert all(chosen[s : s + p.probe] == [3] * p.probe for s in starts)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    # the interval doubles while it loses (or holds, within a run's length, where the explore budget spaces them
    # further already)
    assert all(g2 >= g1 - p.probe for g1, g2 in zip(gaps, gaps[1:])) and gaps[-1] > gaps[0], gaps
    assert chosen.count(3) < 40


def test_a_count_that_starts_paying_is_chosen_again():
    """The text changes: drafts that were mostly rejected start being kept; a re-measurement finds N = 3 paying and the
    policy switches to it (and keeps re-measuring promptly from then on)."""
    p = DraftPolicy(3, counts=[0, 3], explore_every=20)
    _drive(p, 400, lambda n: 1.9 if n else 1.0, kept=0)
    later = _drive(p, 6000, lambda n: 1.9 if n else 1.0, kept=3)
    assert later[-500:].count(3) >= 480


def test_re_measuring_a_losing_count_costs_at_most_the_explore_budget():
    """N = 3 keeps 2 of its drafts for 3.1 plain steps' time: it loses, yet could pay were its third draft kept more
    often, so it is re-measured. Past the bucket's first probes, the time those re-measurements lose against plain
    steps (their cost less one plain step per token they kept) stays within `explore_budget` of the time elapsed, at
    every point of the run, not only on average over a long one."""
    p = DraftPolicy(3, counts=[0, 3], explore_every=20)
    cost = {0: 1.0, 3: 3.1}
    lost = elapsed = 0.0
    probes = 2 * p.probe
    prev = 0
    for i in range(9000):
        n = p.choose(1)
        kept = 1 + min(n, 2) if n and prev else 1  # the first step after plain ones only drafts
        prev = n
        p.record(1, n, cost[n], [n] if n else None, [min(n, 2)] if n else None)
        if i >= probes:
            elapsed += cost[n]
            lost += cost[n] - kept * cost[0]
            assert lost <= p.explore_budget * elapsed + 1e-9, (i, lost, elapsed)
    assert p.choices[1][3] > p.probe  # it was re-measured (could_pay holds), only rarely


def test_a_re_measurement_that_runs_cold_is_spaced_by_what_it_lost():
    """N = 3 keeps one draft for 2.1 plain steps' time (a small loss, and it could pay were more drafts kept), and the
    first step of every re-measurement of it runs cold (ten plain steps' time, which the median cost does not show):
    from the second re-measurement on (the first told the policy what one loses), each loses at most the explore
    budget of the time since the one before (a budget of 1%, so that a few re-measurements fit the run)."""
    p = DraftPolicy(3, counts=[0, 3], explore_every=20, explore_budget=0.01)
    prev, steps = 0, []
    for _ in range(6000):
        n = p.choose(1)
        seconds = (10.0 if not prev else 2.1) if n else 1.0
        kept = 1 + min(n, 1) if n and prev else 1
        prev = n
        p.record(1, n, seconds, [n] if n else None, [min(n, 1)] if n else None, kept=kept if n and kept > 1 else None)
        steps.append((n, seconds, kept))
    starts = [i for i in range(2 * p.probe + 1, len(steps)) if steps[i][0] and not steps[i - 1][0]]
    assert len(starts) >= 3
    for a, b in zip(starts[1:], starts[2:]):  # the time from one re-measurement to the next, and what the next lost
        elapsed = sum(sec for _, sec, _ in steps[a + p.probe : b + p.probe])
        lost = sum(sec - kept for _, sec, kept in steps[b : b + p.probe])
        assert lost <= p.explore_budget * elapsed, (a, b, lost, elapsed)


def _slow_stretch(p: DraftPolicy, cost: dict[int, float], kept: int, start: int, length: int, factor: float,
                  steps: int) -> list[int]:
    """Drive the policy for `steps` steps; from step `start` on, for `length` steps, every step takes `factor` times
    its cost (the whole machine slows down: a neighbour's burst)."""
    chosen = []
    for i in range(steps):
        n = p.choose(1)
        slow = factor if start <= i < start + length else 1.0
        p.record(1, n, cost[n] * slow, [n] if n else None, [min(n, kept)] if n else None)
        chosen.append(n)
    return chosen


def test_a_slower_machine_does_not_stop_speculation_that_pays():
    """N = 3 keeps 3 drafts for 1.9 plain steps' time: it pays. A stretch where every step runs 2.5 times as slow comes
    while it is the choice: its step times rise, the plain step's are not measured then, and only times taken side by
    side are compared, so the choice stays (comparing fresh speculative times with plain ones from before the stretch
    switched to plain, and every plain step restarts the MTP rings)."""
    p = DraftPolicy(3, counts=[0, 3])
    chosen = _slow_stretch(p, {0: 1.0, 3: 1.9}, kept=3, start=200, length=60, factor=2.5, steps=400)
    assert chosen[20:].count(0) == 0, [i for i, n in enumerate(chosen) if i >= 20 and n == 0]


def test_a_slower_machine_does_not_start_speculation_that_does_not_pay():
    """N = 3 keeps 2 drafts for 3.1 plain steps' time: it loses, the plain step is the choice. A stretch where every
    step runs 1.4 times as slow makes the plain step's times rise while N = 3's are from before it: the choice stays
    plain, bar the budgeted re-measurements."""
    p = DraftPolicy(3, counts=[0, 3])
    chosen = _slow_stretch(p, {0: 1.0, 3: 3.1}, kept=2, start=100, length=200, factor=1.4, steps=400)
    spec = [i for i, n in enumerate(chosen) if n and i >= 2 * p.probe]
    assert len(spec) <= p.probe, spec


def test_the_settled_plain_step_computes_nothing():
    """While the plain step is the choice and no re-measurement is due, `choose` and `record` neither estimate tokens
    nor take a median: on a CPU that work, with the interpreter's caches cold after each step, was about 1% of a plain
    step at batch 16."""
    p = DraftPolicy(3, counts=[0, 3])
    _drive(p, 2 * p.probe + 1, lambda n: 3.8 if n else 1.0, kept=1)  # the probes: N = 3 cannot pay
    calls = []
    estimate = p.expected_tokens
    p.expected_tokens = lambda *a, **k: calls.append(a) or estimate(*a, **k)
    chosen = _drive(p, 200, lambda n: 3.8 if n else 1.0, kept=1)
    assert chosen == [0] * 200
    # what could pay follows the acceptance learnt anywhere: looked at again every `explore_every` steps
    assert len(calls) <= 200 // p.explore_every * 2 * len(p.counts), len(calls)


def test_a_count_whose_timed_cost_could_not_pay_is_not_even_probed():
    """A bucket's first probes of a count cost the most (at high batch, a speculative step of four rows per request
    costs several plain ones): a count timed before serving (`seed`) at 3.8 plain steps, against at most ~2.7 tokens
    even at half-certain acceptance, is never run, while the plain step settles at once; a count timed at 1.4 is
    probed, and then its measured cost, not the seed, decides."""
    p = DraftPolicy(3, counts=[0, 3])
    p.seed(16, 3, 3.8)
    assert _drive(p, 2000, lambda n: 3.8 if n else 1.0, kept=2, bucket=16).count(3) == 0
    assert p.could_pay(16) == [0] and 3 not in p.buckets[16].ratio

    p = DraftPolicy(3, counts=[0, 3])
    p.seed(1, 3, 1.4)
    chosen = _drive(p, 300, lambda n: 1.5 if n else 1.0, kept=2)
    assert chosen[p.probe : 2 * p.probe] == [3] * p.probe and chosen[-100:].count(3) >= 95
    assert p.buckets[1].ratio[3] == 1.5


def test_a_count_left_unprobed_is_probed_once_its_acceptance_could_make_it_pay():
    """The seed rules a count out only while it could not pay: once the acceptance learnt in another bucket rises so
    that it could, the bucket probes it and follows what it measures."""
    p = DraftPolicy(3, counts=[0, 3], explore_every=20)
    p.seed(16, 3, 2.6)
    _drive(p, 200, lambda n: 1.2 if n else 1.0, kept=0, bucket=1)  # drafts mostly rejected: alpha falls
    assert _drive(p, 200, lambda n: 2.6 if n else 1.0, kept=0, bucket=16).count(3) == 0
    _drive(p, 400, lambda n: 1.2 if n else 1.0, kept=3, bucket=1)  # now every draft is kept
    later = _drive(p, 400, lambda n: 2.6 if n else 1.0, kept=3, bucket=16)
    assert later[:100].count(3) >= p.probe and later[-100:].count(3) >= 95


def test_a_seeded_count_that_could_pay_only_at_a_higher_acceptance_is_probed_within_the_budget():
    """Timed at 3 plain steps where it keeps about 3 tokens, N = 3 would not be chosen (the margin), yet could pay were
    its third draft kept more often: its first probe waits until the bucket has run long enough for the probe's
    expected loss (about 2 plain steps) to be `explore_budget` of its time, as a re-measurement's does."""
    p = DraftPolicy(3, counts=[0, 3])
    _drive(p, 300, lambda n: 1.2 if n else 1.0, kept=2)  # bucket 1: the first two drafts kept, the third never
    p.seed(16, 3, 3.0)
    first = _drive(p, 1500, lambda n: 3.0 if n else 1.0, kept=2, bucket=16)
    assert first.count(3) == 0 and 3 in p.could_pay(16)
    later = _drive(p, 1500, lambda n: 3.0 if n else 1.0, kept=2, bucket=16)
    assert p.probe <= later.count(3) <= 2 * p.probe and 3 in p.buckets[16].ratio


def _mixed_run(p: DraftPolicy, steps: int = 6000) -> list[tuple[int, int]]:
    """A long run over three buckets whose batch moves now and then (seeded), with noisy step times and an acceptance
    that drifts: the cost per count grows with the bucket, so buckets 1 and 4 speculate (N = 1 or 2 as the acceptance
    moves) and bucket 16 settles on plain. -> (bucket, count) of every step."""
    import random

    draw = random.Random(7)
    bucket, out = 16, []
    for i in range(steps):
        if draw.random() < 0.004:
            bucket = draw.choice([1, 4, 16, 16, 16])
        n = p.choose(bucket)
        cost = (1.0 + n * {1: 0.05, 4: 0.35, 16: 1.5}[bucket]) * draw.uniform(0.97, 1.03)
        kept = 2 if (i // 1500) % 2 == 0 else 1
        p.record(bucket, n, cost, [n] * bucket if n else None, [min(n, kept)] * bucket if n else None)
        out.append((bucket, n))
    return out


def test_quiet_plain_steps_choose_and_count_as_full_ones():
    """While the plain step is settled on, `choose` and `record` skip the per-bucket bookkeeping (`DraftPolicy._go_quiet`):
    every choice, every count and what the bucket knows at the end are those of the same policy doing it all every
    step, and most of a settled bucket's steps were quiet."""
    quiet, full = DraftPolicy(3), DraftPolicy(3)
    full._go_quiet = lambda bucket, b: None  # the full path on every step
    went_quiet = []
    go = quiet._go_quiet
    quiet._go_quiet = lambda bucket, b: (go(bucket, b), went_quiet.append(quiet._quiet is not None))

    assert _mixed_run(quiet) == _mixed_run(full)
    assert quiet.choices == full.choices and quiet.steps == full.steps
    quiet.choose(99)  # another bucket: the quiet stretch is counted in
    full.choose(99)
    for bucket in (1, 4, 16):
        a, b = quiet.buckets[bucket], full.buckets[bucket]
        known = lambda x: (x.choice, x.due, x.tried, x.last_tried, x.ratio, x.interval)  # noqa: E731
        assert known(a) == known(b)
    assert quiet._choices == full._choices
    assert full.choices[16][0] > 1000 and sum(went_quiet) > 20


def test_a_quiet_stretch_touches_no_bucket_state_and_ends_before_the_due_step():
    """Settled on plain in bucket 16: the steps of a quiet stretch leave the bucket's times, counts and stamps as they
    were (the skipped work), and its last `window` steps before the due one are full steps again, so the re-measurement
    pairs with fresh plain times."""
    p = DraftPolicy(3, counts=[0, 3])
    _drive(p, 200, lambda n: 3.8 if n else 1.0, kept=2, bucket=16)
    for _ in range(p.explore_every):  # a re-measurement is looked for at least every `explore_every` steps
        if p._quiet == 16:
            break
        _drive(p, 1, lambda n: 3.8 if n else 1.0, kept=2, bucket=16)
    assert p._quiet == 16
    b = p.buckets[16]
    before = (list(b.times[0]), dict(b.tried), dict(b.last_tried), b.due)
    p.choose(16)
    p.record(16, 0, 123.0)
    assert (list(b.times[0]), dict(b.tried), dict(b.last_tried), b.due) == before
    assert p.choices[16][0] == before[1][0] + 1  # counted all the same
    while p.steps + 1 < p._quiet_until:
        assert p.choose(16) == 0
        p.record(16, 0, 1.0)
    p.choose(16)
    p.record(16, 0, 5.0)  # the first step after the stretch is a full one
    assert p._quiet is None and b.times[0][-1] == 5.0
    assert b.tried[0] == p.choices[16][0] and b.last_tried[0] == p.steps


def test_a_first_probe_that_ran_cold_against_a_paying_seed_is_measured_again_soon():
    """N = 3 was timed at 1.8 plain steps before serving (it pays), but its first run in the bucket ran cold at 3.0.
    The two disagree, so it is re-measured at its plain interval rather than after the thousands of steps the
    exploration budget would space it by, and once its runs measure 1.5 it is the choice."""
    p = DraftPolicy(3, counts=[0, 3])
    p.seed(1, 3, 1.8)
    runs = {"n": 0}

    def cost(n, i):
        if not n:
            return 1.0
        runs["n"] += 1
        return 3.0 if runs["n"] <= p.probe else 1.5

    chosen = _drive(p, 400, None, kept=2, first=cost)
    assert chosen[: 2 * p.probe] == [0] * p.probe + [3] * p.probe  # plain first, then the (cold) probe
    assert chosen[2 * p.probe] == 0  # which said it did not pay
    assert chosen[-200:].count(3) >= 190, chosen[-200:].count(3)


def test_a_slow_probe_where_the_seed_does_not_pay_is_not_hurried():
    """Timed at 3.5 plain steps before serving (it does not pay) and costing 3.0: nothing disputes what is measured,
    so runs of it stay spaced by the exploration budget, at most one in a thousand steps."""
    p = DraftPolicy(3, counts=[0, 3])
    p.seed(1, 3, 3.5)
    chosen = _drive(p, 1000, lambda n: 3.0 if n else 1.0, kept=2)
    assert chosen.count(3) <= p.probe
