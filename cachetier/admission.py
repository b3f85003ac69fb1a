"""How much device room a decode worker's admission takes per request: the one reserve rule.

- `final` (the default): a request's blocks at its final length, prompt + max_tokens. An admitted request
  never waits for room, and its reservation returns the moment it stops; but clients commonly ask for
  8K–32K tokens and use a fraction, so most of that room is held for nothing.
- `estimate`: the prompt (its context so far, on a retry) plus an estimate of its output: the mean output of
  the last `WINDOW` requests that finished here, `TierConfig.output_estimate_tokens` until one has, never past
  the final length. A running request grows one block at a time as it decodes (`TieredStore.grow`); when the
  device has no free page, the decode worker pauses the newest running request — its device state (window
  ring, compressor tails, indexer keys, HCA entries, hot buffers) moves to host memory and its pages return —
  and resumes it from there, with identical tokens and no prefill, once room returns (`DecodeWorker`).

Host-pool blocks are held at the final length under both policies: a C4 entry always has its authoritative
home, so an admitted request never needs host room it was not given; admission is what stops when the host
pool is full. While any request is paused no new request is admitted, so the swapped copies never hold more
than the device budget did.
"""

from __future__ import annotations

from collections import deque

from core.configs import TierConfig

WINDOW = 64
"""Finished requests the output estimate averages over."""


class ReservePolicy:
    def __init__(self, tier: TierConfig) -> None:
        self.elastic = tier.reserve == "estimate"
        """Whether admission holds less than the final length (requests then grow, and may be paused)."""
        self.initial = tier.output_estimate_tokens
        self._outputs: deque[int] = deque(maxlen=WINDOW)

    def estimate(self) -> int:
        """The output tokens a newly admitted request is expected to generate."""
        if not self._outputs:
            return self.initial
        return max(1, -(-sum(self._outputs) // len(self._outputs)))

    def device_tokens(self, final_tokens: int, context_tokens: int | None) -> int:
        """Tokens whose blocks admission takes on the device for a request of `final_tokens` (prompt + max_tokens)
        whose layout holds `context_tokens` (None: not known yet, as for a reservation made before prefill)."""
        if not self.elastic or context_tokens is None:
            return final_tokens
        return min(final_tokens, context_tokens + 1 + self.estimate())

    def finished(self, generated: int) -> None:
        """A request finished here after generating `generated` tokens (it feeds the estimate)."""
        self._outputs.append(generated)
