"""With the hot buffer small enough to miss on every CSA layer, the tier changes nothing in the output.

Three stores run the same decode schedule: the tier on (C4 entries in the host pool, tiny hot
buffer), the tier off (everything in the device arena) and plain layouts (the model's own decode).
Ten requests of mixed lengths, greedy and seeded sampling, several joining mid-run and several
leaving early, eight or more decoding at once, over 1000 tokens for most of them.

The tier on also runs the schedule the way `decode_mode=compiled` does: padded to batch and context
buckets, the whole step captured by `torch.compile(fullgraph=True)` (with the `eager` backend here:
the capture is what is under test; `test_compiled_step` runs Inductor's code, and the tier off
captured against HF).
"""

from __future__ import annotations

import pytest
import torch

from cachetier.store import LayoutStore, TieredStore
from core.roles import StepConfig, TierConfig
from core.types import SamplingParams
from decode.worker import DecodeRequest, DecodeWorker
from model.sampling import sample

PROMPTS = [5, 40, 77, 128, 200, 333, 64, 3, 150, 91]
MAX_TOKENS = [1050, 1020, 1000, 1010, 1040, 1000, 1030, 1000, 300, 250]
JOIN_AT = [0, 0, 0, 0, 0, 0, 40, 90, 160, 420]  # steps at which each request is handed to decode


CAPTURED = StepConfig(decode_mode="compiled", compile_backend="eager", warmup=False)


def _schedule(model, store, step_config=None):
    g = torch.Generator().manual_seed(123)
    reqs = []
    for i, (n, mt) in enumerate(zip(PROMPTS, MAX_TOKENS)):
        ids = torch.randint(6, model.cfg.vocab_size, (n,), generator=g).tolist()
        sp = SamplingParams(max_tokens=mt, ignore_eos=True, temperature=0.0 if i % 2 == 0 else 0.9, top_p=0.95)
        logits, layout = model.prefill(ids, last_only=True)
        first = sample(logits, [sp], [1000 + i], [0])[0]
        reqs.append(DecodeRequest(f"r{i}", layout, first, sp, seed=1000 + i))
    worker = DecodeWorker(model, store, max_running=16, step_config=step_config)
    out = {r.request_id: [r.first_token.token_id] for r in reqs}
    step, max_batch = 0, 0
    while step == 0 or worker.has_work() or any(j >= step for j in JOIN_AT):
        for r, j in zip(reqs, JOIN_AT):
            if j == step:
                worker.submit(r)
        for ev in worker.step():
            out[ev.request_id].append(ev.token.token_id)
        max_batch = max(max_batch, len(worker.running))
        step += 1
        if step % 250 == 0:
            worker.check_integrity()
    worker.check_integrity()
    return out, max_batch, worker


@pytest.fixture(scope="module")
def streams(tiny_model):
    cfg = tiny_model.cfg
    budget = 64 * 2**20

    def on():
        return TieredStore(cfg, TierConfig(offload=True, hot_buffer_slots=cfg.index_topk, reserved_slots=4,
                                           device_budget_bytes=budget, host_pool_bytes=64 * 2**20))

    def off():
        return TieredStore(cfg, TierConfig(offload=False, device_budget_bytes=budget))

    return {
        "on": _schedule(tiny_model, on()),
        "off": _schedule(tiny_model, off()),
        "plain": _schedule(tiny_model, LayoutStore(cfg)),
        "on_captured": _schedule(tiny_model, on(), CAPTURED),
    }


def test_streams_identical_across_tiers(streams):
    on, off, plain = streams["on"][0], streams["off"][0], streams["plain"][0]
    assert on == off
    assert on == plain
    assert [len(on[f"r{i}"]) for i in range(len(PROMPTS))] == MAX_TOKENS
    assert streams["on"][1] >= 8  # at least eight requests decoded side by side


@pytest.mark.parametrize("name", ["on_captured"])
def test_captured_step_gives_the_same_streams(streams, name):
    assert streams[name][2].runner.mode == "compiled"
    assert streams[name][0] == streams["on"][0]


@pytest.mark.parametrize("name", ["on_captured"])
def test_captured_step_compiles_once_per_bucket(streams, name):
    """Across 1000+ steps and many buckets the step is captured whole (fullgraph) and never again for a bucket it has seen."""
    runner = streams[name][2].runner
    steps = runner.steps_by_bucket
    assert len(steps) >= 5 and len({rows for rows, _ in steps}) >= 4 and len({blocks for _, blocks in steps}) >= 3
    assert len(runner.compile_log) == len(set(runner.compile_log)) == runner.compiles
    assert 1 <= runner.compiles <= 4  # symbolic rows and blocks: only sizes of 1 add a capture
    assert sum(steps.values()) == streams[name][2].steps


@pytest.mark.parametrize("name", ["on", "on_captured"])
def test_misses_on_every_csa_layer(streams, name):
    worker = streams[name][2]
    counters = worker.store.counters  # [csa layers, (hits, misses, evictions)]
    assert counters.shape[0] == len(worker.model.cfg.csa_layers) >= 2
    assert bool((counters[:, 1] > 0).all()), counters
    assert bool((counters[:, 2] > 0).all()), counters
    stats = worker.stats()
    assert stats["bytes_h2d"] > 0 and stats["misses"] > 0


def test_everything_returned_after_the_run(streams):
    for name in ("on", "off", "on_captured"):
        st = streams[name][2].stats()
        assert st["running"] == 0 and st["device_bytes_used"] == 0 and st["host_bytes_used"] == 0
        assert st["pages_free"] == st["pages_total"]
