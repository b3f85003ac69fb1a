"""A small checkpoint in the published DeepSeek-V4 format, for tests and benchmarks of the packed path.

`write_realformat_checkpoint` writes what `deepseek-ai/DeepSeek-V4-Flash` ships, at a small geometry:
DeepSeek's own tensor names (no `model.` prefix, per-expert `ffn.experts.{e}.w1/w2/w3`), DeepSeek's
config.json spelling (`compress_ratios` with the MTP slot, `qk_rope_head_dim`, `num_hash_layers`,
`rope_scaling`, `expert_dtype`, `quantization_config`) and the dtypes of `v4-attention.md` section 7:

- FP8 e4m3 + `.scale` F8_E8M0 per 128x128 tile: attention `wq_a`, `wq_b`, `wkv`, `wo_a`, `wo_b`, the
  indexer's `wq_b`, the shared expert's `w1/w2/w3`;
- FP4 e2m1 pairs as I8 [out, in/2] + `.scale` F8_E8M0 [out, in/32]: every routed expert's `w1/w2/w3`;
- bf16: embedding, head, norms, compressor and indexer-compressor projections, indexer head weights, router;
- fp32: attention sinks, compressor position biases, router bias, hyper-connection parameters; int64 `tid2eid`.

Every dimension a scale tile spans is a multiple of 128 (hidden 256, q_lora 128, head_dim 128, o_lora 128,
expert width 128), as in the real models. Weights are random (seeded), quantized with power-of-two
scales and round-to-nearest-even (`kernels.formats`); or, with `quantize=False` (benchmarks of loading, at
hundreds of MB), packed codes and scale bytes drawn at random directly, in the same names, shapes and dtypes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from core.config import CSA, HASH_MOE, HCA, MOE, SLIDING, ModelConfig, YarnScaling
from model.builtin import random_init
from model.loader import build_empty, deepseek_state
from model.model import V4Model
from model.packed import FP4_EXPERTS, FP8, FP4Experts, FP8Linear, pack_like_checkpoint

SEED = 20261215


def realformat_config() -> ModelConfig:
    """Four layers (sliding, CSA, HCA, CSA), 8 experts top-2, one hash-routed layer; tile-aligned widths."""
    return ModelConfig(
        name="realformat-tiny",
        vocab_size=384,
        hidden_size=256,
        layer_types=(SLIDING, CSA, HCA, CSA),
        num_heads=4,
        head_dim=128,
        rope_head_dim=16,
        q_lora_rank=128,
        o_groups=2,
        o_lora_rank=128,
        sliding_window=16,
        csa_rate=4,
        hca_rate=16,
        index_n_heads=8,
        index_head_dim=32,
        index_topk=4,
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        yarn=YarnScaling(factor=16.0, original_max_position_embeddings=1024),
        max_position_embeddings=16384,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=128,
        mlp_layer_types=(HASH_MOE, MOE, MOE, MOE),
        hc_mult=2,
        hc_sinkhorn_iters=3,
        bos_token_id=0,
        eos_token_ids=(1,),
    )


def deepseek_config_json(cfg: ModelConfig) -> dict:
    """config.json in DeepSeek's spelling, with the quantization fields of the published checkpoints."""
    ratios = [{SLIDING: 0, CSA: cfg.csa_rate, HCA: cfg.hca_rate}[t] for t in cfg.layer_types] + [0]  # + MTP slot
    num_hash = sum(1 for i in range(cfg.num_layers) if cfg.mlp_kind(i) == HASH_MOE)
    yarn = cfg.yarn
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": 1,
        "head_dim": cfg.head_dim,
        "qk_rope_head_dim": cfg.rope_head_dim,
        "q_lora_rank": cfg.q_lora_rank,
        "o_groups": cfg.o_groups,
        "o_lora_rank": cfg.o_lora_rank,
        "sliding_window": cfg.sliding_window,
        "compress_ratios": ratios,
        "compress_rate_csa": cfg.csa_rate,
        "compress_rate_hca": cfg.hca_rate,
        "index_n_heads": cfg.index_n_heads,
        "index_head_dim": cfg.index_head_dim,
        "index_topk": cfg.index_topk,
        "rope_theta": cfg.rope_theta,
        "compress_rope_theta": cfg.compress_rope_theta,
        "rope_scaling": None if yarn is None else {
            "type": "yarn", "factor": yarn.factor, "original_max_position_embeddings": yarn.original_max_position_embeddings,
            "beta_fast": yarn.beta_fast, "beta_slow": yarn.beta_slow,
        },
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "n_routed_experts": cfg.n_routed_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "n_shared_experts": cfg.n_shared_experts,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "scoring_func": cfg.scoring_func,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "norm_topk_prob": True,
        "topk_method": "noaux_tc",
        "num_hash_layers": num_hash,
        "swiglu_limit": cfg.swiglu_limit,
        "hc_mult": cfg.hc_mult,
        "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters,
        "hc_eps": cfg.hc_eps,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_ids[0],
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 0,
        "torch_dtype": "bfloat16",
        "expert_dtype": "fp4",
        "quantization_config": {
            "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
            "weight_block_size": [128, 128],
        },
    }


def _checkpoint_dtype(name: str, t: torch.Tensor) -> torch.Tensor:
    """Dense tensors in the dtypes the published checkpoints use; packed ones as they are."""
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8, torch.int64):
        return t
    fp32 = name.endswith(("attn_sink", ".ape", "gate.bias")) or name.startswith("hc_") or ".hc_" in name
    return t.to(torch.float32 if fp32 else torch.bfloat16)


def _random_codes(cfg: ModelConfig, seed: int) -> V4Model:
    """A model packed like the checkpoints whose codes are drawn at random rather than quantized from dense
    weights: valid e4m3, e2m1 and UE8M0 values, no dense model ever built (quantizing hundreds of MB of
    experts takes minutes and GBs of int64 codes; this takes seconds)."""
    with torch.device("meta"):
        model = V4Model(cfg)
    pack_like_checkpoint(model)  # on meta: only the modules' types and shapes change
    model.to_empty(device="cpu")
    return _fill_random_codes(model, seed)


def _fill_random_codes(model: V4Model, seed: int) -> V4Model:
    """Every tensor of a packed model drawn in place, on the device it lives on (so a GPU model of V4's size never
    crosses from the host): codes and scales valid for their formats, dense weights small."""
    tensors = model.state_dict()
    dev = next(iter(tensors.values())).device
    gen = torch.Generator(device=dev).manual_seed(seed)
    n_experts = model.cfg.n_routed_experts
    with torch.no_grad():
        for name, t in tensors.items():
            if t.dtype == torch.float8_e4m3fn:
                t.copy_(torch.randn(t.shape, generator=gen, device=dev))
            elif t.dtype == torch.int8:  # e2m1 pairs: every byte is two valid codes
                t.copy_(torch.randint(-128, 128, t.shape, generator=gen, dtype=torch.int8, device=dev))
            elif t.dtype == torch.uint8:  # expert scales as UE8M0 bytes, 2**-8 .. 2**-4
                t.copy_(torch.randint(119, 124, t.shape, generator=gen, dtype=torch.uint8, device=dev))
            elif name.endswith(".scale"):  # FP8 tile scales, powers of two
                t.copy_(torch.exp2(torch.randint(-8, -3, t.shape, generator=gen, device=dev).float()))
            elif name.endswith("tid2eid"):
                t.copy_(torch.randint(0, n_experts, t.shape, generator=gen, device=dev))
            else:
                t.copy_(torch.randn(t.shape, generator=gen, device=dev) * 0.02)
    return model


def packed_skeleton(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16, device=None) -> V4Model:
    """An uninitialised model of `cfg` packed like the checkpoints (FP8 linears, FP4 experts), dense weights in
    `dtype`, on `device` (the meta device gives every tensor's size without memory)."""
    with torch.device("meta"):
        probe = V4Model(cfg)
    pack_like_checkpoint(probe)  # which modules the checkpoints pack, decided by the one rule that packs them
    kinds = {path: FP8 if isinstance(m, FP8Linear) else FP4_EXPERTS
             for path, m in probe.named_modules() if isinstance(m, (FP8Linear, FP4Experts))}
    return build_empty(cfg, dtype, device, packed=kinds)


def random_packed_model(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16, device=None, seed: int = SEED) -> V4Model:
    """`packed_skeleton` with its codes drawn at random where it computes (`_fill_random_codes`): benchmarks at V4's
    layer sizes without writing, loading or quantizing a checkpoint."""
    return _fill_random_codes(packed_skeleton(cfg, dtype, device), seed)


def write_realformat_checkpoint(
    model_dir: str | Path, cfg: ModelConfig | None = None, seed: int = SEED, quantize: bool = True
) -> Path:
    """Write config.json + model.safetensors of a random model of `cfg` (default `realformat_config()`);
    `quantize=False`: random packed codes instead of quantized random weights (`_random_codes`)."""
    cfg = cfg or realformat_config()
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    if quantize:
        model = build_empty(cfg)
        random_init(model, seed)
        pack_like_checkpoint(model)
    else:
        model = _random_codes(cfg, seed)
    tensors = {k: _checkpoint_dtype(k, v.detach().cpu()).contiguous() for k, v in deepseek_state(model).items()}
    (model_dir / "config.json").write_text(json.dumps(deepseek_config_json(cfg), indent=2) + "\n")
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    return model_dir
