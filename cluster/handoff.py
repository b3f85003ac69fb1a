"""What crosses from a prefill actor to a decode actor, and how.

The handoff is a value: the first token and the request's sampling state, while the layout stays
held by the prefill actor. The router then asks the prefill actor to *export* the layout and passes
that call's result straight into the decode actor's `generate` as an argument, so the bytes go from
prefill to decode without passing through the router:

- `object_store` (default): the export's return value lives in the Ray object store (on one node
  the decode side maps it from shared memory; across nodes Ray moves it once);
- `nccl` / `gloo` / `nixl`: Ray's direct tensor transport moves the layout's tensors actor to actor
  (GPU memory stays on the GPU with nccl/nixl); gloo works on CPUs. These need actor classes created
  with tensor transport enabled and, for nccl/gloo, one collective group over all PD actors.

The layout's byte count travels with the handoff so the receiving side checks it got exactly what
was sent. A layout nobody exports within the lease is dropped by the prefill actor.

Collective transports pair sends with receives in order, so the router moves one layout at a time
between a given prefill/decode pair: it waits for the decode stream's `Received` before the next.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.types import SampledToken, SamplingParams

ROLE_PREFILL = "hisparse_prefill"
ROLE_DECODE = "hisparse_decode"
TRANSPORTS = ("object_store", "gloo", "nccl", "nixl")
COLLECTIVE_TRANSPORTS = {"gloo": "torch_gloo", "nccl": "nccl"}


@dataclass(frozen=True)
class Received:
    """First item of a decode stream: the layout has arrived (the tokens follow)."""

    request_id: str
    layout_bytes: int


@dataclass
class Handoff:
    request_id: str
    first_token: SampledToken
    sampling: SamplingParams
    seed: int
    prompt_len: int
    num_generated: int
    layout_tokens: int
    layout_bytes: int
    """Bytes of the layout as the prefill side measured it (sum of its tensors)."""
    source: Any = None
    """The prefill actor holding the layout, told when the layout has been picked up."""
    prefill_actor: str = ""
    sent_at: float = 0.0
    """Wall-clock time the router handed the layout on (for the handoff time)."""
