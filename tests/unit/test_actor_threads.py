"""Every device operation of an actor runs on its step thread: the actor's event-loop entry points only queue work.

On a GPU a tensor made on the event-loop thread (a device table at reservation, a layout unpacked from a
tensor transport) races the step thread's CUDA graph capture and, outside capture, queues behind the step.
Here the actor classes run without Ray (they are plain classes; Ray only wraps them), and a dispatch mode
pushed on the calling thread — the mode stack is per thread — records every tensor operation the entry
points run there. The step thread, not under the mode, still decodes the request to the end.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cachetier.layout import pack_layout
from cluster.decode_actor import DecodeActor
from cluster.protocol import Handoff
from core.configs import EAGER_STEP, TierConfig
from core.request import Attempt, Request
from core.types import SamplingParams, plain_token

TIER = TierConfig(offload=True, hot_buffer_slots=16, device_budget_bytes=4 * 2**20, host_pool_bytes=16 * 2**20)


class RecordOps(TorchDispatchMode):
    """Every aten op dispatched on the thread that entered it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def actor(tiny_dir):
    builders = []

    import cluster.prefill_actor as pa

    real = pa.load_model_for_actor

    def spy(*args, **kwargs):
        builders.append(threading.current_thread().name)
        return real(*args, **kwargs)

    pa.load_model_for_actor = spy
    try:
        a = DecodeActor("tiny", TIER, "d0", step=EAGER_STEP)
    finally:
        pa.load_model_for_actor = real
    a.built_on = builders
    yield a
    a.store.close()


def test_the_model_and_store_are_built_on_the_step_thread(actor):
    assert actor.built_on == [actor.thread.thread.name] and actor.thread.thread.name != threading.current_thread().name


def test_reserve_admit_and_poll_run_no_tensor_op_on_the_event_loop(actor):
    model = actor.model
    prompt = list(range(6, 90))
    with torch.inference_mode():
        _, layout = model.prefill(prompt, last_only=True)
    packed = pack_layout(layout, actor.format)
    sampling = SamplingParams(max_tokens=6, ignore_eos=True)
    h = Handoff(Attempt(Request("r1", tuple(prompt), sampling, 0), "r1", owner="gw").stripped(), plain_token(7), 1,
                actor.format, packed.tensor_bytes)

    async def entry_points():
        ok, _, _ = await actor.reserve("gw", "r1", len(prompt) + sampling.max_tokens)
        assert ok
        await actor.admit(h, packed)
        tokens = []
        deadline = time.monotonic() + 60
        while len(tokens) < sampling.max_tokens - 1 and time.monotonic() < deadline:
            msg = await actor.poll("gw")
            tokens += [t for d in msg.deltas.values() for t in d.token_ids]
        return tokens

    with RecordOps() as rec:
        tokens = asyncio.run(entry_points())
    assert rec.ops == [], rec.ops[:10]
    assert len(tokens) == sampling.max_tokens - 1  # the step thread decoded it: every token after the first came back
