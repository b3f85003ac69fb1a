"""Capacity planner: how many context tokens a device holds with and without the HiSparse C4 tier.

Pure arithmetic on a `ModelConfig`; no torch, so it runs anywhere (including `hisparse plan`).

What is counted
---------------
A request's KV splits into parts that grow with its length and parts that do not.

Growing parts, summed over layers and expressed per context token:
- `c4`: one compressed entry per `csa_rate` tokens in every CSA layer.
- `index_keys`: one indexer key per `csa_rate` tokens in every CSA layer (same windows as `c4`).
- `hca`: one compressed entry per `hca_rate` tokens in every HCA layer.
- `slot_map` (tier only): the device-side table from C4 entry id to hot-buffer slot, 4 bytes per C4
  entry per CSA layer.

Fixed parts per request:
- `swa`: the sliding-window ring, `sliding_window` raw keys in every layer.
- `compressor_state`: the fp32 rings the reference implementation keeps for windows not yet complete.
  A CSA layer's main compressor holds `2 * csa_rate` slots, each with a kv row and a score row of
  `2 * head_dim` floats; its indexer compressor is the same shape at `index_head_dim`; an HCA layer holds
  `hca_rate` slots of `head_dim` kv + `head_dim` score floats. For V4 that is 64 KiB, 16 KiB and
  512 KiB per layer.
- `hot_buffer` (tier only): `B + R` C4 entries per CSA layer, where `B` is the LRU part (default
  `2 * index_topk`) and `R` the slots kept for the newest entries (default 8).

A request of `context_len` tokens has `context_len // rate` complete entries of each compressed kind;
the tokens of an incomplete window live in the compressor state, which is already counted.

Entry formats
-------------
- `kv_format` (SWA, C4, HCA entries and the hot buffer): `bf16` is `2 * head_dim` bytes; `fp8` is the
  production row: the non-rotary channels as e4m3 (1 byte each), the rotary channels kept in bf16,
  one ue8m0 scale byte per 64 non-rotary channels, the whole rounded up to a multiple of 8 bytes
  (448 + 128 + 7, padded: 584 bytes for V4).
- `index_format` (indexer keys): `bf16` is `2 * index_head_dim`; `fp8` is `index_head_dim` bytes plus one
  fp32 scale (132 bytes for V4); `fp4` is two e2m1 values per byte plus one ue8m0 scale per 32 values
  (68 bytes for V4).

Without the tier every kind above lives on the device. With the tier the C4 entries live in host memory
(the host pool) and the device holds indexer keys, HCA entries, the slot map, the SWA ring, the
compressor state and the hot buffer. The ceiling ratio is what the tier gains as context grows without
bound: device bytes per token without the tier over device bytes per token with it.

Device memory
-------------
Per GPU: nominal memory (`h200` 141e9 bytes and `b200` 180e9 bytes as the vendor's spec sheets state
them, or any byte count) minus a fraction reserved for activations and workspace (default 10%) minus
that GPU's share of the weights (the estimate below, split evenly over the GPUs). What remains holds KV.
Attention is assumed data-parallel: each GPU keeps the whole KV of its own requests (with a single
shared KV head there is nothing to split across tensor-parallel ranks), so a request must fit on one
GPU and the requests of all GPUs add up.

With a replica layout (`PlanInputs.layout`, a `core.parallel.ParallelLayout`) the GPUs form
`num_gpus / world` replicas and each GPU holds one rank's weights instead of an even share: the
estimate below restricted to that rank's routed experts and attention-TP slices (`estimate_weights`
with `layout`). The KV budget per GPU is computed as above. A DP group's `tp` ranks all hold the
whole KV of that group's requests, so the requests of the node are `num_gpus / tp` times the requests
one GPU holds, and with the tier each of those ranks keeps its own host copy of the C4 entries
(`tp` copies; a shared host region per node would need one).

Weights
-------
Estimated from the geometry, tensor by tensor, in the checkpoint's formats: routed experts FP4 (e2m1,
half a byte per weight) with one e8m0 scale byte per 32 weights; the other big matrices (attention
projections, indexer query projection, shared experts, the MTP block's two input projections) FP8
e4m3 with one e8m0 scale byte per 128x128 block; embeddings, output head, norms, compressor and
indexer key projections and router weights in bf16; sinks, compressor position biases, router biases
and the hyper-connection parameters in fp32; the hash-routing table in int64. The served model
excludes the multi-token-prediction block (this project does not serve it); the checkpoint estimate
adds it back for comparison with published sizes.

What the GPUs hold depends on the weight mode (`core.config.WEIGHT_MODES`): `packed` (the default, and
what the loader does with a packed checkpoint) keeps those formats resident, so the estimate above is
also the resident size (the loader widens FP8 tile scales to fp32: 3 more bytes per 16,384 weights, not
counted); `dequantize` expands every FP8 and FP4 matrix to bf16 (2 bytes per weight, no scales). A
checkpoint without packed tensors is planned as `dequantize`. Both figures are reported per GPU.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from types import MappingProxyType

from core.config import CSA, HASH_MOE, SLIDING, WEIGHT_MODES, WEIGHTS_DEQUANTIZE, WEIGHTS_PACKED, ModelConfig
from core.configs import TierConfig
from core.kv_format import BF16, V4, fp4_key_bytes, fp8_main_row_bytes
from core.parallel import WHOLE, ParallelLayout

# Cache kinds; the first five are spelled as in `cachetier.layout` (kept torch-free here on purpose).
C4 = "c4"
INDEX_KEYS = "index_keys"
HCA_ENTRIES = "hca"
SWA = "swa"
COMPRESSOR_STATE = "compressor_state"
SLOT_MAP = "slot_map"
HOT_BUFFER = "hot_buffer"

KV_FORMATS = ("bf16", "fp8")
INDEX_FORMATS = ("fp4", "fp8", "bf16")

GPU_MEMORY_BYTES = MappingProxyType({"h200": 141 * 10**9, "b200": 180 * 10**9})
"""Nominal device memory per GPU, from the vendor's spec sheets (H200: 141 GB HBM3e; B200: 180 GB HBM3e)."""

SLOT_MAP_ENTRY_BYTES = 4
"""Bytes of the device-side entry -> hot-buffer slot map, per C4 entry and CSA layer (an int32)."""

STATE_FLOAT_BYTES = 4
"""The compressor rings hold fp32 values."""

DEQUANTIZED_WEIGHT_BYTES = 2
"""Bytes per weight of an FP8 or FP4 matrix expanded at load (`weights=dequantize`): bf16."""


def entry_formats(kv_format: str) -> tuple[str, str]:
    """The planner's (kv entry format, index key format) for a runtime KV format (`core.kv_format`):
    `v4` stores `fp8` rows and `fp4` keys; `bf16` stores both in bf16 (a bf16 compute dtype)."""
    if kv_format == V4:
        return "fp8", "fp4"
    if kv_format == BF16:
        return "bf16", "bf16"
    raise PlanError(f"the planner has no entry formats for kv format {kv_format!r}")


class PlanError(ValueError):
    """The inputs describe something that cannot be served (nothing fits, bad format names, ...)."""


# --------------------------------------------------------------------------------------------- formats


def kv_entry_bytes(cfg: ModelConfig, kv_format: str) -> int:
    """Bytes of one SWA, C4 or HCA entry (a `head_dim`-wide key that is also the value)."""
    if kv_format == "bf16":
        return 2 * cfg.head_dim
    if kv_format == "fp8":
        return fp8_main_row_bytes(cfg.head_dim, cfg.rope_head_dim)
    raise PlanError(f"unknown kv format {kv_format!r}; expected one of {KV_FORMATS}")


def index_key_bytes(cfg: ModelConfig, index_format: str) -> int:
    """Bytes of one indexer key (`index_head_dim` wide)."""
    d = cfg.index_head_dim
    if index_format == "bf16":
        return 2 * d
    if index_format == "fp8":
        return d + 4
    if index_format == "fp4":
        return fp4_key_bytes(d)
    raise PlanError(f"unknown index format {index_format!r}; expected one of {INDEX_FORMATS}")


@dataclass(frozen=True)
class CompressorStateBytes:
    """Fixed fp32 compressor state of one request, per layer of each kind (reference ring layout)."""

    csa_main: int
    """One CSA layer's main compressor: 2*csa_rate slots x (2*head_dim kv + 2*head_dim score) x 4 B."""
    csa_indexer: int
    """One CSA layer's indexer compressor: the same ring at index_head_dim."""
    hca: int
    """One HCA layer's compressor: hca_rate slots x (head_dim kv + head_dim score) x 4 B."""


def compressor_state_bytes(cfg: ModelConfig) -> CompressorStateBytes:
    f = STATE_FLOAT_BYTES
    return CompressorStateBytes(
        csa_main=2 * cfg.csa_rate * (2 * cfg.head_dim + 2 * cfg.head_dim) * f,
        csa_indexer=2 * cfg.csa_rate * (2 * cfg.index_head_dim + 2 * cfg.index_head_dim) * f,
        hca=cfg.hca_rate * (cfg.head_dim + cfg.head_dim) * f,
    )


# --------------------------------------------------------------------------------------------- weights


def check_layout(cfg: ModelConfig, layout: ParallelLayout) -> None:
    """`layout.check(cfg)` as a PlanError (the command's readable failure)."""
    try:
        layout.check(cfg)
    except ValueError as e:
        raise PlanError(f"layout {layout.describe()} does not fit {cfg.name}: {e}") from None


@dataclass(frozen=True)
class WeightGroup:
    """One family of tensors in the weight estimate."""

    name: str
    """What the tensors are."""
    storage: str
    """How they are stored (dtype and scale layout)."""
    num_params: int
    """Weights in the family (scales not counted)."""
    num_bytes: int
    """Bytes including scales."""


@dataclass(frozen=True)
class WeightEstimate:
    """Weight bytes of a model, estimated from its geometry."""

    groups: tuple[WeightGroup, ...]
    """The served model (no multi-token-prediction block), by tensor family."""
    num_mtp_layers: int
    """Multi-token-prediction blocks assumed present in the checkpoint (1 for the published V4 models)."""
    mtp_params: int
    """Weights of those blocks."""
    mtp_bytes: int
    """Bytes of those blocks (not loaded for serving)."""

    @property
    def served_bytes(self) -> int:
        return sum(g.num_bytes for g in self.groups)

    @property
    def served_params(self) -> int:
        return sum(g.num_params for g in self.groups)

    @property
    def checkpoint_bytes(self) -> int:
        return self.served_bytes + self.mtp_bytes

    @property
    def checkpoint_params(self) -> int:
        return self.served_params + self.mtp_params


_ROUTED = "routed experts"
_SHARED = "shared experts"
_ATTN = "attention projections"
_COMP = "compressors and indexer (small)"
_ROUTER = "routers"
_EMBED = "embedding and output head"
_MISC = "norms, sinks, hyper-connections"
_STORAGE = MappingProxyType({
    _ROUTED: "fp4 e2m1 + e8m0 scale per 32 weights",
    _SHARED: "fp8 e4m3 + e8m0 scale per 128x128 block",
    _ATTN: "fp8 e4m3 + e8m0 scale per 128x128 block (q, kv, out, indexer q)",
    _COMP: "bf16 kv/gate/head-weight projections and norms, fp32 position biases",
    _ROUTER: "bf16 gate, fp32 bias, int64 hash table",
    _EMBED: "bf16",
    _MISC: "bf16 norms, fp32 sinks and hyper-connection parameters",
})
_DEQUANTIZED_STORAGE = MappingProxyType({
    **_STORAGE,
    _ROUTED: "bf16 (dequantized from fp4)",
    _SHARED: "bf16 (dequantized from fp8)",
    _ATTN: "bf16 (dequantized from fp8: q, kv, out, indexer q)",
})


def _fp8_matrix(rows: int, cols: int) -> tuple[int, int]:
    return rows * cols, rows * cols + math.ceil(rows / 128) * math.ceil(cols / 128)


def _fp4_matrix(rows: int, cols: int) -> tuple[int, int]:
    return rows * cols, rows * (math.ceil(cols / 2) + math.ceil(cols / 32))


def _dequantized_matrix(rows: int, cols: int) -> tuple[int, int]:
    return rows * cols, DEQUANTIZED_WEIGHT_BYTES * rows * cols


def _block(cfg: ModelConfig, kind: str, hash_routed: bool, add, weights: str = WEIGHTS_PACKED,
           layout: ParallelLayout | None = None) -> None:
    """Add one transformer block's tensors (attention of `kind`, MoE, hyper-connections) through `add`: the
    whole block, or with `layout` one rank's part of it (see `estimate_weights`)."""
    packed = weights == WEIGHTS_PACKED
    fp8 = _fp8_matrix if packed else _dequantized_matrix
    fp4 = _fp4_matrix if packed else _dequantized_matrix
    shard = layout.shard(0) if layout is not None else WHOLE  # every rank holds as much as rank 0
    h, d, heads = cfg.hidden_size, cfg.head_dim, cfg.num_heads
    (_, rank_heads), (_, rank_groups), (_, rank_experts) = shard.heads(cfg), shard.groups(cfg), shard.experts(cfg)
    for rows, cols in ((cfg.q_lora_rank, h),  # wq_a (whole)
                       (rank_heads * d, cfg.q_lora_rank),  # wq_b (by heads)
                       (d, h),  # wkv (whole)
                       (rank_groups * cfg.o_lora_rank, heads * d // cfg.o_groups),  # wo_a (by output groups)
                       (h, rank_groups * cfg.o_lora_rank)):  # wo_b (by input columns)
        add(_ATTN, *fp8(rows, cols))
    add(_MISC, 2 * h + cfg.q_lora_rank + d, 2 * (2 * h + cfg.q_lora_rank + d))  # attn/ffn/q/kv norms
    add(_MISC, rank_heads, 4 * rank_heads)  # attention sink logits (by heads)
    if kind != SLIDING:
        rate, coff = (cfg.csa_rate, 2) if kind == CSA else (cfg.hca_rate, 1)
        add(_COMP, 2 * coff * d * h, 2 * 2 * coff * d * h)  # compressor kv + gate
        add(_COMP, rate * coff * d, 4 * rate * coff * d)  # position bias
        add(_COMP, d, 2 * d)  # compressor norm
    if kind == CSA:
        di, ni = cfg.index_head_dim, cfg.index_n_heads
        add(_ATTN, *fp8(ni * di, cfg.q_lora_rank))  # indexer query projection
        add(_COMP, ni * h, 2 * ni * h)  # per-head weights
        add(_COMP, 2 * 2 * di * h, 2 * 2 * 2 * di * h)  # indexer compressor kv + gate
        add(_COMP, cfg.csa_rate * 2 * di, 4 * cfg.csa_rate * 2 * di)
        add(_COMP, di, 2 * di)
    hc = cfg.hc_mult
    mix = hc * (2 + hc)  # pre weights, post weights, stream-mixing matrix
    hc_params = 2 * (mix * hc * h + mix + 3)  # attention and ffn sides: fn, base, scale
    add(_MISC, hc_params, 4 * hc_params)
    e = cfg.n_routed_experts
    add(_ROUTER, e * h, 2 * e * h)
    if hash_routed:
        add(_ROUTER, cfg.vocab_size * cfg.num_experts_per_tok, 8 * cfg.vocab_size * cfg.num_experts_per_tok)
    else:
        add(_ROUTER, e, 4 * e)
    inter = cfg.moe_intermediate_size
    for rows, cols in ((inter, h), (inter, h), (h, inter)):  # gate, up, down
        p, b = fp4(rows, cols)
        add(_ROUTED, rank_experts * p, rank_experts * b)
    shared = inter * cfg.n_shared_experts
    for rows, cols in ((shared, h), (shared, h), (h, shared)):
        add(_SHARED, *fp8(rows, cols))


def estimate_weights(cfg: ModelConfig, num_mtp_layers: int = 1, weights: str = WEIGHTS_PACKED,
                     layout: ParallelLayout | None = None) -> WeightEstimate:
    """Weight bytes of `cfg` in the published checkpoint formats (`packed`, also what a packed load keeps
    resident) or with every FP8/FP4 matrix in bf16 (`dequantize`); see the module docstring.

    With `layout`, the bytes one rank of a replica split that way holds (every rank holds the same amount):
    its `n_routed_experts / ep` routed experts, and with attention-TP its `1/tp` of `wq_b` and the sinks (by
    heads), of `wo_a` (by output groups) and of `wo_b` (by input columns), each slice packed on its own (block
    scales per slice); every other tensor whole. Raises PlanError when the layout does not fit the model."""
    if weights not in WEIGHT_MODES:
        raise PlanError(f"unknown weights mode {weights!r}; expected one of {WEIGHT_MODES}")
    if layout is not None:
        check_layout(cfg, layout)
    storage = _STORAGE if weights == WEIGHTS_PACKED else _DEQUANTIZED_STORAGE
    totals: dict[str, list[int]] = {k: [0, 0] for k in storage}

    def add(group: str, params: int, nbytes: int) -> None:
        totals[group][0] += params
        totals[group][1] += nbytes

    h, v, hc = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    heads = 1 if cfg.tie_word_embeddings else 2
    add(_EMBED, heads * v * h, 2 * heads * v * h)
    add(_MISC, h, 2 * h)  # final norm
    add(_MISC, hc * hc * h + hc + 1, 4 * (hc * hc * h + hc + 1))  # stream-collapse head
    for i, kind in enumerate(cfg.layer_types):
        _block(cfg, kind, cfg.mlp_kind(i) == HASH_MOE, add, weights, layout)
    groups = tuple(WeightGroup(k, storage[k], p, b) for k, (p, b) in totals.items())

    mtp = [0, 0]

    def add_mtp(_group: str, params: int, nbytes: int) -> None:
        mtp[0] += params
        mtp[1] += nbytes

    for _ in range(num_mtp_layers):
        _block(cfg, SLIDING, False, add_mtp, weights, layout)
        for _proj in range(2):  # embedding and hidden-state input projections
            add_mtp(_ATTN, *(_fp8_matrix if weights == WEIGHTS_PACKED else _dequantized_matrix)(h, h))
        add_mtp(_MISC, 3 * h, 6 * h)  # their norms and the block's own final norm
        add_mtp(_MISC, hc * hc * h + hc + 1, 4 * (hc * hc * h + hc + 1))
    return WeightEstimate(groups, num_mtp_layers, mtp[0], mtp[1])


# --------------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class PlanInputs:
    """What to plan for: a context length on some GPUs, with chosen cache formats and tier sizes."""

    context_len: int
    """Tokens of every request (prompt plus generated), the length each one must be able to reach."""
    device_bytes_per_gpu: int
    """Nominal device memory of one GPU, in bytes."""
    num_gpus: int = 8
    """GPUs the weights are split over; each also holds the KV of its own requests."""
    gpu_name: str | None = None
    """Name of the GPU preset the memory came from, if any (for display)."""
    kv_format: str = "fp8"
    """Format of SWA, C4 and HCA entries: `fp8` (584-byte rows for V4) or `bf16`."""
    index_format: str = "fp4"
    """Format of indexer keys: `fp4` (68 B for V4), `fp8` (132 B) or `bf16` (256 B)."""
    hot_buffer_slots: int | None = None
    """LRU hot-buffer slots per request and CSA layer; None: 2 x index_topk (as `TierConfig`)."""
    reserved_slots: int = TierConfig.reserved_slots
    """Hot-buffer slots per request and CSA layer kept for the newest C4 entries."""
    activation_reserve: float = 0.10
    """Fraction of each GPU's memory kept for activations and workspace, not for KV."""
    weight_bytes: int | None = None
    """Whole-model weight bytes (before splitting over GPUs); None: the estimate from the geometry."""
    host_memory_bytes: int | None = None
    """Host memory available for the C4 pool across the machines of these GPUs; None: not checked."""
    num_mtp_layers: int = 1
    """Multi-token-prediction blocks in the checkpoint, counted only in the checkpoint-size estimate."""
    weights: str = WEIGHTS_PACKED
    """How the GPUs hold the weights: `packed` (FP8/FP4 as in the checkpoint, the loader's default) or
    `dequantize` (those matrices expanded to bf16 at load)."""
    checkpoint_packed: bool | None = None
    """Whether the checkpoint stores FP8/FP4 tensors; False plans `dequantize` whatever `weights` says (there is
    nothing to keep packed); None assumes the published formats."""
    layout: ParallelLayout | None = None
    """How each replica splits the model over its `layout.world` GPUs (`core.parallel`): `num_gpus` must be a
    multiple of the world size, each GPU holds one rank's weights (`estimate_weights(..., layout=...)`) and its
    DP group's KV. None: the weights split evenly over all GPUs, attention data-parallel (no real layout)."""

    def __post_init__(self) -> None:
        if self.context_len < 1:
            raise PlanError(f"context must be at least 1 token, got {self.context_len}")
        if self.device_bytes_per_gpu < 1:
            raise PlanError(f"device memory must be positive, got {self.device_bytes_per_gpu}")
        if self.num_gpus < 1:
            raise PlanError(f"num_gpus must be at least 1, got {self.num_gpus}")
        if self.kv_format not in KV_FORMATS:
            raise PlanError(f"unknown kv format {self.kv_format!r}; expected one of {KV_FORMATS}")
        if self.index_format not in INDEX_FORMATS:
            raise PlanError(f"unknown index format {self.index_format!r}; expected one of {INDEX_FORMATS}")
        if not 0.0 <= self.activation_reserve < 1.0:
            raise PlanError(f"activation reserve must be in [0, 1), got {self.activation_reserve}")
        if self.hot_buffer_slots is not None and self.hot_buffer_slots < 1:
            raise PlanError(f"hot buffer slots must be positive, got {self.hot_buffer_slots}")
        if self.reserved_slots < 0:
            raise PlanError(f"reserved slots must not be negative, got {self.reserved_slots}")
        if self.weight_bytes is not None and self.weight_bytes < 0:
            raise PlanError(f"weight bytes must not be negative, got {self.weight_bytes}")
        if self.host_memory_bytes is not None and self.host_memory_bytes < 0:
            raise PlanError(f"host memory must not be negative, got {self.host_memory_bytes}")
        if self.weights not in WEIGHT_MODES:
            raise PlanError(f"unknown weights mode {self.weights!r}; expected one of {WEIGHT_MODES}")
        if self.layout is not None:
            if self.num_gpus % self.layout.world:
                raise PlanError(
                    f"{self.num_gpus} GPUs do not hold whole replicas of layout {self.layout.describe()} "
                    f"({self.layout.world} GPUs each); use a multiple of {self.layout.world} GPUs"
                )
            if self.weight_bytes is not None:
                raise PlanError("a whole-model weight figure cannot be split by a layout: with a layout the per-rank "
                                "weights come from the geometry, leave out the weight bytes")

    @property
    def kv_copies(self) -> int:
        """GPUs that hold the same requests' KV: the attention-TP degree (1 without a layout)."""
        return self.layout.tp if self.layout is not None else 1

    @property
    def replicas(self) -> int | None:
        """Whole replicas of the layout on `num_gpus` GPUs; None without a layout."""
        return self.num_gpus // self.layout.world if self.layout is not None else None

    @property
    def weight_mode(self) -> str:
        """The mode the GPUs will really use: `dequantize` for a checkpoint with nothing packed."""
        return WEIGHTS_DEQUANTIZE if self.checkpoint_packed is False else self.weights


@dataclass(frozen=True)
class TokenBytes:
    """Length-proportional bytes per context token, summed over all layers (fractions are real)."""

    c4: float
    """C4 entries: #CSA layers x kv entry / csa_rate. On the device without the tier, in host memory with it."""
    index_keys: float
    """Indexer keys: #CSA layers x index key / csa_rate. Always on the device."""
    hca: float
    """HCA entries: #HCA layers x kv entry / hca_rate. Always on the device."""
    slot_map: float
    """Entry -> hot-buffer slot map: #CSA layers x 4 B / csa_rate. On the device, tier only."""

    @property
    def device_without_tier(self) -> float:
        return self.c4 + self.index_keys + self.hca

    @property
    def device_with_tier(self) -> float:
        return self.index_keys + self.hca + self.slot_map


@dataclass(frozen=True)
class FixedBytes:
    """Bytes every request holds on the device whatever its length."""

    swa: int
    """Sliding-window rings: #layers x sliding_window x kv entry."""
    compressor_state: int
    """fp32 compressor rings of all CSA (main + indexer) and HCA layers."""
    hot_buffer: int
    """Tier only: #CSA layers x (hot_buffer_slots + reserved_slots) x kv entry."""

    @property
    def device_without_tier(self) -> int:
        return self.swa + self.compressor_state

    @property
    def device_with_tier(self) -> int:
        return self.swa + self.compressor_state + self.hot_buffer


@dataclass(frozen=True)
class RequestBytes:
    """Bytes of one request at the planned context, per cache kind (whole entries only)."""

    c4: int
    """C4 entries: #CSA layers x (context // csa_rate) x kv entry."""
    index_keys: int
    """Indexer keys: #CSA layers x (context // csa_rate) x index key."""
    hca: int
    """HCA entries: #HCA layers x (context // hca_rate) x kv entry."""
    slot_map: int
    """Tier only: #CSA layers x (context // csa_rate) x 4 B."""
    swa: int
    """Sliding-window rings (fixed)."""
    compressor_state: int
    """Compressor rings (fixed)."""
    hot_buffer: int
    """Tier only: hot-buffer slots (fixed)."""

    @property
    def device_without_tier(self) -> int:
        return self.c4 + self.index_keys + self.hca + self.swa + self.compressor_state

    @property
    def device_with_tier(self) -> int:
        return self.index_keys + self.hca + self.slot_map + self.swa + self.compressor_state + self.hot_buffer

    @property
    def host_with_tier(self) -> int:
        return self.c4


@dataclass(frozen=True)
class Plan:
    """The planner's answer for one model, GPU and context."""

    model_name: str
    """Name of the planned model."""
    inputs: PlanInputs
    """What was asked."""
    num_layers: int
    """Served layers."""
    num_csa_layers: int
    """CSA layers (C4 entries, indexer keys, hot buffers)."""
    num_hca_layers: int
    """HCA layers."""
    kv_entry_bytes: int
    """Bytes of one SWA/C4/HCA entry in the chosen kv format."""
    index_key_bytes: int
    """Bytes of one indexer key in the chosen index format."""
    hot_buffer_slots: int
    """LRU hot-buffer slots per request and CSA layer actually used (default resolved)."""
    compressor_state_per_layer: CompressorStateBytes
    """Compressor ring bytes per layer of each kind."""
    weights: WeightEstimate
    """Estimated weights in the published checkpoint formats (ignored for the budget when `inputs.weight_bytes`
    is given, and when the weights are dequantized)."""
    dequantized_weights: WeightEstimate
    """The same weights with every FP8/FP4 matrix in bf16 (what `weights=dequantize` keeps resident)."""
    weight_bytes: int
    """Whole-model weight bytes used for the budget."""
    weight_bytes_per_gpu: int
    """One GPU's share of the weights: with a layout, one rank's weights (`rank_weights` or its dequantized twin)."""
    rank_weights: WeightEstimate | None
    """With a layout: one rank's weights in the checkpoint formats (no MTP block); None without one."""
    rank_dequantized_weights: WeightEstimate | None
    """With a layout: the same with every FP8/FP4 matrix in bf16; None without one."""
    activation_reserve_bytes_per_gpu: int
    """Bytes per GPU kept for activations and workspace."""
    kv_budget_bytes_per_gpu: int
    """Bytes per GPU left for KV."""
    bytes_per_token: TokenBytes
    """Length-proportional bytes per token of each kind."""
    fixed_bytes_per_request: FixedBytes
    """Fixed bytes per request of each kind."""
    request_bytes: RequestBytes
    """One request at the planned context, per kind."""
    requests_per_gpu_without_tier: int
    """Requests whose KV one GPU holds, everything on the device (with attention-TP every rank of a group holds
    the same requests)."""
    requests_per_gpu_with_tier: int
    """Requests whose device part one GPU holds, C4 entries in host memory."""
    requests_without_tier: int
    """Concurrent requests at the context, all GPUs, everything on the device."""
    requests_with_tier: int
    """Concurrent requests at the context, all GPUs, C4 entries in host memory (device-bound only)."""
    host_bytes_needed: int
    """Host memory the C4 entries of `requests_with_tier` requests take, one copy per GPU that holds them (with
    attention-TP each rank keeps its own host copy: `kv_copies` copies)."""
    requests_with_tier_host_limited: int | None
    """Concurrent requests with the tier when host memory is also a limit; None when not given."""
    notes: tuple[str, ...]
    """Warnings worth reading next to the numbers."""

    @property
    def weight_bytes_per_gpu_by_mode(self) -> dict[str, int]:
        """Estimated resident weights per GPU in each mode (packed vs dequantized), for comparison."""
        if self.rank_weights is not None and self.rank_dequantized_weights is not None:
            return {WEIGHTS_PACKED: self.rank_weights.served_bytes,
                    WEIGHTS_DEQUANTIZE: self.rank_dequantized_weights.served_bytes}
        n = self.inputs.num_gpus
        return {WEIGHTS_PACKED: math.ceil(self.weights.served_bytes / n),
                WEIGHTS_DEQUANTIZE: math.ceil(self.dequantized_weights.served_bytes / n)}

    @property
    def host_bytes_per_gpu(self) -> int:
        """Host memory one GPU's requests need for their C4 entries with the tier."""
        return self.requests_per_gpu_with_tier * self.request_bytes.host_with_tier

    def per_gpu(self) -> dict:
        """One GPU's (one rank's) figures, JSON-ready."""
        ctx = self.inputs.context_len
        return {
            "weight_bytes": self.weight_bytes_per_gpu,
            "weight_bytes_by_mode": self.weight_bytes_per_gpu_by_mode,
            "whole_model_weight_bytes": self.weight_bytes,
            "activation_reserve_bytes": self.activation_reserve_bytes_per_gpu,
            "kv_budget_bytes": self.kv_budget_bytes_per_gpu,
            "requests_without_tier": self.requests_per_gpu_without_tier,
            "requests_with_tier": self.requests_per_gpu_with_tier,
            "tokens_without_tier": self.requests_per_gpu_without_tier * ctx,
            "tokens_with_tier": self.requests_per_gpu_with_tier * ctx,
            "host_bytes_needed": self.host_bytes_per_gpu,
            "weight_groups": None if self.rank_weights is None else [asdict(g) for g in self.rank_weights.groups],
        }

    def layout_dict(self) -> dict | None:
        """The layout and its replicas, JSON-ready; None without a layout."""
        layout = self.inputs.layout
        if layout is None:
            return None
        return {"name": layout.describe(), "dp": layout.dp, "tp": layout.tp, "ep": layout.ep,
                "expert_parallel": layout.expert_parallel, "world": layout.world, "replicas": self.inputs.replicas,
                "dp_groups": self.inputs.replicas * layout.dp, "kv_copies": self.inputs.kv_copies}

    @property
    def tokens_without_tier(self) -> int:
        return self.requests_without_tier * self.inputs.context_len

    @property
    def tokens_with_tier(self) -> int:
        return self.requests_with_tier * self.inputs.context_len

    @property
    def ratio(self) -> float | None:
        """Tokens with the tier over tokens without it; None when nothing fits without it."""
        if self.requests_without_tier == 0:
            return None
        return self.requests_with_tier / self.requests_without_tier

    @property
    def request_ratio(self) -> float:
        """Device bytes of one request without the tier over with it (the ratio before rounding down)."""
        return self.request_bytes.device_without_tier / self.request_bytes.device_with_tier

    @property
    def ceiling_ratio(self) -> float:
        """The ratio as context grows without bound: per-token device bytes without over with the tier."""
        return self.bytes_per_token.device_without_tier / self.bytes_per_token.device_with_tier

    @property
    def host_fits(self) -> bool | None:
        if self.inputs.host_memory_bytes is None:
            return None
        return self.host_bytes_needed <= self.inputs.host_memory_bytes

    def to_dict(self) -> dict:
        """A JSON-ready summary: the headline numbers at the top, every input and breakdown below."""
        tpb = asdict(self.bytes_per_token)
        fixed = asdict(self.fixed_bytes_per_request)
        req = asdict(self.request_bytes)
        w = self.weights
        return {
            "model": self.model_name,
            "context_len": self.inputs.context_len,
            "tokens_with_tier": self.tokens_with_tier,
            "tokens_without_tier": self.tokens_without_tier,
            "ratio": self.ratio,
            "ceiling_ratio": self.ceiling_ratio,
            "request_ratio": self.request_ratio,
            "requests_with_tier": self.requests_with_tier,
            "requests_without_tier": self.requests_without_tier,
            "bytes_per_token": tpb,
            "device_bytes_per_token": {"without_tier": self.bytes_per_token.device_without_tier,
                                       "with_tier": self.bytes_per_token.device_with_tier},
            "fixed_bytes_per_request": fixed,
            "request_bytes": req,
            "device_bytes_per_request": {"without_tier": self.request_bytes.device_without_tier,
                                         "with_tier": self.request_bytes.device_with_tier},
            "host_bytes_per_request": self.request_bytes.host_with_tier,
            "host_bytes_needed": self.host_bytes_needed,
            "host_memory_bytes": self.inputs.host_memory_bytes,
            "host_fits": self.host_fits,
            "requests_with_tier_host_limited": self.requests_with_tier_host_limited,
            "formats": {
                "kv": self.inputs.kv_format, "kv_entry_bytes": self.kv_entry_bytes,
                "index": self.inputs.index_format, "index_key_bytes": self.index_key_bytes,
                "compressor_state": "fp32", "slot_map_entry_bytes": SLOT_MAP_ENTRY_BYTES,
            },
            "hot_buffer": {"slots": self.hot_buffer_slots, "reserved_slots": self.inputs.reserved_slots},
            "compressor_state_per_layer": asdict(self.compressor_state_per_layer),
            "layers": {"total": self.num_layers, "csa": self.num_csa_layers, "hca": self.num_hca_layers},
            "device": {
                "gpu": self.inputs.gpu_name,
                "num_gpus": self.inputs.num_gpus,
                "bytes_per_gpu": self.inputs.device_bytes_per_gpu,
                "activation_reserve": self.inputs.activation_reserve,
                "activation_reserve_bytes_per_gpu": self.activation_reserve_bytes_per_gpu,
                "weight_bytes_per_gpu": self.weight_bytes_per_gpu,
                "kv_budget_bytes_per_gpu": self.kv_budget_bytes_per_gpu,
                "kv_budget_bytes": self.kv_budget_bytes_per_gpu * self.inputs.num_gpus,
            },
            "weights": {
                "mode": self.inputs.weight_mode,
                "bytes_used": self.weight_bytes,
                "estimated": self.inputs.weight_bytes is None,
                "bytes_per_gpu_by_mode": self.weight_bytes_per_gpu_by_mode,
                "dequantized_served_bytes": self.dequantized_weights.served_bytes,
                "served_bytes": w.served_bytes,
                "served_params": w.served_params,
                "checkpoint_bytes": w.checkpoint_bytes,
                "checkpoint_params": w.checkpoint_params,
                "num_mtp_layers": w.num_mtp_layers,
                "groups": [asdict(g) for g in w.groups],
            },
            "layout": self.layout_dict(),
            "per_gpu": self.per_gpu(),
            "notes": list(self.notes),
        }


def token_bytes(cfg: ModelConfig, kv_format: str, index_format: str) -> TokenBytes:
    """Length-proportional bytes per token of each kind (see `TokenBytes`)."""
    kv, idx = kv_entry_bytes(cfg, kv_format), index_key_bytes(cfg, index_format)
    n_csa, n_hca = len(cfg.csa_layers), len(cfg.hca_layers)
    return TokenBytes(
        c4=n_csa * kv / cfg.csa_rate,
        index_keys=n_csa * idx / cfg.csa_rate,
        hca=n_hca * kv / cfg.hca_rate,
        slot_map=n_csa * SLOT_MAP_ENTRY_BYTES / cfg.csa_rate,
    )


def fixed_bytes(cfg: ModelConfig, kv_format: str, hot_buffer_slots: int, reserved_slots: int) -> FixedBytes:
    """Fixed bytes per request of each kind (see `FixedBytes`)."""
    kv = kv_entry_bytes(cfg, kv_format)
    state = compressor_state_bytes(cfg)
    n_csa, n_hca = len(cfg.csa_layers), len(cfg.hca_layers)
    return FixedBytes(
        swa=cfg.num_layers * cfg.sliding_window * kv,
        compressor_state=n_csa * (state.csa_main + state.csa_indexer) + n_hca * state.hca,
        hot_buffer=n_csa * (hot_buffer_slots + reserved_slots) * kv,
    )


def request_bytes(cfg: ModelConfig, context_len: int, kv_format: str, index_format: str,
                  hot_buffer_slots: int, reserved_slots: int) -> RequestBytes:
    """One request of `context_len` tokens, per kind (see `RequestBytes`)."""
    kv, idx = kv_entry_bytes(cfg, kv_format), index_key_bytes(cfg, index_format)
    n_csa, n_hca = len(cfg.csa_layers), len(cfg.hca_layers)
    c4_entries = context_len // cfg.csa_rate
    hca_entries = context_len // cfg.hca_rate
    fixed = fixed_bytes(cfg, kv_format, hot_buffer_slots, reserved_slots)
    return RequestBytes(
        c4=n_csa * c4_entries * kv,
        index_keys=n_csa * c4_entries * idx,
        hca=n_hca * hca_entries * kv,
        slot_map=n_csa * c4_entries * SLOT_MAP_ENTRY_BYTES,
        swa=fixed.swa,
        compressor_state=fixed.compressor_state,
        hot_buffer=fixed.hot_buffer,
    )


def plan(cfg: ModelConfig, inputs: PlanInputs) -> Plan:
    """How many requests of `inputs.context_len` tokens fit on the GPUs, with and without the tier."""
    slots = inputs.hot_buffer_slots if inputs.hot_buffer_slots is not None else 2 * cfg.index_topk
    notes: list[str] = []
    if slots < cfg.index_topk:
        raise PlanError(f"hot buffer of {slots} slots cannot hold one step's top-{cfg.index_topk} selection")
    if inputs.context_len > cfg.max_position_embeddings:
        raise PlanError(f"context {inputs.context_len} exceeds the model's {cfg.max_position_embeddings} positions")

    layout = inputs.layout
    weights = estimate_weights(cfg, inputs.num_mtp_layers)
    dequantized = estimate_weights(cfg, inputs.num_mtp_layers, WEIGHTS_DEQUANTIZE)
    resident = weights if inputs.weight_mode == WEIGHTS_PACKED else dequantized
    weight_bytes = inputs.weight_bytes if inputs.weight_bytes is not None else resident.served_bytes
    if inputs.checkpoint_packed is False and inputs.weights == WEIGHTS_PACKED:
        notes.append("the checkpoint stores no FP8/FP4 tensors, so its weights are planned as dequantized (bf16)")
    rank_weights = rank_dequantized = None
    if layout is None:
        weight_per_gpu = math.ceil(weight_bytes / inputs.num_gpus)
    else:
        rank_weights = estimate_weights(cfg, 0, WEIGHTS_PACKED, layout)
        rank_dequantized = estimate_weights(cfg, 0, WEIGHTS_DEQUANTIZE, layout)
        weight_per_gpu = (rank_weights if resident is weights else rank_dequantized).served_bytes
    reserve = math.ceil(inputs.device_bytes_per_gpu * inputs.activation_reserve)
    budget = inputs.device_bytes_per_gpu - reserve - weight_per_gpu
    if budget <= 0:
        fix = ("use more GPUs or larger ones" if layout is None else
               f"layout {layout.describe()} puts this much on every rank whatever the GPU count: split more (expert "
               f"parallelism, attention-TP), use larger GPUs or a smaller activation reserve")
        raise PlanError(
            f"nothing left for KV: {weight_per_gpu / 1e9:.2f} GB of weights and {reserve / 1e9:.2f} GB of activation "
            f"reserve per GPU exceed the {inputs.device_bytes_per_gpu / 1e9:.2f} GB of each of {inputs.num_gpus} GPUs; "
            + fix + (", or keep the weights packed" if resident is dequantized else "")
        )

    per_tok = token_bytes(cfg, inputs.kv_format, inputs.index_format)
    fixed = fixed_bytes(cfg, inputs.kv_format, slots, inputs.reserved_slots)
    req = request_bytes(cfg, inputs.context_len, inputs.kv_format, inputs.index_format, slots, inputs.reserved_slots)
    # Each group of `kv_copies` GPUs (an attention-TP group; one GPU without TP) holds one set of requests.
    groups = inputs.num_gpus // inputs.kv_copies
    per_gpu_without, per_gpu_with = budget // req.device_without_tier, budget // req.device_with_tier
    without, with_tier = groups * per_gpu_without, groups * per_gpu_with
    if without == 0 and with_tier == 0:
        raise PlanError(
            f"a single request of {inputs.context_len} tokens does not fit on one GPU: it needs "
            f"{req.device_without_tier / 1e9:.3f} GB without the tier and {req.device_with_tier / 1e9:.3f} GB with it, "
            f"and each GPU has {budget / 1e9:.3f} GB for KV"
        )
    if without == 0:
        notes.append("the context fits only with the tier: no request fits on a GPU with every C4 entry on the device")
    c4_entries = inputs.context_len // cfg.csa_rate
    if c4_entries and slots + inputs.reserved_slots >= c4_entries:
        notes.append(f"the hot buffer ({slots} + {inputs.reserved_slots} slots) is at least as large as the "
                     f"{c4_entries} C4 entries of a request: at this context the tier saves no device memory")

    if inputs.kv_copies > 1:
        notes.append(f"attention-TP {inputs.kv_copies}: every rank of a TP group holds the whole KV of the group's "
                     f"requests, so the node holds 1/{inputs.kv_copies} of the summed budgets in distinct KV, and each "
                     f"rank keeps its own host copy of the C4 entries ({inputs.kv_copies} copies)")
    host_per_request = req.host_with_tier * inputs.kv_copies
    host_needed = with_tier * host_per_request
    host_limited = None
    if inputs.host_memory_bytes is not None:
        by_host = inputs.host_memory_bytes // host_per_request if host_per_request else with_tier
        host_limited = min(with_tier, by_host)
        if host_needed > inputs.host_memory_bytes:
            notes.append(
                f"host memory is the limit: {with_tier} requests need {host_needed / 1e9:.1f} GB for C4 entries but "
                f"{inputs.host_memory_bytes / 1e9:.1f} GB is available, which holds {host_limited} requests"
            )

    return Plan(
        model_name=cfg.name,
        inputs=inputs,
        num_layers=cfg.num_layers,
        num_csa_layers=len(cfg.csa_layers),
        num_hca_layers=len(cfg.hca_layers),
        kv_entry_bytes=kv_entry_bytes(cfg, inputs.kv_format),
        index_key_bytes=index_key_bytes(cfg, inputs.index_format),
        hot_buffer_slots=slots,
        compressor_state_per_layer=compressor_state_bytes(cfg),
        weights=weights,
        dequantized_weights=dequantized,
        weight_bytes=weight_bytes,
        weight_bytes_per_gpu=weight_per_gpu,
        rank_weights=rank_weights,
        rank_dequantized_weights=rank_dequantized,
        activation_reserve_bytes_per_gpu=reserve,
        kv_budget_bytes_per_gpu=budget,
        bytes_per_token=per_tok,
        fixed_bytes_per_request=fixed,
        request_bytes=req,
        requests_per_gpu_without_tier=per_gpu_without,
        requests_per_gpu_with_tier=per_gpu_with,
        requests_without_tier=without,
        requests_with_tier=with_tier,
        host_bytes_needed=host_needed,
        requests_with_tier_host_limited=host_limited,
        notes=tuple(notes),
    )

