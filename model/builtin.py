"""The built-in model `tiny`: a small DeepSeek-V4 with every layer kind.

It ships with the package as an HF-style directory (`model/assets/tiny`: config.json,
model.safetensors, tokenizer.json, training.json, and mtp.safetensors: its MTP draft head), trained by
`hisparse train` (the head by `hisparse train --mtp`) on the Python standard library, and loads through
the same loader as any checkpoint. Without the shipped directory (a
build that left it out), a model of the same geometry with random weights fixed by a seed and a
byte-level tokenizer is written once under the cache folder instead.

The geometry keeps CSA meaningful: at a few hundred tokens there are several times more C4 entries
than `index_topk`, and the HCA rate is small enough to emit entries early. Widths keep
V4's proportions where the tier cares (indexer keys a quarter of an entry, HCA far sparser than C4),
so the device/host split behaves like the real model's.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from core.config import CSA, HASH_MOE, HCA, MOE, SLIDING, ModelConfig, YarnScaling
from model.loader import build_empty, save_checkpoint
from model.tokenizer import byte_level_tokenizer

log = logging.getLogger(__name__)

BUILTIN = "tiny"
_VERSION = "v2"
SEED = 20261130


def tiny_config() -> ModelConfig:
    return ModelConfig(
        name=BUILTIN,
        vocab_size=262,  # the byte-level tokenizer
        hidden_size=128,
        layer_types=(SLIDING, CSA, HCA, CSA),
        num_heads=4,
        head_dim=64,
        rope_head_dim=8,
        q_lora_rank=64,
        o_groups=2,
        o_lora_rank=32,
        sliding_window=32,
        csa_rate=4,
        hca_rate=32,
        index_n_heads=8,
        index_head_dim=16,
        index_topk=16,
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        yarn=YarnScaling(factor=16.0, original_max_position_embeddings=8192),
        max_position_embeddings=1048576,  # V4's; beyond YaRN's 131072 only quality suffers
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=128,
        mlp_layer_types=(HASH_MOE, MOE, MOE, MOE),
        hc_mult=2,
        hc_sinkhorn_iters=3,
        bos_token_id=0,
        eos_token_ids=(1,),
    )


def random_init(model: torch.nn.Module, seed: int) -> None:
    """Deterministic random weights that exercise every path (position bias, sinks, routing tables)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("ape", "attn_sink")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif name.endswith(("_base", "gate.bias")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif name.endswith("_scale"):
                p.fill_(1.0)
            elif name == "embed.weight":
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) * fan_in**-0.5)
        for name, b in sorted(model.named_buffers()):
            if name.endswith("tid2eid"):
                n_exp = model.cfg.n_routed_experts
                b.copy_(torch.stack([torch.randperm(n_exp, generator=gen)[: b.shape[1]] for _ in range(b.shape[0])]))
            elif name.endswith("gate.bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)


def cache_dir() -> Path:
    base = os.environ.get("HISPARSE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hisparse")
    return Path(base)


SHIPPED = Path(__file__).resolve().parent / "assets" / BUILTIN


def ensure_builtin(name: str = BUILTIN) -> Path:
    """The directory of the built-in model: the shipped trained one, else a random one written on first
    use (atomically, so racing processes agree)."""
    if name != BUILTIN:
        raise ValueError(f"unknown built-in model {name!r}; the built-in model is {BUILTIN!r}")
    if (SHIPPED / "model.safetensors").is_file():
        return SHIPPED
    return random_builtin()


def random_builtin() -> Path:
    """The random-weight model of the built-in geometry, written under the cache folder on first use."""
    target = cache_dir() / "models" / f"{BUILTIN}-{_VERSION}"
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("writing the built-in model to %s", target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{BUILTIN}-", dir=target.parent))
    try:
        model = build_empty(tiny_config())
        random_init(model, SEED)
        save_checkpoint(model, tmp)
        byte_level_tokenizer().save(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; its copy is identical
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_dir(model: str) -> Path:
    """`tiny` -> the built-in model's directory; anything else must be a model directory."""
    if model == BUILTIN:
        return ensure_builtin()
    p = Path(model).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(f"model {model!r} is neither the built-in {BUILTIN!r} nor a directory")
    return p
