"""Tiny HF `transformers` DeepSeek-V4 models for reference checks (fp32, CPU).

Follows the spec's advice: explicit layer types and rope scaling, >= 8 indexer heads, and random
position biases, sinks, hash tables and correction biases (HF initialises them to zero).
"""

from __future__ import annotations

import torch

HF_LAYER = {"sliding": "sliding_attention", "csa": "compressed_sparse_attention", "hca": "heavily_compressed_attention"}

CONFIGS = {
    # The spec's recipe: one of each kind, window 8, CSA 4, HCA 8, top-k 2.
    "recipe": dict(layers=["sliding", "hca", "csa", "hca"], window=8, hca=8, topk=2, hc=2, mlp=["hash_moe", "moe", "moe", "moe"]),
    # CSA-heavy, odd window, HCA rate not a power of two, top-k 3.
    "csa_heavy": dict(layers=["csa", "hca", "csa", "sliding"], window=5, hca=12, topk=3, hc=3, mlp=["hash_moe", "hash_moe", "moe", "moe"]),
    # No sliding-only layer (like V4-Pro), wide top-k, large window.
    "pro_like": dict(layers=["hca", "hca", "csa"], window=16, hca=4, topk=6, hc=2, mlp=["moe", "moe", "moe"]),
}


def hf_config(name: str | dict, vocab: int = 97):
    """The HF config of one of CONFIGS (by name) or of a spec dict of the same shape."""
    from transformers import DeepseekV4Config

    c = CONFIGS[name] if isinstance(name, str) else name
    n = len(c["layers"])
    return DeepseekV4Config(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=n, num_attention_heads=4, num_key_value_heads=1,
        head_dim=32, partial_rotary_factor=8 / 32, q_lora_rank=32, o_groups=2, o_lora_rank=16,
        layer_types=[HF_LAYER[t] for t in c["layers"]],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": c["hca"]},
        sliding_window=c["window"], index_n_heads=8, index_head_dim=16, index_topk=c["topk"],
        rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 16},
        max_position_embeddings=512, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        moe_intermediate_size=48, mlp_layer_types=c["mlp"], hc_mult=c["hc"], hc_sinkhorn_iters=3,
        num_nextn_predict_layers=0, eos_token_id=None, bos_token_id=None,
    )


def hf_model(name: str | dict, seed: int = 0):
    from transformers import DeepseekV4ForCausalLM

    cfg = hf_config(name)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("position_bias", "sinks")):
                p.normal_(0.0, 0.5)
        for n, b in model.named_buffers():
            if n.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(cfg.n_routed_experts)[: b.shape[1]] for _ in range(b.shape[0])]))
            elif n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return model


def hf_and_ours(name: str | dict, seed: int, directory):
    """(HF model, our model loaded by our loader from HF's `save_pretrained` of it in `directory`)."""
    from model.loader import load_model

    hf = hf_model(name, seed)
    hf.save_pretrained(directory)
    return hf, load_model(directory)


def hf_step_logits(model, ids: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """HF logits of `ids` [1, L] fed in chunks of the given sizes through its cache."""
    out, pkv, a = [], None, 0
    with torch.no_grad():
        for c in chunks:
            r = model(ids[:, a : a + c], past_key_values=pkv, use_cache=True)
            out.append(r.logits[0])
            pkv = r.past_key_values
            a += c
    return torch.cat(out), pkv
