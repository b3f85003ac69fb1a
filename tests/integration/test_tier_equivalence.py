"""With the hot buffer small enough to miss on every CSA layer, the tier changes nothing in the output.

Three stores run the same decode schedule: the tier on (C4 entries in the host pool, tiny hot
buffer), the tier off (everything in the device arena) and plain layouts (the model's own decode).
Ten requests of mixed lengths, greedy and seeded sampling, several joining mid-run and several
leaving early, eight or more decoding at once, 440 tokens or more for most of them (110 C4 entries against a hot
buffer of 20 slots).

The tier on also runs the schedule the way `decode_mode=compiled` does: padded to batch and context
buckets, the whole step captured by `torch.compile(fullgraph=True)` (with the `eager` backend here:
the capture is what is under test; `test_compiled_step` runs Inductor's code, and the tier off
captured against HF).

Both tiers also run it elastic (`reserve=estimate`, `cachetier.admission`) under a budget a fraction of the
schedule's final lengths: requests are admitted with a small output estimate, grow block by block, and are
paused (device state to host memory) when the device is full, resuming later; on top of that, requests are
paused by force at chosen steps. The stream is the same through every pause and resume.

With resident C4 entries (`TierConfig.resident`, `cachetier.residency`) the tier on runs it under a budget that
holds a few requests' C4 entries in full: requests become resident while there is room, shrink back to their hot
buffers as later ones join, and grow again as others leave, with more flips forced at chosen steps, so steps run
all-resident, mixed and not resident at all, eagerly, captured, and together with the elastic pauses.

With shared prefixes (`TierConfig.share_prefixes`, `cachetier.sharing`) every prompt begins with the same 300
tokens, two full pages of 128: each request after the first holds those pages by reference (its entry map apart),
while it is paused, resident, shrunk, captured, and after the first holders left; the stream is plain layouts' of
the same prompts.
"""

from __future__ import annotations

import pytest
import torch

from cachetier.store import LayoutStore, TieredStore
from core.configs import EAGER_STEP, StepConfig, TierConfig
from core.types import SamplingParams
from decode.worker import DecodeRequest, DecodeWorker
from model.sampling import sample

PROMPTS = [5, 40, 77, 128, 200, 333, 64, 3, 150, 91]
MAX_TOKENS = [470, 450, 440, 460, 480, 440, 450, 440, 250, 180]
JOIN_AT = [0, 0, 0, 0, 0, 0, 30, 60, 110, 250]  # steps at which each request is handed to decode
PAUSE_AT = {45: "r0", 100: "r3", 101: "r4", 200: "r5", 320: "r1", 400: "r2"}
"""Elastic schedules: steps at which a request (if running) is paused by force, besides the pauses for room."""
FLIP_AT = {20: "r1", 21: "r2", 90: "r1", 150: "r0", 151: "r2", 300: "r0", 310: "r3", 420: "r3"}
"""Resident schedules: steps at which a running request's residency is flipped by force (shrunk if resident, grown if
there is room), besides the rebalancing."""


CAPTURED = StepConfig(decode_mode="compiled", compile_backend="eager", warmup=False)


SHARED_PREFIX = 300
"""Shared-prefix schedules: tokens every prompt begins with (two full pages of `SHARED_PAGE`, then a partial one)."""
SHARED_PAGE = 128


def _schedule(model, store, step_config=None, short=False, pauses=None, flips=None, prefix=0):
    """`short`: the first six requests (all join at once) at half their length: still 50+ C4 entries each
    against a hot buffer of 20 slots (the bf16 runs, which check the same identity in the other dtype).
    `pauses`: step -> request id paused by force before that step (it resumes when room allows); the store's
    integrity is checked after every step that paused or resumed a request. `flips`: step -> request id whose
    residency is flipped by force before that step (integrity checked after every step whose residency changed).
    `prefix`: tokens every prompt begins with (given with the request, so a sharing store matches its pages)."""
    g = torch.Generator().manual_seed(123)
    common = torch.randint(6, model.cfg.vocab_size, (prefix,), generator=torch.Generator().manual_seed(7)).tolist()
    reqs = []
    lengths = [mt // 2 for mt in MAX_TOKENS[:6]] if short else MAX_TOKENS
    for i, (n, mt) in enumerate(zip(PROMPTS, lengths)):
        ids = common + torch.randint(6, model.cfg.vocab_size, (n,), generator=g).tolist()
        sp = SamplingParams(max_tokens=mt, ignore_eos=True, temperature=0.0 if i % 2 == 0 else 0.9, top_p=0.95)
        logits, layout = model.prefill(ids, last_only=True)
        first = sample(logits, [sp], [1000 + i], [0])[0]
        reqs.append(DecodeRequest.fresh(f"r{i}", layout, first, sp, seed=1000 + i, prompt_token_ids=ids))
    worker = DecodeWorker(model, store, max_running=16, step_config=step_config or EAGER_STEP)
    out = {r.request_id: [r.first_token.token_id] for r in reqs}
    step, max_batch = 0, 0
    while step == 0 or worker.has_work() or any(j >= step for j in JOIN_AT):
        for r, j in zip(reqs, JOIN_AT):
            if j == step:
                worker.submit(r)
        st = worker.store
        moves = tuple(getattr(st, k, 0) for k in ("swaps", "resumes", "promotions", "demotions"))
        if pauses and pauses.get(step) in worker.running:
            worker._pause(pauses[step])
        if flips and flips.get(step) in worker.running:
            rid = flips[step]
            if st.residents[rid].c4_pages:
                st.drop_resident(rid)
            else:
                st.make_resident(rid)
            worker.check_integrity()
        for ev in worker.step():
            out[ev.request_id].append(ev.token.token_id)
        if moves != tuple(getattr(st, k, 0) for k in ("swaps", "resumes", "promotions", "demotions")):
            worker.check_integrity()
        max_batch = max(max_batch, len(worker.running))
        step += 1
        if step % 250 == 0:
            worker.check_integrity()
    worker.check_integrity()
    runner = worker.runner
    summary = {"mode": runner.mode, "steps_by_bucket": dict(runner.steps_by_bucket), "compile_log": list(runner.compile_log),
               "compiles": runner.compiles, "steps": worker.steps, "stats": worker.stats(),
               "counters": worker.store.hot.counters.clone() if getattr(worker.store, "hot", None) is not None else None,
               "num_csa_layers": len(model.cfg.csa_layers)}
    return out, max_batch, summary


def _run(name: str, model_dir: str):
    """One schedule in a process of its own (one torch thread): `streams` runs two at a time."""
    import torch

    from model.loader import load_model

    torch.set_num_threads(1)
    short = name.endswith("_bf16")
    name = name.removesuffix("_bf16")
    model = load_model(model_dir, dtype=torch.bfloat16 if short else torch.float32)
    cfg = model.cfg
    budget = 64 * 2**20
    if name == "plain":
        return _schedule(model, LayoutStore(cfg), short=short)
    if name == "plain_shared":
        return _schedule(model, LayoutStore(cfg), prefix=SHARED_PREFIX)
    if name in ("on_shared", "on_shared_captured"):  # elastic, resident, paused and flipped; or captured and flipped
        eager = name == "on_shared"
        tier = TierConfig(offload=True, hot_buffer_slots=cfg.index_topk, reserved_slots=4, block_tokens=SHARED_PAGE,
                          device_budget_bytes=800_000 if eager else 2_600_000, host_pool_bytes=budget, resident=True,
                          share_prefixes=2, reserve="estimate" if eager else "final", output_estimate_tokens=16)
        return _schedule(model, TieredStore(cfg, tier, dtype=model.dtype), None if eager else CAPTURED,
                         pauses=PAUSE_AT if eager else None, flips=FLIP_AT, prefix=SHARED_PREFIX)
    if name in ("on_elastic", "off_elastic", "on_elastic_resident"):  # about 6 (on) and 4 (off) at their final length
        on = name != "off_elastic"
        tier = TierConfig(offload=on, hot_buffer_slots=cfg.index_topk if on else None, reserved_slots=4,
                          device_budget_bytes=900_000 if on else 1_100_000, host_pool_bytes=budget, reserve="estimate",
                          output_estimate_tokens=16, resident=name == "on_elastic_resident")
        return _schedule(model, TieredStore(cfg, tier, dtype=model.dtype), pauses=PAUSE_AT,
                         flips=FLIP_AT if tier.resident else None)
    if name in ("on_resident", "on_resident_captured"):  # room for the C4 entries of about 3 requests in full
        tier = TierConfig(offload=True, hot_buffer_slots=cfg.index_topk, reserved_slots=4, device_budget_bytes=2_000_000,
                          host_pool_bytes=budget, resident=True)
        return _schedule(model, TieredStore(cfg, tier, dtype=model.dtype), CAPTURED if name.endswith("captured") else None,
                         flips=FLIP_AT)
    if name == "off":
        return _schedule(model, TieredStore(cfg, TierConfig(offload=False, device_budget_bytes=budget), dtype=model.dtype),
                         short=short)
    on = TieredStore(cfg, TierConfig(offload=True, hot_buffer_slots=cfg.index_topk, reserved_slots=4,
                                     device_budget_bytes=budget, host_pool_bytes=64 * 2**20), dtype=model.dtype)
    return _schedule(model, on, CAPTURED if name == "on_captured" else None, short=short)


@pytest.fixture(scope="module")
def streams(tiny_dir):
    """The four schedules, two processes at a time: each is single-threaded Python and small tensors, so two
    processes on two cores take about half the time of one process with two threads."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    names = ("on_captured", "on_resident_captured", "on_shared_captured", "on", "off", "plain", "on_elastic", "off_elastic",
             "on_resident", "on_elastic_resident", "on_shared", "plain_shared", "on_bf16", "off_bf16",
             "plain_bf16")  # the slowest first
    with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {name: pool.submit(_run, name, str(tiny_dir)) for name in names}
        return {name: f.result() for name, f in futures.items()}


def test_streams_identical_across_tiers(streams):
    on, off, plain = streams["on"][0], streams["off"][0], streams["plain"][0]
    assert on == off
    assert on == plain
    assert [len(on[f"r{i}"]) for i in range(len(PROMPTS))] == MAX_TOKENS
    assert streams["on"][1] >= 8  # at least eight requests decoded side by side


def test_bf16_streams_identical_across_tiers(streams):
    """The same identity in bf16 (`--dtype bfloat16`, what a GPU serves): bf16 rows, bf16 arithmetic, tier on
    with misses on every CSA layer, off and plain layouts give one stream."""
    on, off, plain = streams["on_bf16"][0], streams["off_bf16"][0], streams["plain_bf16"][0]
    assert on == off == plain
    assert [len(on[f"r{i}"]) for i in range(6)] == [mt // 2 for mt in MAX_TOKENS[:6]]
    assert on != {k: v[: len(on[k])] for k, v in streams["on"][0].items() if k in on}  # bf16 is not fp32's stream
    counters = streams["on_bf16"][2]["counters"]
    assert bool((counters[:, 1] > 0).all()), counters  # misses on every CSA layer


@pytest.mark.parametrize("name", ["on_captured"])
def test_captured_step_gives_the_same_streams(streams, name):
    assert streams[name][2]["mode"] == "compiled"
    assert streams[name][0] == streams["on"][0]


@pytest.mark.parametrize("name", ["on_captured"])
def test_captured_step_compiles_once_per_bucket(streams, name):
    """Across 600+ steps and many buckets the step is captured whole (fullgraph) and never again for a bucket it has seen."""
    run = streams[name][2]
    steps = run["steps_by_bucket"]
    assert len(steps) >= 5 and len({rows for rows, _ in steps}) >= 4 and len({blocks for _, blocks in steps}) >= 2
    assert len(run["compile_log"]) == len(set(run["compile_log"])) == run["compiles"]
    assert 1 <= run["compiles"] <= 4  # symbolic rows and blocks: only sizes of 1 add a capture
    assert sum(steps.values()) == run["steps"]


@pytest.mark.parametrize("name", ["on", "on_captured"])
def test_misses_on_every_csa_layer(streams, name):
    run = streams[name][2]
    counters = run["counters"]  # [csa layers, (hits, misses, evictions)]
    assert counters.shape[0] == run["num_csa_layers"] >= 2
    assert bool((counters[:, 1] > 0).all()), counters
    assert bool((counters[:, 2] > 0).all()), counters
    stats = run["stats"]
    assert stats["bytes_h2d"] > 0 and stats["misses"] > 0


@pytest.mark.parametrize("name", ["on_elastic", "off_elastic"])
def test_elastic_streams_identical_through_pauses(streams, name):
    """Paused for room and by force, moved to host memory and back into other pages: the same stream."""
    assert streams[name][0] == streams["plain"][0]
    st = streams[name][2]["stats"]
    forced = len(PAUSE_AT)
    assert st["swaps"] > forced  # pauses for room too, not only the forced ones
    assert st["resumes"] == st["swaps"] and st["paused"] == 0 and st["swapped"] == 0
    assert st["output_estimate_tokens"] != 16  # the estimate learned from the requests that finished


@pytest.mark.parametrize("name", ["on_resident", "on_resident_captured", "on_elastic_resident"])
def test_resident_streams_identical_through_transitions(streams, name):
    """C4 entries resident while there is room, shrunk to hot buffers as others join, grown back as they leave, and
    flipped by force: the same stream, every step kind run, and no resolve work while everything is resident."""
    assert streams[name][0] == streams["plain"][0]
    st = streams[name][2]["stats"]
    flips = len(FLIP_AT)
    assert st["demotions"] > 3 and st["promotions"] > flips  # shrinks and growth for room, not only forced
    kinds = st["c4_mode_steps"]
    assert kinds.get("resident", 0) > 20 and kinds.get("mixed", 0) > 20, kinds
    assert st["misses"] > 0  # the requests that were not resident missed
    if name == "on_resident_captured":
        run = streams[name][2]
        assert run["mode"] == "compiled" and len(run["compile_log"]) == run["compiles"] <= 8


@pytest.mark.parametrize("name", ["on_shared", "on_shared_captured"])
def test_shared_prefix_streams_identical_through_transitions(streams, name):
    """Nine requests hold the first two pages of their prompts by reference: the same stream as plain layouts of the
    same prompts, through pauses, residency flips and a captured step; the pages were held once."""
    assert streams[name][0] == streams["plain_shared"][0]
    assert streams["plain_shared"][0] != streams["plain"][0]
    st = streams[name][2]["stats"]
    assert st["share_shared_pages"] == 2 * (len(PROMPTS) - 1)  # every request after the first, at its reservation
    assert st["share_freed"] == st["share_registered"] >= 2 and st["shared_pages_now"] == 0
    assert st["promotions"] > 0 and st["demotions"] > 0
    if name == "on_shared":
        assert st["swaps"] > len(PAUSE_AT) // 2 and st["resumes"] == st["swaps"]
    else:
        run = streams[name][2]
        assert run["mode"] == "compiled" and len(run["compile_log"]) == run["compiles"] <= 8


def test_nothing_resolved_while_every_request_is_resident(tiny_model):
    """Room for every request's C4 entries in full: after their first step they are all resident, the steps read
    their C4 pages directly, and the hot tier counts no hit and no miss."""
    cfg = tiny_model.cfg
    store = TieredStore(cfg, TierConfig(offload=True, hot_buffer_slots=cfg.index_topk, reserved_slots=4,
                                        device_budget_bytes=64 * 2**20, host_pool_bytes=64 * 2**20, resident=True),
                        dtype=tiny_model.dtype)
    out, _, summary = _schedule(tiny_model, store, short=True)
    ref, _, _ = _schedule(tiny_model, LayoutStore(cfg), short=True)
    assert out == ref
    st = summary["stats"]
    assert st["promotions"] == 6 and st["demotions"] == 0
    assert st["hits"] == 0 and st["misses"] == 0
    assert st["c4_mode_steps"].get("resident", 0) >= 200 and st["c4_mode_steps"].get("mixed", 0) <= 1


def test_everything_returned_after_the_run(streams):
    for name in ("on", "off", "on_captured", "on_bf16", "off_bf16", "on_elastic", "off_elastic", "on_resident",
                 "on_resident_captured", "on_elastic_resident", "on_shared", "on_shared_captured"):
        st = streams[name][2]["stats"]
        assert st["running"] == 0 and st["device_bytes_used"] == 0 and st["host_bytes_used"] == 0
        assert st["pages_free"] == st["pages_total"]
