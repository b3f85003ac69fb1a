"""Prefix-affinity routing: prompts sharing a prefix go to the prefill actor that holds it, within a load cap."""

from __future__ import annotations

import asyncio

from cluster.affinity import PrefixAffinity
from cluster.frontend import Frontend
from cluster.protocol import Capacity, DecodeInfo, PrefillInfo
from core.request import Attempt, Request
from core.types import SamplingParams

PAGE = 4


def _prompt(head: int, tail: int) -> list[int]:
    return [head] * 12 + [tail] * 5


def test_shared_prefix_follows_the_actor_that_holds_it():
    r = PrefixAffinity(PAGE, slack_tokens=100)
    loads = {"a": 0, "b": 0, "c": 0}
    first = r.pick(loads, _prompt(1, 1))
    loads[first] += 10  # now busier than the others, within the cap
    assert r.pick(loads, _prompt(1, 2)) == first  # same 12-token head
    other = r.pick(loads, _prompt(2, 1))  # a new head goes to the least loaded
    assert other != first
    assert r.count == {"affinity": 1, "capped": 0, "least_loaded": 2}


def test_load_cap_sends_a_hot_prefix_elsewhere():
    r = PrefixAffinity(PAGE, slack_tokens=50)
    loads = {"a": 0, "b": 0}
    first = r.pick(loads, _prompt(1, 1))
    loads[first] = 51
    second = r.pick(loads, _prompt(1, 2))
    assert second != first and r.count["capped"] == 1
    loads[second] = 60  # both hold the prefix now: the less loaded of them
    assert r.pick(loads, _prompt(1, 3)) == first


def test_longest_prefix_wins_and_forgetting_an_actor():
    r = PrefixAffinity(PAGE, slack_tokens=1000)
    r.record("a", r.keys([1] * 8))
    r.record("b", r.keys([1] * 16))
    assert r.pick({"a": 0, "b": 5}, [1] * 20) == "b"
    r.forget("b")
    assert r.pick({"a": 5, "b": 0}, [1] * 20) == "a"


def test_memory_is_bounded_and_keeps_short_prefixes_longest():
    r = PrefixAffinity(PAGE, slack_tokens=1000, max_keys=3)
    r.record("a", r.keys(list(range(40))))  # ten pages, only three remembered: the first three
    assert len(r.seen["a"]) == 3
    assert r.matched_pages("a", r.keys(list(range(40)))) == 3


def test_keys_are_the_cache_page_names_and_seeding(tiny_model):
    from cachetier.layout import layout_format
    from cachetier.prefix import PrefixCache
    from core.configs import PrefixCacheConfig

    cache = PrefixCache(tiny_model.cfg, PrefixCacheConfig(enabled=True, page_tokens=32),
                        layout_format(tiny_model.cfg, tiny_model.dtype))
    tokens = list(range(6, 6 + 96))
    cache.store(tokens, tiny_model.prefill(tokens)[1])
    r = PrefixAffinity(32, slack_tokens=1000)
    assert cache.held_pages() == r.keys(tokens)  # the router names pages as the cache does
    r.seed("b", cache.held_pages())  # e.g. an actor that rebuilt its cache from disk after a restart
    assert r.pick({"a": 0, "b": 10}, tokens + [1, 2]) == "b" and r.count["affinity"] == 1


def test_frontend_routes_by_prefix():
    class Handle:
        pass

    common = dict(node_id="n", pid=1, layout_format="f", describe="cpu")
    prefill = [(Handle(), PrefillInfo(name=f"p{i}", prefix_page_tokens=PAGE, prefix_affinity_slack=100, prefix_pages=(),
                                      **common)) for i in range(3)]
    decode = [(Handle(), DecodeInfo(name="d0", capacity=Capacity(64, 1, 256, 8), **common))]
    fe = Frontend(prefill, decode)
    sp = SamplingParams(max_tokens=1)

    async def pick(rid, tokens):
        m = await fe.placement.pick_prefill(Attempt.of(Request(rid, tuple(tokens), sp, 0)))
        m.load[rid] = len(tokens)  # what `_prefill_on` records while the prompt is in flight
        return m.name

    async def main():
        first = await pick("r0", _prompt(7, 1))
        assert await pick("r1", _prompt(7, 2)) == first
        assert await pick("r2", _prompt(8, 1)) != first
        fe.prefill[[m.name for m in fe.prefill].index(first)].load["big"] = 1000
        assert await pick("r3", _prompt(7, 3)) != first  # over the cap

    asyncio.run(main())
    assert fe.stats()["prefix_routing"] == {"affinity": 1, "capped": 1, "least_loaded": 2}
