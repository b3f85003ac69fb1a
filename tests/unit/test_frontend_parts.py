"""The frontend's parts without Ray: placement's request cap, a poll loop that survives any error, a prefill
actor whose layout cannot be packed.

Actor handles here are stand-ins whose `.remote(...)` returns an awaitable, as a Ray actor method's does; the
prefill actor is the real class run without Ray (its step thread is real).
"""

from __future__ import annotations

import asyncio

import pytest

from cluster.frontend import Frontend
from cluster.placement import Placement
from cluster.protocol import Capacity, DecodeInfo, Delta, PrefillInfo, PrefillStats, Report, StepFailure, StepMessage
from core.configs import DeadlineConfig
from core.request import Attempt, Request
from core.types import SamplingParams

COMMON = dict(node_id="n", pid=1, layout_format="f", describe="cpu")


class _Method:
    def __init__(self, fn) -> None:
        self.fn, self.calls = fn, 0

    def remote(self, *args):
        self.calls += 1
        return self.fn(*args)


class _Handle:
    def __init__(self, **methods) -> None:
        for name, fn in methods.items():
            setattr(self, name, _Method(fn))


def _decode_info(name: str, max_running: int = 8, keeps: bool = False, shares: bool = False) -> DecodeInfo:
    return DecodeInfo(name=name, capacity=Capacity(num_pages=1000, group_pages=1, block_tokens=256, max_running=max_running,
                                                   keeps=keeps, shares=shares), **COMMON)


def _prefill_info(name: str) -> PrefillInfo:
    return PrefillInfo(name=name, prefix_page_tokens=None, prefix_affinity_slack=0, prefix_pages=(), **COMMON)


def _report(running: int, reserved: int, waiting: int = 0, free: int = 900) -> Report:
    return Report("d", free, 1000, 0, running, waiting, reserved, 0.0)


def test_a_decode_actor_at_its_request_cap_is_not_asked():
    """`might_fit` reads the actor's request cap (`max_running`): an actor whose running + reserved + arriving
    requests are at the cap gets no `reserve` call, however many pages it has free."""
    async def reserve(owner, key, tokens, prefix_keys=()):
        return True, _report(1, 1), 0

    full, free = _Handle(reserve=reserve), _Handle(reserve=reserve)
    fe = Frontend([(_Handle(), _prefill_info("p"))], [(full, _decode_info("full", 2)), (free, _decode_info("free", 2))])
    fe.decode[0].report = _report(running=1, reserved=1, free=990)  # most pages free, but at its cap
    fe.decode[1].report = _report(running=1, reserved=0, free=10)
    assert not Placement.might_fit(fe.decode[0], 1) and Placement.might_fit(fe.decode[1], 1)
    attempt = Attempt(Request("r", (1, 2, 3), SamplingParams(max_tokens=4), 0), "r.0")
    m, keys, held = asyncio.run(fe.placement.reserve(attempt, set()))
    assert m is fe.decode[1] and keys == () and held == 0 and full.reserve.calls == 0 and free.reserve.calls == 1


def test_a_follow_up_turn_asks_the_actor_that_kept_its_prompt_first():
    """With `--retain-bytes`, the decode actor that kept the longest prefix of the context is asked first even
    when another has more pages free, and it gets the context's page keys; the usual order (most free pages
    first) holds for a prompt nobody kept."""
    asked: list[tuple[str, tuple[str, ...]]] = []
    reports = {"keeper": _report(running=1, reserved=0, free=100),
               "other": _report(running=0, reserved=0, free=900)}  # the usual order asks `other` first

    def reserve_as(name):
        async def reserve(owner, key, tokens, prefix_keys=()):
            asked.append((name, tuple(prefix_keys)))
            return True, reports[name], 256 if prefix_keys and name == "keeper" else 0
        return reserve

    keeper, other = _Handle(reserve=reserve_as("keeper")), _Handle(reserve=reserve_as("other"))
    fe = Frontend([(_Handle(), _prefill_info("p"))], [(keeper, _decode_info("keeper", keeps=True)),
                                                      (other, _decode_info("other", keeps=True))])
    for m in fe.decode:
        m.report = reports[m.name]
    first = tuple(range(300))
    fe.kept.record("keeper", fe.kept.keys(first))
    follow_up = Attempt(Request("r", first + tuple(range(300)), SamplingParams(max_tokens=4), 0), "r.0")
    m, keys, held = asyncio.run(fe.placement.reserve(follow_up, set()))
    assert m is fe.decode[0] and held == 256 and asked == [("keeper", keys)] and len(keys) == 2
    asked.clear()
    fresh = Attempt(Request("s", tuple(range(7, 600)), SamplingParams(max_tokens=4), 0), "s.0")
    m, _, held = asyncio.run(fe.placement.reserve(fresh, set()))
    assert m is fe.decode[1] and held == 0 and [n for n, _ in asked] == ["other"]


def test_a_sibling_prompt_asks_the_actor_its_prefix_was_placed_on_first():
    """With `--share-prefixes`, a prompt whose first pages match one placed earlier is asked of that decode actor first
    (it would share them there), with its page keys, even when another has more pages free; not once that actor holds
    more than its share of requests beyond the least loaded one; a prompt sharing no full page goes the usual way
    (most free pages first)."""
    asked: list[str] = []
    reports = {"a": _report(running=0, reserved=0, free=900), "b": _report(running=0, reserved=0, free=800)}

    def reserve_as(name):
        async def reserve(owner, key, tokens, prefix_keys=()):
            asked.append(name)
            return True, reports[name], 0
        return reserve

    fe = Frontend([(_Handle(), _prefill_info("p"))], [(_Handle(reserve=reserve_as("a")), _decode_info("a", shares=True)),
                                                      (_Handle(reserve=reserve_as("b")), _decode_info("b", shares=True))])
    for m in fe.decode:
        m.report = reports[m.name]
    prefix = tuple(range(520))
    m, keys, _ = asyncio.run(fe.placement.reserve(Attempt(Request("lead", prefix, SamplingParams(max_tokens=4), 0), "l.0"),
                                                  set()))
    assert m.name == "a" and len(keys) == 2
    fe.decode[0].report = reports["a"] = _report(running=2, reserved=0, free=100)  # far fewer pages free than `b`
    sibling = Attempt(Request("sib", prefix + (9,) * 50, SamplingParams(max_tokens=4), 0), "sib.0")
    m, keys, _ = asyncio.run(fe.placement.reserve(sibling, set()))
    assert m.name == "a" and asked == ["a", "a"] and len(keys) == 2  # within its slack: 2 of 8 requests beyond `b`
    fe.decode[0].report = reports["a"] = _report(running=3, reserved=0, free=100)  # 3 beyond: balance wins
    m, _, _ = asyncio.run(fe.placement.reserve(Attempt(Request("s2", prefix, SamplingParams(max_tokens=4), 0), "s2.0"), set()))
    assert m.name == "b"
    other = Attempt(Request("o", tuple(range(9, 600)), SamplingParams(max_tokens=4), 0), "o.0")
    fe.decode[0].report = reports["a"] = _report(running=0, reserved=0, free=100)
    m, _, _ = asyncio.run(fe.placement.reserve(other, set()))
    assert m.name == "b" and asked[-1] == "b"


def test_a_poll_loop_outlives_an_unexpected_error():
    """A poll that raises something no rule expects is logged and counted; the loop polls again, and the next
    message's tokens reach their request."""
    replies: list = [ValueError("a bug in a reply"),
                     StepMessage(1, {"r.0": Delta(1, [11, 12], None, None, "length")}, {}, _report(0, 0))]

    async def poll(owner):
        await asyncio.sleep(0.01)
        if not replies:
            await asyncio.sleep(3600)
        item = replies.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    async def stats():
        return PrefillStats(name="p")

    fe = Frontend([(_Handle(stats=stats), _prefill_info("p"))], [(_Handle(poll=poll), _decode_info("d"))],
                  DeadlineConfig(step_hang_s=60))

    async def main():
        col = fe.collectors.open("r.0", "r", 1)
        await fe.start()
        try:
            return await asyncio.wait_for(col.take(10.0), 10.0)
        finally:
            await fe.stop()

    events = asyncio.run(main())
    assert [e.token.token_id for e in events] == [11, 12] and events[-1].finish_reason == "length"
    assert fe.decode[0].errors == 1 and fe.stats()["member_errors"] == 1


def test_a_layout_that_cannot_be_packed_fails_its_request_at_once(tiny_dir, monkeypatch):
    """A failure between the step and the handoff (packing the layout) settles the request with a retryable
    error right away; today it waited out --prefill-timeout-s."""
    import cluster.prefill_actor as pa
    from core.configs import PrefillConfig

    def broken(layout, fmt):
        raise RuntimeError("no room to pack")

    actor = pa.PrefillActor("tiny", PrefillConfig(), "p0")
    monkeypatch.setattr(pa, "pack_layout", broken)
    attempt = Attempt(Request("r", tuple(range(6, 40)), SamplingParams(max_tokens=4, ignore_eos=True), 0), "r.0")
    with pytest.raises(StepFailure, match="packing its layout failed"):
        asyncio.run(asyncio.wait_for(actor.prefill(attempt, None), 30.0))
