"""One config object per role, each field documented; built from the command line or a file."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cache

from core.parallel import ParallelLayout

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


class FieldError(ValueError):
    """A config field set to a value that can never serve. It names the class and the field, so that a front end
    can name its own spelling of it (the command line names the flag)."""

    def __init__(self, cls: type, name: str, problem: str) -> None:
        self.cls, self.name, self.problem = cls, name, problem
        super().__init__(f"{cls.__name__}.{name} {problem}")


def _at_least(obj, **least: float) -> None:
    """Raise `FieldError` for the first field of `obj` below its least value; None (a field's derived default)
    always passes."""
    for name, low in least.items():
        value = getattr(obj, name)
        if value is not None and value < low:
            raise FieldError(type(obj), name, f"must be at least {_num(low)}, got {_num(value)}")


def _num(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


RESERVE_POLICIES = ("final", "estimate")


@dataclass(frozen=True)
class TierConfig:
    """How a decode worker holds KV: what stays on the device, what goes to the host pool."""

    offload: bool = True
    """Keep C4 entries in the host pool with a per-request hot buffer on the device (`--offload on`);
    off keeps every C4 entry on the device under the same budget."""
    hot_buffer_slots: int | None = None
    """LRU slots per request and CSA layer for selected C4 entries; default 2 x index_topk, or (N + 1) x index_topk
    when that is more (`speculative_tokens` N: each verified position selects its own top-k), of which a plain step
    searches the first 2 x index_topk for victims (`Geometry.plain_lru`); a size given here is searched whole."""
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
    speculative_tokens: int = 0
    """Draft tokens a decode step may verify per request with the model's MTP head (0: no speculation;
    docs/speculative.md). It sizes what speculation holds per request: the MTP block's window ring in each state
    group, and the hot buffer's LRU part (at least (N + 1) x index_topk, `cachetier.geometry.spec_lru_floor`)."""
    reserve: str = "final"
    """How much device room admission takes (`cachetier.admission`): `final` holds a request's blocks at its final
    length (prompt + max_tokens), so it never waits once admitted; `estimate` holds the prompt plus an estimate of
    its output, grows it block by block as it decodes, and when the device is full pauses the newest running
    request, its device state moved to host memory, resuming it later with identical tokens (no prefill). Host-pool
    blocks are held at the final length either way."""
    output_estimate_tokens: int = 256
    """`reserve=estimate`: the output estimate until requests have finished here (then the mean of the last ones)."""
    resident: bool = False
    """Tier on: while the device budget has room, keep a request's C4 entries on the device in full (pages taken from
    the same pool), so its steps read them directly (no misses, no resolve); as admissions need the room the largest
    shrink back to their hot buffers, and they grow back when it returns (`cachetier.residency`, `--resident on`)."""
    retain_bytes: int = 0
    """Tier on: host bytes for finished requests' prompt pages kept for a follow-up turn (0: none kept;
    `cachetier.retention`, `--retain-bytes`). Their C4 entries stay in the host pool's blocks, their indexer keys and
    HCA entries are copied off the device; a next prompt that extends one is routed here and its handoff carries
    only the pages after it. Kept pages are the first to go when admission needs host blocks."""
    share_prefixes: int = 0
    """Running requests whose contexts begin with the same full pages hold those pages once, in both tiers
    (`cachetier.sharing`, `--share-prefixes N`; 0: every request holds its own). With the tier on each holder after
    the first addresses a shared page's entries through a map block of its own: N map blocks per device page are set
    aside for that, charged to the device budget (the entry map's bytes per page, N times), so on average N + 1
    requests can hold each page."""

    def __post_init__(self) -> None:
        # whether the budget holds a request depends on the model: `cachetier.geometry.Geometry` decides that
        _at_least(self, max_running=1, device_budget_bytes=1, host_pool_bytes=0, block_tokens=1, speculative_tokens=0,
                  output_estimate_tokens=1, retain_bytes=0, share_prefixes=0)
        if self.reserve not in RESERVE_POLICIES:
            raise ValueError(f"reserve must be one of {RESERVE_POLICIES}, got {self.reserve!r}")
        if self.resident and not self.offload:
            raise ValueError("resident C4 entries (--resident on) need the tier on (--offload on): with it off every "
                             "C4 entry is on the device already")
        if self.retain_bytes and not self.offload:
            raise ValueError("keeping finished requests for follow-up turns (--retain-bytes) needs the tier on "
                             "(--offload on): their C4 entries stay in its host pool")


STATE_POLICIES = ("last", "every")


@dataclass(frozen=True)
class PrefixCacheConfig:
    """The prefill side's prefix cache (docs/prefix-cache.md): classical entries shared per page, window ring
    and compressor state snapshotted at chosen page boundaries, in host memory with a disk tier below."""

    enabled: bool | None = None
    """Look prompts up in the cache and resume prefill from the longest cached prefix; default: on wherever it can
    run. None (the default) is on, except in an attention-TP prefill group, which runs without it
    (`PrefillWorker.join_replica`); True asks for it (an error with a TP prefill layout); False turns it off."""
    host_bytes: int | None = None
    """Host bytes for cached pages and state snapshots; default min(1 GiB, 1/16 of the prefill machine's memory).
    Past it the least recently used go to disk (or away). The default is worked out on the machine that holds
    the cache (`host_budget`), so each prefill node of a cluster sizes its own."""
    disk_bytes: int = 0
    """Bytes of the disk tier under `directory`; 0 turns the disk tier off."""
    directory: str | None = None
    """Directory of the disk tier (kept across restarts: the index is rebuilt from its files)."""
    page_tokens: int | None = None
    """Tokens per cached page (a multiple of both compress rates); default: the KV block size."""
    state_policy: str = "last"
    """Which page boundaries keep a state snapshot: `last` (the last boundary of each prompt, and the point where
    a prompt leaves a cached one), or `every` (every page: more hits inside prompts, much more state)."""
    affinity_slack_tokens: int = 8192
    """Routing: a prompt goes to the prefill actor that holds its longest prefix unless that actor has more than
    this many prompt tokens in flight beyond the least loaded actor (then to the least loaded)."""

    def __post_init__(self) -> None:
        if self.state_policy not in STATE_POLICIES:
            raise ValueError(f"state_policy must be one of {STATE_POLICIES}, got {self.state_policy!r}")
        _at_least(self, host_bytes=0, disk_bytes=0, page_tokens=1, affinity_slack_tokens=0)
        if self.disk_bytes and not self.directory:
            raise ValueError("a disk tier for the prefix cache needs a directory (--prefix-cache-dir)")

    @property
    def wanted(self) -> bool:
        """Whether a prefill worker builds the cache (on unless turned off; a TP group drops an unasked one)."""
        return self.enabled is not False

    @property
    def host_budget(self) -> int:
        """`host_bytes`, or the default for this machine (`default_prefix_host_bytes`)."""
        return self.host_bytes if self.host_bytes is not None else default_prefix_host_bytes()

    @property
    def disk_enabled(self) -> bool:
        return bool(self.disk_bytes and self.directory)


PREFIX_HOST_CAP = 1 << 30
PREFIX_HOST_SHARE = 16


@cache
def default_prefix_host_bytes() -> int:
    """The prefix cache's default host budget: min(1 GiB, 1/16 of the memory this process may use).

    Why these numbers: the cache is on by default, so its default must be safe on the smallest machine that
    serves. On the embedded default one machine also holds the model (twice: a prefill and a decode actor),
    each decode actor's host pool (8 x its device budget) and Ray's object store (30 % of memory by Ray's
    default), so the cache takes a sixteenth: 512 MiB on an 8 GiB laptop or pod. 1 GiB caps it where memory
    is plentiful: a few thousand pages of the built-in model, several long shared prompts of a large one;
    more is a choice (`--prefix-cache-host-bytes`). Memory is the lower of MemTotal and this process's cgroup
    limit, because a container sees the whole node's MemTotal; unreadable (not Linux): the 1 GiB cap."""
    limit = memory_limit_bytes()
    return PREFIX_HOST_CAP if limit is None else min(PREFIX_HOST_CAP, limit // PREFIX_HOST_SHARE)


def memory_limit_bytes() -> int | None:
    """The memory this process may use: MemTotal, or its cgroup's limit (v2 or v1) where that is lower; None
    where neither can be read."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError, IndexError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():  # "max" (v2) is no limit; v1 writes a huge number for none, which min() passes over
            found.append(int(text))
    return min(found) if found else None


DECODE_MODES = ("auto", "eager", "compiled")
COMPILE_BACKENDS = ("inductor", "eager")


@dataclass(frozen=True)
class StepConfig:
    """How a decode worker runs its step (`decode.runner`)."""

    decode_mode: str = "auto"
    """`auto`: `compiled` wherever the model and store can run fixed-shape steps (CUDA graphs on CUDA,
    `torch.compile` on CPU), else `eager`. `eager`: run the step op by op with exactly as many rows as
    requests. `compiled`: pad the batch and the gather lengths to buckets and run one fixed-shape step per
    bucket — compiled with `torch.compile(fullgraph=True)` on CPU, captured in a CUDA graph on CUDA.
    Plain-layout stores, stand-in models and replica ranks always run eagerly."""
    cuda_graphs: bool = True
    """With `compiled` on CUDA: capture and replay CUDA graphs; off runs the same fixed-shape step
    eagerly (to tell a capture problem from a step problem)."""
    warmup: bool = True
    """With `compiled`: compile (CPU) or capture (CUDA, up to `capture_context_tokens`) before the worker is
    ready, on scratch rows; after that no step ever compiles or captures (one that would need it runs
    eagerly, or on CUDA uncaptured until the worker is idle). Off: the first step of a bucket compiles or
    captures it (tests use it to compile at a known step)."""
    capture_context_tokens: int = 4096
    """With `compiled` on CUDA: context lengths whose buckets are captured at start-up (every batch
    bucket up to max_running); a longer context runs uncaptured until the worker is next idle."""
    compile_backend: str = "inductor"
    """With `compiled` on CPU: `inductor` generates fused C++ for the step (fast steps; a minute or more
    to compile the first time, seconds from the on-disk cache); `eager` only captures the whole step
    as one graph and runs its ops as they are (no speed-up; compiles in seconds; checks that the step
    is capture-safe)."""
    compile_cache_dir: str | None = None
    """Directory of torch.compile's on-disk cache (Inductor's TORCHINDUCTOR_CACHE_DIR), so a restart reuses
    compiled kernels; default: TORCHINDUCTOR_CACHE_DIR if set, else Inductor's own default."""

    speculative_adaptive: bool = True
    """With speculation on (`TierConfig.speculative_tokens`): choose each step's draft count from the batch and
    the measured acceptance and step times, down to 0 (`decode.speculative.DraftPolicy`); off always drafts the
    most."""

    def __post_init__(self) -> None:
        _at_least(self, capture_context_tokens=1)
        if self.decode_mode not in DECODE_MODES:
            raise ValueError(f"decode_mode {self.decode_mode!r} is not one of {DECODE_MODES}")
        if self.compile_backend not in COMPILE_BACKENDS:
            raise ValueError(f"compile_backend {self.compile_backend!r} is not one of {COMPILE_BACKENDS}")


EAGER_STEP = StepConfig(decode_mode="eager")
"""The decode step op by op: what benches and tests about something other than the compiled step run (serving
defaults to `compiled`, which on a CPU compiles for minutes from an empty Inductor cache before it serves)."""


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
    prefix_cache: PrefixCacheConfig = field(default_factory=PrefixCacheConfig)
    """The prefix cache (on wherever it can run)."""

    def __post_init__(self) -> None:
        _at_least(self, max_batch_tokens=1, max_batch_requests=1, entry_tile=1)


PLACEMENTS = ("resources", "any")


@dataclass(frozen=True)
class ClusterConfig:
    """Where the actors run."""

    address: str | None = None
    """Ray address to join (`auto`, `host:6379`); None starts an embedded local Ray instance."""
    num_prefill: int = 1
    """Prefill actors, or with `prefill_layout` of more than one rank, prefill replicas."""
    num_decode: int = 1
    """Decode actors, or with `decode_layout` of more than one rank, decode replicas."""
    prefill_layout: str = "dp1"
    """How one prefill replica splits the model (`core.parallel.ParallelLayout`): `dp2+ep2` like
    `decode_layout` (every rank prefills its own requests and hands each layout to the decode rank the
    router chose), or with attention-TP groups `tp2`, `dp2xtp2+ep4` (each group's leader takes requests and
    its followers compute every step with it: lower latency for long prompts; no prefix cache)."""
    decode_layout: str = "dp1"
    """How one decode replica splits the model (`core.parallel.ParallelLayout`): `dp1` (one actor, the whole
    model), `dp2+ep2` (two ranks, each attending for its own requests, routed experts split between
    them), ... Each rank is a decode actor with `decode_num_cpus` / `decode_num_gpus`; a replica's ranks
    share one placement group on one node. Attention-TP is not offered for decode (it copies the KV to
    every rank)."""
    prefill_num_cpus: float = 1.0
    """CPUs each prefill actor reserves."""
    decode_num_cpus: float = 1.0
    """CPUs each decode actor reserves."""
    prefill_num_gpus: float | None = None
    """GPUs each prefill actor reserves; None: one where the cluster has GPUs, else none (`gpus_per_actor`)."""
    decode_num_gpus: float | None = None
    """GPUs each decode actor reserves; None: one where the cluster has GPUs, else none (`gpus_per_actor`)."""
    placement: str | None = None
    """`resources`: actors require the role resources `hisparse_prefill` / `hisparse_decode` that nodes
    advertise (`ray start --resources '{"hisparse_decode": 4}'`); `any`: no role placement. None: `any` for the
    embedded instance (its one node advertises both), `resources` when joining a cluster."""
    max_restarts: int = 3
    """Times Ray restarts a dead actor before giving up on it."""
    transport: str = "object_store"
    """Handoff transport: `object_store` (default), or Ray's direct tensor transport: `nccl`/`nixl` (GPUs),
    `gloo` (CPUs)."""

    def gpus_per_actor(self, cluster_gpus: float) -> tuple[float, float]:
        """GPUs each prefill and each decode actor reserves in a cluster with `cluster_gpus` GPUs: what was asked
        for, else one each where there are GPUs (Ray hides every GPU from an actor that reserves none, so an
        actor left at 0 would compute on the CPU of a GPU machine), else none."""
        default = 1.0 if cluster_gpus > 0 else 0.0
        return (default if self.prefill_num_gpus is None else self.prefill_num_gpus,
                default if self.decode_num_gpus is None else self.decode_num_gpus)

    @property
    def prefill_actors(self) -> int:
        """Prefill actors in all: every rank of every prefill replica."""
        return self.num_prefill * ParallelLayout.parse(self.prefill_layout).world

    @property
    def decode_actors(self) -> int:
        """Decode actors in all: every rank of every decode replica."""
        return self.num_decode * ParallelLayout.parse(self.decode_layout).world

    def __post_init__(self) -> None:
        # Ray takes 0 CPUs or GPUs (an actor that reserves none); -1 restarts: without limit
        _at_least(self, num_prefill=1, num_decode=1, prefill_num_cpus=0, decode_num_cpus=0, prefill_num_gpus=0,
                  decode_num_gpus=0, max_restarts=-1)
        if self.placement is None:
            object.__setattr__(self, "placement", "any" if self.address is None else "resources")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        replicas = not (ParallelLayout.parse(self.prefill_layout).single and ParallelLayout.parse(self.decode_layout).single)
        if replicas and self.transport != "object_store":
            raise ValueError(f"--transport {self.transport} sets its collective group up once at start, and a rebuilt "
                             "replica's new actors would not be in it; replicas hand layouts over with object_store")
        if ParallelLayout.parse(self.decode_layout).tp > 1:
            raise ValueError(f"decode layout {self.decode_layout!r}: attention-TP copies every request's KV to each of "
                             "its ranks; decode replicas split by DP attention (dpN, dpN+epN)")


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
    """HTTP requests in flight per gateway process before new ones get 429."""
    max_sequences_per_request: int = 64
    """Most sequences one request may fan out to (`len(prompt) x n`); more is a 400."""
    max_body_bytes: int = 16 * 2**20
    """Largest request body accepted; a larger one gets 413 before it is parsed."""
    api_key: str | None = field(default=None, repr=False)
    """When set, every /v1 route requires `Authorization: Bearer <key>` (401 otherwise); /health and
    /metrics stay open. Never logged."""
    stream_interval: int = 1
    """Tokens per streamed chunk (the first and the last chunk are sent at once); a client that lags gets
    what is pending merged into one chunk."""
    api_workers: int = 1
    """Gateway processes serving the same port, sharing the same actors; each owns its requests."""

    def __post_init__(self) -> None:
        _at_least(self, port=1, max_concurrent_requests=1, max_sequences_per_request=1, max_body_bytes=1,
                  stream_interval=1, api_workers=1)
        if self.port > 65535:
            raise FieldError(ServerConfig, "port", f"must be at most 65535, got {self.port}")


@dataclass(frozen=True)
class DeadlineConfig:
    """How long each stage of a request may take; past it the request ends with a clear error.

    The decode side holds a request's reserved pages for `prefill_timeout_s + handoff_timeout_s` (the
    reservation lease), which by construction outlasts every wait between reserving and handing over.
    """

    queue_timeout_s: float = 30.0
    """Wait for decode capacity before prefill starts; past it: 503 with Retry-After, before any token."""
    max_queued_requests: int = 1024
    """Requests a gateway process lets wait for capacity at once; beyond it new ones get 503 at once."""
    prefill_timeout_s: float = 1800.0
    """Prefill of one request, its wait in the prefill actor's queue included (long prompts need long)."""
    handoff_timeout_s: float = 60.0
    """From a finished prefill until the decode actor holds the layout."""
    token_timeout_s: float = 60.0
    """Most time between two tokens of a running request; a stream silent for longer ends with an error."""
    max_request_retries: int = 1
    """Times a request is prefilled again after losing a worker or failing a step, before it fails."""
    subscriber_timeout_s: float = 30.0
    """A decode actor drops a gateway that has not collected its output for this long, aborting its requests."""
    step_hang_s: float = 120.0
    """A step thread with work that shows no progress for this long is hung: out of routing, requests moved."""

    def __post_init__(self) -> None:
        for name in ("queue_timeout_s", "prefill_timeout_s", "handoff_timeout_s", "token_timeout_s",
                     "subscriber_timeout_s", "step_hang_s"):
            if not getattr(self, name) > 0:
                raise FieldError(DeadlineConfig, name, f"must be > 0, got {_num(getattr(self, name))}")
        _at_least(self, max_request_retries=0, max_queued_requests=1)
        if self.subscriber_timeout_s <= POLL_INTERVAL_S * 2:
            raise FieldError(DeadlineConfig, "subscriber_timeout_s", f"must exceed twice the {POLL_INTERVAL_S:g} s output "
                             f"poll, got {_num(self.subscriber_timeout_s)}")

    @property
    def reservation_lease_s(self) -> float:
        """How long reserved decode pages wait for their layout."""
        return self.prefill_timeout_s + self.handoff_timeout_s


POLL_INTERVAL_S = 1.0
"""A gateway's output poll returns after at most this long even with nothing to report (a heartbeat)."""


@dataclass(frozen=True)
class StubConfig:
    """Benchmark mode: the model's steps are replaced by sleeps, to measure the serving path alone."""

    decode_step_s: float = 0.02
    """A decode step: sleeps this long (releasing the GIL) and yields one token per running request."""
    prefill_s: float = 0.005
    """A prefill step: sleeps this long; every request's layout is a real one of its prompt length."""


@dataclass(frozen=True)
class FaultConfig:
    """Faults injected on purpose, for chaos tests and benchmarks; everything is off by default."""

    poison_token_id: int | None = None
    """A decode step that holds a request whose prompt contains this token id raises."""
    hang_token_id: int | None = None
    """A decode step that holds a request whose prompt contains this token id blocks for `hang_s`."""
    hang_s: float = 3600.0
    """How long an injected hang blocks the step thread."""

    def tag(self, prompt_token_ids) -> str | None:
        """The fault a request with this prompt carries: `poison`, `hang` or None."""
        if self.poison_token_id is not None and self.poison_token_id in prompt_token_ids:
            return "poison"
        if self.hang_token_id is not None and self.hang_token_id in prompt_token_ids:
            return "hang"
        return None


@dataclass(frozen=True)
class ServeConfig:
    """Everything `hisparse serve` needs."""

    model: str = "tiny"
    """`tiny` (built-in) or a model directory."""
    weights: str = "packed"
    """`packed`: FP8 linears and FP4 experts of a quantized checkpoint stay packed and are computed on;
    `dequantize`: expanded at load (the reference path). Unquantized checkpoints load the same either way."""
    kv_format: str = "auto"
    """How KV rows are stored (`core.kv_format`): `bf16`, `v4` (FP8 rows + MXFP4 indexer keys, packed) or
    `auto` (what the checkpoint was trained for: `v4` for DeepSeek-V4 checkpoints, `bf16` for the built-in model)."""
    dtype: str = "auto"
    """What the model computes in (`core.device.DTYPES`): `auto` is bfloat16 on CUDA and float32 on the CPU."""
    tier: TierConfig = field(default_factory=TierConfig)
    step: StepConfig = field(default_factory=StepConfig)
    """How decode workers run their step: eager, or bucketed and compiled / captured."""
    prefill: PrefillConfig = field(default_factory=PrefillConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    deadlines: DeadlineConfig = field(default_factory=DeadlineConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)
    stub: StubConfig | None = None
    """Benchmark mode (`bench.serving_path`): stand-in model steps; None serves the model."""

    def __post_init__(self) -> None:
        layout = self.cluster.prefill_layout
        if ParallelLayout.parse(layout).tp > 1 and self.prefill.prefix_cache.enabled is True:  # asked for
            raise ValueError(f"prefill layout {layout!r} has attention-TP groups, which run without the prefix cache; "
                             "turn --prefix-cache off or use a dpN[+epN] prefill layout")
