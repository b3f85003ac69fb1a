"""Weights kept in their checkpoint's packed formats, as modules that compute on them.

- `FP8Linear`: a bias-free linear whose weight stays e4m3 with fp32 scales per 128x128 tile (1 byte per
  weight instead of 2 in bf16). Called as `module(x)` like `nn.Linear`; `grouped(x)` is the grouped
  projection `Attention.output` needs for `wo_a`.
- `FP4Experts`: routed experts kept as MXFP4 (half a byte per weight plus one scale byte per 32), with the
  `forward(x, idx, weights)` contract of `model.layers.Experts`.

Both keep their packed tensors as buffers (not parameters: they cannot be trained, and `parameters()`
stays the trainable set), named as the checkpoint names them (`wq_a.weight`, `wq_a.scale`; stacked
experts `gate_up`, `gate_up_scale`, `down`, `down_scale`). Their forward paths have static shapes and no
host syncs, so a compiled decode step can contain them. Note `model.to(dtype)` would cast e4m3 codes like
any float tensor: choose the dtype when loading instead.

Sharding helpers cut FP8 weights on 128-row/column tile boundaries together with their scales (tensor
parallelism) and give an expert-parallel rank whole packed experts.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from kernels.formats import FP4_BLOCK, FP8_BLOCK, dequant_fp4, dequant_fp8, quantize_fp4, quantize_fp8
from kernels.fp4_moe import fp4_expert_matmul
from kernels.fp8_linear import fp8_grouped_linear, fp8_linear
from model.layers import Experts, _swiglu

FP8 = "fp8"
"""Kind of a packed module: a block-FP8 linear."""
FP4_EXPERTS = "fp4_experts"
"""Kind of a packed module: stacked MXFP4 routed experts."""

CHECKPOINT_FP8 = re.compile(
    r"^(?:layers\.\d+|mtp)\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123])$|^mtp\.(e_proj|h_proj)$"
)
"""Linears the published V4 checkpoints store as block FP8 (module paths in our spelling; the MTP block's too)."""
CHECKPOINT_FP4 = re.compile(r"^(?:layers\.\d+|mtp)\.ffn\.experts$")
"""Routed-expert stacks the published V4 checkpoints store as MXFP4."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class FP8Linear(nn.Module):
    """y = x @ (e4m3 weight [out, in] x fp32 scale per 128x128 tile)^T, through `kernels.fp8_linear`."""

    act_fp8: bool = False
    """Quantize activations per token and 128-wide group to e4m3 as well (W8A8); off computes W8A16."""

    def __init__(self, in_features: int, out_features: int, device=None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device))
        scale_shape = (_cdiv(out_features, FP8_BLOCK), _cdiv(in_features, FP8_BLOCK))
        self.register_buffer("scale", torch.empty(scale_shape, dtype=torch.float32, device=device))

    @classmethod
    def from_tensors(cls, weight: torch.Tensor, scale: torch.Tensor) -> FP8Linear:
        mod = cls(weight.shape[1], weight.shape[0], device=weight.device)
        mod.weight.copy_(weight)
        mod.scale.copy_(scale.float())
        return mod

    @classmethod
    def from_dense(cls, linear: nn.Linear) -> FP8Linear:
        """Quantize a dense linear (power-of-two tile scales, nothing clipped)."""
        return cls.from_tensors(*quantize_fp8(linear.weight.detach()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.scale, self.act_fp8)

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., groups, in] with group g using rows g*n..(g+1)*n -> [..., groups, n] (n a multiple of 128)."""
        return fp8_grouped_linear(x, self.weight, self.scale)

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight (tests and references only: it is 4x the packed bytes)."""
        return dequant_fp8(self.weight, self.scale)

    def shard(self, dim: int, rank: int, world: int) -> FP8Linear:
        """This rank's slice: dim 0 splits outputs (column parallel), dim 1 splits inputs (row parallel)."""
        return FP8Linear.from_tensors(*shard_fp8(self.weight, self.scale, dim, rank, world))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 + {FP8_BLOCK}x{FP8_BLOCK} scales"


class FP4Experts(nn.Module):
    """Routed experts as MXFP4: gate_up [E, 2*inter, hidden/2] (w1 then w3), down [E, hidden, inter/2], int8
    packed e2m1 pairs, with UE8M0 scale bytes per 32 inputs. `first_expert` is the global id of local expert 0
    (non-zero on an expert-parallel rank); pairs routed to experts outside this module contribute 0.
    `routed_experts` is the router's whole set (default: first_expert + num_experts, the fewest the ids held
    allow); the kernel sizes its row blocks by the rows each expert can expect, which depends on it."""

    def __init__(
        self, num_experts: int, hidden: int, inter: int, limit: float, first_expert: int = 0, device=None,
        routed_experts: int | None = None,
    ) -> None:
        super().__init__()
        if hidden % 2 or inter % 2:
            raise ValueError(f"FP4 packs two inputs per byte; hidden {hidden} and inter {inter} must be even")
        routed = first_expert + num_experts if routed_experts is None else routed_experts
        if routed < first_expert + num_experts:
            raise ValueError(f"experts {first_expert}..{first_expert + num_experts - 1} are outside a router of {routed}")
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.limit, self.first_expert, self.routed_experts = limit, first_expert, routed

        def buf(name: str, rows: int, cols: int) -> None:
            self.register_buffer(name, torch.empty(num_experts, rows, cols // 2, dtype=torch.int8, device=device))
            shape = (num_experts, rows, _cdiv(cols, FP4_BLOCK))
            self.register_buffer(f"{name}_scale", torch.empty(shape, dtype=torch.uint8, device=device))

        buf("gate_up", 2 * inter, hidden)
        buf("down", hidden, inter)

    @classmethod
    def from_dense(cls, experts: Experts) -> FP4Experts:
        """Quantize dense stacked experts (round to nearest even, power-of-two scales, nothing clipped)."""
        e, two_i, h = experts.gate_up.shape
        mod = cls(e, h, two_i // 2, experts.limit, experts.first_expert, device=experts.gate_up.device,
                  routed_experts=experts.routed_experts)
        for name in ("gate_up", "down"):
            packed, scale = quantize_fp4(getattr(experts, name).detach())
            getattr(mod, name).copy_(packed)
            getattr(mod, f"{name}_scale").copy_(scale)
        return mod

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [tokens, hidden], idx [tokens, top_k] global expert ids, weights [tokens, top_k] -> [tokens, hidden]."""
        tokens, top_k = idx.shape
        local = idx.reshape(-1) - self.first_expert  # [pairs], pair p = (token p // top_k, slot p % top_k)
        experts = torch.where((local >= 0) & (local < self.num_experts), local, -1)
        pairs = torch.arange(tokens * top_k, device=x.device)
        routed = self.routed_experts
        h = fp4_expert_matmul(x, pairs // top_k, experts, self.gate_up, self.gate_up_scale, routed)  # [pairs, 2*inter]
        gate, up = h.chunk(2, dim=-1)
        act = _swiglu(gate, up, self.limit)  # [pairs, inter]
        y = fp4_expert_matmul(act, pairs, experts, self.down, self.down_scale, routed)  # [pairs, hidden]
        out = (y.unflatten(0, (tokens, top_k)) * weights.unsqueeze(-1)).sum(dim=1)
        return out.to(x.dtype)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up, down) in fp32 (tests and references only)."""
        return dequant_fp4(self.gate_up, self.gate_up_scale), dequant_fp4(self.down, self.down_scale)

    def shard(self, rank: int, world: int) -> FP4Experts:
        """Expert parallelism: this rank's whole experts (a contiguous range), scales included."""
        first, count = expert_range(self.num_experts, rank, world)
        mod = FP4Experts(count, self.hidden, self.inter, self.limit, self.first_expert + first, device=self.gate_up.device,
                         routed_experts=self.routed_experts)
        for name, t in self.named_buffers():
            getattr(mod, name).copy_(t[first : first + count])
        return mod

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts} (first {self.first_expert} of {self.routed_experts}), hidden={self.hidden}, "
                f"inter={self.inter}, mxfp4 e2m1 + ue8m0 per {FP4_BLOCK}")


# --------------------------------------------------------------------------------------------- sharding


def shard_fp8(weight: torch.Tensor, scale: torch.Tensor, dim: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank` of `world` equal slices of an FP8 weight [out, in] and its tile scales along `dim`.

    Cuts fall on 128-row (dim 0) or 128-column (dim 1) tile boundaries, so every slice keeps whole tiles
    and exactly their scales; a partial last tile goes with the last rank. Raises when the tiles along
    `dim` do not split evenly. Returns owned (contiguous) copies.
    """
    if dim not in (0, 1):
        raise ValueError(f"dim must be 0 (output rows) or 1 (input columns), got {dim}")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world}")
    size, tiles = weight.shape[dim], scale.shape[dim]
    if tiles != _cdiv(size, FP8_BLOCK):
        raise ValueError(f"{tiles} scale tiles do not cover {size} weights along dim {dim} in {FP8_BLOCK}-wide tiles")
    if tiles % world:
        raise ValueError(
            f"{size} weights along dim {dim} are {tiles} tiles of {FP8_BLOCK}, which do not split into {world} equal "
            f"shards on tile boundaries; choose a parallel degree that divides {tiles}"
        )
    per = tiles // world
    lo, hi = rank * per * FP8_BLOCK, min(size, (rank + 1) * per * FP8_BLOCK)
    return weight.narrow(dim, lo, hi - lo).contiguous().clone(), scale.narrow(dim, rank * per, per).contiguous().clone()


def expert_range(num_experts: int, rank: int, world: int) -> tuple[int, int]:
    """(first expert, count) of an expert-parallel rank: contiguous and equal; raises when E % world != 0."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world}")
    if num_experts % world:
        raise ValueError(f"{num_experts} experts do not split evenly over {world} expert-parallel ranks")
    count = num_experts // world
    return rank * count, count


# --------------------------------------------------------------------------------------------- models


def swap_in_packed(model: nn.Module, kinds: dict[str, str]) -> None:
    """Replace the modules at `kinds` (module path -> FP8 or FP4_EXPERTS) with empty packed ones of the same
    geometry on the same device; load their tensors next."""
    for path, kind in kinds.items():
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        old = getattr(parent, attr)
        if kind == FP8:
            if not isinstance(old, nn.Linear):
                raise TypeError(f"{path} is a {type(old).__name__}, not a linear; it cannot hold FP8 weights")
            new = FP8Linear(old.in_features, old.out_features, device=old.weight.device)
        elif kind == FP4_EXPERTS:
            if not isinstance(old, Experts):
                raise TypeError(f"{path} is a {type(old).__name__}, not routed experts; it cannot hold FP4 weights")
            e, two_i, h = old.gate_up.shape
            new = FP4Experts(e, h, two_i // 2, old.limit, old.first_expert, device=old.gate_up.device,
                             routed_experts=old.routed_experts)
        else:
            raise ValueError(f"unknown packed kind {kind!r} for {path}")
        setattr(parent, attr, new)


def pack_like_checkpoint(model: nn.Module) -> nn.Module:
    """Quantize a dense model in place the way the published checkpoints store it (FP8 linears, FP4 experts)."""
    for path, mod in list(model.named_modules()):
        parent_path, _, attr = path.rpartition(".")
        if CHECKPOINT_FP8.match(path) and isinstance(mod, nn.Linear):
            setattr(model.get_submodule(parent_path), attr, FP8Linear.from_dense(mod))
        elif CHECKPOINT_FP4.match(path) and isinstance(mod, Experts):
            setattr(model.get_submodule(parent_path), attr, FP4Experts.from_dense(mod))
    return model


def resident_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer (what the weights occupy where the model lives)."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
