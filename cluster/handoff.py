"""What crosses from a prefill actor to a decode actor, and how.

The handoff is a value: the first token, the request's sampling state, and a reference to its
layout in the Ray object store (owned by the prefill actor, fetched once by the decode actor; on one
node that fetch maps shared memory instead of copying). The layout's byte count travels with it so
the receiving side can check it got exactly what was sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.types import SampledToken, SamplingParams

ROLE_PREFILL = "hisparse_prefill"
ROLE_DECODE = "hisparse_decode"
TRANSPORTS = ("object_store", "nccl", "nixl")


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
    layout_ref: list[Any]
    """[ObjectRef] — wrapped in a list so Ray passes the reference instead of resolving it."""
    source: Any = None
    """The prefill actor holding the layout, told when the layout has been picked up."""
    prefill_actor: str = ""
