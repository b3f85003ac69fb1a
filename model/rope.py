"""Interleaved rotary embedding on the trailing channels of a vector, with optional YaRN.

Channels (2i, 2i+1) of the rope slice form one complex number rotated by `pos * inv_freq[i]`
(GPT-J pairing, not the NeoX half split). Sliding-only layers use `rope_theta` without scaling;
CSA/HCA layers, their compressors and the indexer use `compress_rope_theta` with YaRN and no
magnitude scaling.
"""

from __future__ import annotations

import math

import torch

from core.config import SLIDING, ModelConfig, YarnScaling


def default_inv_freq(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def yarn_inv_freq(dim: int, base: float, yarn: YarnScaling) -> torch.Tensor:
    """YaRN: keep high frequencies, interpolate low ones by `factor`, with a linear ramp between."""

    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (yarn.factor * pos_freqs)
    keep = 1 - ramp  # 1 where the original frequency is kept
    return interpolated * (1 - keep) + extrapolated * keep


class Rotary:
    """Precomputed inverse frequencies of one rope kind; rotates on demand."""

    def __init__(self, inv_freq: torch.Tensor) -> None:
        self.inv_freq = inv_freq  # [rope_dim / 2]
        self.rope_dim = 2 * inv_freq.numel()

    def cos_sin(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = pos.to(torch.float32)[..., None] * self.inv_freq.to(pos.device)  # [..., rope_dim/2]
        return freqs.cos(), freqs.sin()

    def apply(self, x: torch.Tensor, pos: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Rotate the last `rope_dim` channels of `x` [..., (heads,) dim] by positions `pos` [...]."""
        cos, sin = self.cos_sin(pos)
        if x.dim() == pos.dim() + 2:  # a heads axis sits between positions and channels
            cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        if inverse:
            sin = -sin
        r = self.rope_dim
        nope, rope = x[..., :-r], x[..., -r:]
        pairs = rope.float().unflatten(-1, (r // 2, 2))
        even, odd = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
        return torch.cat((nope, rotated.to(x.dtype)), dim=-1)


def rotaries(cfg: ModelConfig) -> dict[str, Rotary]:
    """The two rope kinds: `main` (sliding-only layers) and `compress` (everything compressed)."""
    main = Rotary(default_inv_freq(cfg.rope_head_dim, cfg.rope_theta))
    if cfg.yarn is not None:
        compress = Rotary(yarn_inv_freq(cfg.rope_head_dim, cfg.compress_rope_theta, cfg.yarn))
    else:
        compress = Rotary(default_inv_freq(cfg.rope_head_dim, cfg.compress_rope_theta))
    return {"main": main, "compress": compress}


def rope_kind(cfg: ModelConfig, layer: int) -> str:
    return "main" if cfg.layer_types[layer] == SLIDING else "compress"
