"""One config object per role, each field documented; built from the command line or a file."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """`1073741824`, `1GiB`, `512MiB`, `2.5GB`, `4e9` -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a byte count (examples: 1073741824, 1GiB, 512MiB, 2.5GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: int | float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class TierConfig:
    """How a decode worker holds KV: what stays on the device, what goes to the host pool."""

    offload: bool = True
    """Keep C4 entries in the host pool with a per-request hot buffer on the device (`--offload on`);
    off keeps every C4 entry on the device under the same budget."""
    hot_buffer_slots: int | None = None
    """LRU slots per request and CSA layer for selected C4 entries; default 2 x index_topk."""
    reserved_slots: int = 8
    """Extra hot-buffer slots per request and CSA layer that always hold the newest C4 entries."""
    device_budget_bytes: int = 256 * 2**20
    """Device bytes for KV of running requests (state slots + classical blocks + hot buffers)."""
    host_pool_bytes: int | None = None
    """Host bytes for the C4 pool (pinned with CUDA); default: 8 x the device budget."""
    block_tokens: int | None = None
    """Tokens per classical block (a multiple of both compress rates); default: at least 256."""
    max_running: int = 64
    """Most requests decoding at once; their fixed-size state slots are carved from the budget."""


@dataclass(frozen=True)
class PrefillConfig:
    """How a prefill worker batches prompts."""

    max_batch_tokens: int = 2048
    """Prompt tokens processed in one prefill forward (across requests); longer prompts are chunked."""
    max_batch_requests: int = 16
    """Most requests in one prefill forward."""
    entry_tile: int = 512
    """Compressed entries a chunk reads at once: the indexer scores this many C4 entries per step of its
    running top-k, and HCA attention folds this many entries per step of its online softmax. With
    `max_batch_tokens` it bounds a chunk's transient memory whatever the context (docs/long-context.md).
    Multiples of 64 waste nothing (the indexer scores entries in groups of 64)."""
    layout_lease_s: float = 30.0
    """A finished layout not picked up by a decode actor within this time is freed."""

    def __post_init__(self) -> None:
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be at least 1, got {self.max_batch_tokens}")
        if self.entry_tile < 1:
            raise ValueError(f"entry_tile must be at least 1 (512 is a good start), got {self.entry_tile}")


@dataclass(frozen=True)
class ClusterConfig:
    """Where the actors run."""

    address: str | None = None
    """Ray address to join (`auto`, `host:6379`); None starts an embedded local Ray instance."""
    num_prefill: int = 1
    """Prefill actors."""
    num_decode: int = 1
    """Decode actors."""
    prefill_num_cpus: float = 1.0
    """CPUs each prefill actor reserves."""
    decode_num_cpus: float = 1.0
    """CPUs each decode actor reserves."""
    prefill_num_gpus: float = 0.0
    """GPUs each prefill actor reserves."""
    decode_num_gpus: float = 0.0
    """GPUs each decode actor reserves."""
    placement: str = "resources"
    """`resources`: actors require the role resources `hisparse_prefill` / `hisparse_decode` that nodes
    advertise (`ray start --resources '{"hisparse_decode": 4}'`); `any`: no role placement (the embedded
    default, where the local node advertises both)."""
    max_restarts: int = 3
    """Times Ray restarts a dead actor before giving up on it."""
    transport: str = "object_store"
    """Handoff transport: `object_store` (default), or Ray's direct tensor transport: `nccl`/`nixl` (GPUs),
    `gloo` (CPUs)."""


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP gateway."""

    host: str = "127.0.0.1"
    """Interface to bind."""
    port: int = 8000
    """Port to bind."""
    served_model_name: str | None = None
    """Model name the API answers to; default: `tiny` or the model directory's name."""
    max_concurrent_requests: int = 512
    """Requests in flight before new ones get 429."""


@dataclass(frozen=True)
class ServeConfig:
    """Everything `hisparse serve` needs."""

    model: str = "tiny"
    """`tiny` (built-in) or a model directory."""
    tier: TierConfig = field(default_factory=TierConfig)
    prefill: PrefillConfig = field(default_factory=PrefillConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
