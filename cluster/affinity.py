"""Prefix-affinity routing: send a prompt to the prefill actor whose prefix cache most likely holds its start.

The router remembers what it sent where (as the prefix-aware routers of Ray Serve LLM and SGLang do): for
each actor, the chain keys of the pages of prompts routed to it — the names the actors' caches give their
pages (`cachetier.prefix.page_digest`: one key names a whole prefix) — seeded at start-up, and when an actor
comes back, with the pages the actor reports holding (its disk tier survives restarts). A new prompt goes
to the actor with the longest remembered prefix, unless that actor's load exceeds the least loaded one's by
more than `slack_tokens` (the load cap: one hot prefix must not pile every request onto one actor); then
it goes to the least loaded. Memory per actor is bounded (least recently routed keys are forgotten first).
Plain Python, no Ray: the frontend owns one and calls it on its event loop.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from cachetier.prefix import page_keys


class PrefixAffinity:
    def __init__(self, page_tokens: int, slack_tokens: int, max_keys: int = 200_000) -> None:
        if page_tokens < 1:
            raise ValueError("page_tokens must be >= 1")
        self.page, self.slack, self.max_keys = page_tokens, slack_tokens, max_keys
        self.seen: dict[str, OrderedDict[str, None]] = {}
        self.count = {"affinity": 0, "capped": 0, "least_loaded": 0}
        """Routing decisions: to the actor holding the prefix; away from it for load; no prefix known."""

    def keys(self, tokens: Sequence[int]) -> list[str]:
        return list(page_keys(tokens, self.page))

    def matched_pages(self, name: str, keys: list[str]) -> int:
        seen = self.seen.get(name)
        if not seen:
            return 0
        lo, hi = 0, len(keys)  # prefixes of a routed prompt are remembered with it: binary search the longest
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if keys[mid - 1] in seen:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def pick(self, loads: dict[str, int], tokens: Sequence[int]) -> str:
        """The actor (a key of `loads`: name -> tokens in flight) for `tokens`; remembers the choice."""
        keys = self.keys(tokens)
        least = min(loads, key=loads.get)
        best, depth = least, 0
        for name in loads:
            d = self.matched_pages(name, keys)
            if d > depth or (d == depth and d and loads[name] < loads[best]):
                best, depth = name, d
        if depth == 0:
            choice = least
            self.count["least_loaded"] += 1
        elif loads[best] - loads[least] > self.slack:
            choice = least
            self.count["capped"] += 1
        else:
            choice = best
            self.count["affinity"] += 1
        self.record(choice, keys)
        return choice

    def record(self, name: str, keys: list[str]) -> None:
        seen = self.seen.setdefault(name, OrderedDict())
        for k in reversed(keys):  # shorter prefixes become the most recent: forgotten last
            seen[k] = None
            seen.move_to_end(k)
        while len(seen) > self.max_keys:
            seen.popitem(last=False)

    def forget(self, name: str) -> None:
        """The actor lost its cache (it died or restarted)."""
        self.seen.pop(name, None)

    def seed(self, name: str, held: Sequence[str]) -> None:
        """What the actor reports holding (page names, shallowest first) replaces what was remembered."""
        self.forget(name)
        self.record(name, list(held)[-self.max_keys :] if len(held) > self.max_keys else list(held))
