"""The model geometry every package agrees on.

`ModelConfig` is the normalised form of a DeepSeek-V4 `config.json` (either spelling; the parser lives
in `model.config`). It is a frozen value so it can cross process boundaries and serve as a dict key.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from core.kv_format import check_format

SLIDING = "sliding"
CSA = "csa"
HCA = "hca"
LAYER_KINDS = (SLIDING, CSA, HCA)

HASH_MOE = "hash_moe"
MOE = "moe"

WEIGHTS_PACKED = "packed"
"""Weight mode: FP8 linears and FP4 experts stay in their checkpoint formats and kernels compute on them
(the default; a checkpoint without packed tensors loads the same either way)."""
WEIGHTS_DEQUANTIZE = "dequantize"
"""Weight mode: every packed tensor is expanded to the model dtype at load (the reference path)."""
WEIGHT_MODES = (WEIGHTS_PACKED, WEIGHTS_DEQUANTIZE)


@dataclass(frozen=True)
class YarnScaling:
    """YaRN frequency interpolation applied to the compressed (CSA/HCA) layers' rotary embedding."""

    factor: float
    """Context extension factor (16 for the published V4 models)."""
    original_max_position_embeddings: int
    """Context length the model was pre-trained at before extension (65536 for V4)."""
    beta_fast: float = 32.0
    """High-frequency boundary of the interpolation ramp, in rotations."""
    beta_slow: float = 1.0
    """Low-frequency boundary of the interpolation ramp, in rotations."""
    truncate: bool = True
    """Round the ramp boundaries to whole dimensions (floor/ceil)."""


@dataclass(frozen=True)
class ModelConfig:
    """A DeepSeek-V4 model's geometry, in this project's spelling."""

    vocab_size: int
    """Number of token ids."""
    hidden_size: int
    """Width of the residual stream."""
    layer_types: tuple[str, ...]
    """Attention kind per layer: `sliding`, `csa` or `hca`."""
    num_heads: int
    """Query heads; there is a single shared key/value head."""
    head_dim: int
    """Width of a query head and of the shared key/value vector."""
    rope_head_dim: int
    """Trailing channels of each head that carry the rotary embedding."""
    q_lora_rank: int
    """Width of the query latent (also the indexer's query input)."""
    o_groups: int
    """Head groups of the grouped low-rank output projection."""
    o_lora_rank: int
    """Per-group width of the grouped output projection."""
    sliding_window: int
    """Raw tokens each query sees through the sliding window, itself included."""
    csa_rate: int = 4
    """Tokens compressed into one CSA (C4) entry."""
    hca_rate: int = 128
    """Tokens compressed into one HCA entry."""
    index_n_heads: int = 64
    """Lightning-indexer query heads."""
    index_head_dim: int = 128
    """Width of an indexer key and query head."""
    index_topk: int = 512
    """C4 entries each query attends to in a CSA layer."""
    rope_theta: float = 10000.0
    """Rotary base of sliding-only layers (no YaRN)."""
    compress_rope_theta: float = 160000.0
    """Rotary base of CSA/HCA layers, their compressors and the indexer."""
    yarn: YarnScaling | None = None
    """YaRN scaling of the compressed layers' rotary embedding, if any."""
    max_position_embeddings: int = 1048576
    """Longest sequence the model supports."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMS norm."""
    n_routed_experts: int = 256
    """Routed experts per MoE layer."""
    num_experts_per_tok: int = 6
    """Routed experts each token uses."""
    n_shared_experts: int = 1
    """Always-on shared experts (their widths add up into one MLP)."""
    moe_intermediate_size: int = 2048
    """Hidden width of one expert."""
    scoring_func: str = "sqrtsoftplus"
    """Router activation: `sqrtsoftplus`, `softmax` or `sigmoid`."""
    routed_scaling_factor: float = 1.5
    """Multiplier on the normalised routing weights."""
    mlp_layer_types: tuple[str, ...] = ()
    """Per layer: `hash_moe` (experts chosen by a token-id table) or `moe` (learned top-k)."""
    swiglu_limit: float = 10.0
    """Clamp on the expert gate (above) and up (both sides) projections; 0 disables it."""
    hc_mult: int = 4
    """Residual streams of the manifold-constrained hyper-connections."""
    hc_sinkhorn_iters: int = 20
    """Sinkhorn iterations that make the stream-mixing matrix doubly stochastic."""
    hc_eps: float = 1e-6
    """Floor added in the hyper-connection weights and Sinkhorn normalisation."""
    bos_token_id: int | None = 0
    """Token prepended by the tokenizer, if any."""
    eos_token_ids: tuple[int, ...] = (1,)
    """Tokens that end generation."""
    tie_word_embeddings: bool = False
    """Whether the output head shares the embedding matrix."""
    name: str = "deepseek-v4"
    """Name the model is served under."""
    kv_format: str = "bf16"
    """How KV rows (SWA keys, C4/HCA entries, indexer keys) are rounded and stored (`core.kv_format`):
    `bf16` (the compute dtype, no rounding), `v4` (V4's FP8 rows and MXFP4 indexer keys, stored packed)
    or `v4-dense` (the same roundings, rows kept in the compute dtype: the reference numerics)."""
    extra: dict = field(default_factory=dict, compare=False, hash=False)
    """Fields of the source config this project does not use (kept for round trips)."""

    def __post_init__(self) -> None:
        n = len(self.layer_types)
        if n == 0:
            raise ValueError("layer_types is empty: a model needs at least one layer")
        bad = [t for t in self.layer_types if t not in LAYER_KINDS]
        if bad:
            raise ValueError(f"unknown layer kinds {bad}; expected one of {LAYER_KINDS}")
        if self.mlp_layer_types and len(self.mlp_layer_types) != n:
            raise ValueError(f"mlp_layer_types has {len(self.mlp_layer_types)} entries for {n} layers")
        if self.rope_head_dim % 2 or self.rope_head_dim > self.head_dim:
            raise ValueError(f"rope_head_dim {self.rope_head_dim} must be even and at most head_dim")
        if (self.num_heads * self.head_dim) % self.o_groups:
            raise ValueError("num_heads * head_dim must divide into o_groups")
        check_format(self.kv_format)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def csa_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == CSA)

    @property
    def hca_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == HCA)

    def compress_rate(self, layer: int) -> int:
        """Tokens per compressed entry of `layer` (0 for sliding-only layers)."""
        kind = self.layer_types[layer]
        return self.csa_rate if kind == CSA else self.hca_rate if kind == HCA else 0

    def mlp_kind(self, layer: int) -> str:
        return self.mlp_layer_types[layer] if self.mlp_layer_types else MOE
