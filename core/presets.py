"""Published DeepSeek-V4 geometries (from their shipped config.json), for the capacity planner and tests."""

from __future__ import annotations

from core.config import CSA, HASH_MOE, HCA, MOE, SLIDING, ModelConfig, YarnScaling

_YARN = YarnScaling(factor=16.0, original_max_position_embeddings=65536, beta_fast=32.0, beta_slow=1.0)


def _pattern(first: tuple[str, str], n: int) -> tuple[str, ...]:
    return first + tuple(CSA if i % 2 == 0 else HCA for i in range(2, n))


V4_FLASH = ModelConfig(
    name="v4-flash", vocab_size=129280, hidden_size=4096, layer_types=_pattern((SLIDING, SLIDING), 43),
    num_heads=64, head_dim=512, rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
    sliding_window=128, csa_rate=4, hca_rate=128, index_n_heads=64, index_head_dim=128, index_topk=512,
    rope_theta=10000.0, compress_rope_theta=160000.0, yarn=_YARN, max_position_embeddings=1048576,
    n_routed_experts=256, num_experts_per_tok=6, n_shared_experts=1, moe_intermediate_size=2048,
    scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, mlp_layer_types=(HASH_MOE,) * 3 + (MOE,) * 40,
    swiglu_limit=10.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, bos_token_id=0, eos_token_ids=(1,),
)

V4_PRO = ModelConfig(
    name="v4-pro", vocab_size=129280, hidden_size=7168, layer_types=_pattern((HCA, HCA), 61),
    num_heads=128, head_dim=512, rope_head_dim=64, q_lora_rank=1536, o_groups=16, o_lora_rank=1024,
    sliding_window=128, csa_rate=4, hca_rate=128, index_n_heads=64, index_head_dim=128, index_topk=1024,
    rope_theta=10000.0, compress_rope_theta=160000.0, yarn=_YARN, max_position_embeddings=1048576,
    n_routed_experts=384, num_experts_per_tok=6, n_shared_experts=1, moe_intermediate_size=3072,
    scoring_func="sqrtsoftplus", routed_scaling_factor=2.5, mlp_layer_types=(HASH_MOE,) * 3 + (MOE,) * 58,
    swiglu_limit=10.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, bos_token_id=0, eos_token_ids=(1,),
)

PRESETS = {"v4-flash": V4_FLASH, "v4-pro": V4_PRO}
