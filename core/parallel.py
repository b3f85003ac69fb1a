"""How one replica's ranks split a model: DP attention, attention-TP, expert parallelism.

A *replica* is `world = dp * tp` ranks, one device each. Ranks are numbered DP group by DP group:
rank = dp_rank * tp + tp_rank. Inside a DP group the `tp` ranks split attention heads and output
groups and see the same rows; different DP groups attend for different requests, each with its own KV
and tier. With `expert_parallel`, the routed experts are split over all `world` ranks (whole experts,
a contiguous range per rank) and every MoE layer exchanges rows between them; without it every rank
holds every expert. KV is never split by heads (the model has one KV head), so a layout any rank builds
is complete.

Pure arithmetic and checks: the collectives live in `model.parallel`, the processes in `cluster`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from core.config import ModelConfig


@dataclass(frozen=True)
class Shard:
    """What one rank holds: its slice of attention (tp) and of the routed experts (ep)."""

    tp: int = 1
    """Attention tensor-parallel degree (ranks that split heads and output groups)."""
    tp_rank: int = 0
    """This rank's place in its attention-TP group."""
    ep: int = 1
    """Expert-parallel degree (ranks that split the routed experts); 1 = every expert here."""
    ep_rank: int = 0
    """This rank's place among the expert-parallel ranks."""

    def heads(self, cfg: ModelConfig) -> tuple[int, int]:
        """(first head, heads) of this rank."""
        per = cfg.num_heads // self.tp
        return self.tp_rank * per, per

    def groups(self, cfg: ModelConfig) -> tuple[int, int]:
        """(first output group, groups) of this rank."""
        per = cfg.o_groups // self.tp
        return self.tp_rank * per, per

    def experts(self, cfg: ModelConfig) -> tuple[int, int]:
        """(first routed expert, experts) of this rank."""
        per = cfg.n_routed_experts // self.ep
        return self.ep_rank * per, per

    @property
    def whole(self) -> bool:
        return self.tp == 1 and self.ep == 1


WHOLE = Shard()
"""The shard of a single-process model: everything."""


@dataclass(frozen=True)
class ParallelLayout:
    """One replica's split: `dp` attention data-parallel groups of `tp` ranks, experts split or not."""

    dp: int = 1
    """Attention data-parallel groups: each schedules its own requests with its own KV and tier."""
    tp: int = 1
    """Attention tensor-parallel ranks per DP group (heads and output groups split; must divide o_groups)."""
    expert_parallel: bool = False
    """Split the routed experts over all dp * tp ranks (EP); off: every rank holds all of them."""

    def __post_init__(self) -> None:
        if self.dp < 1 or self.tp < 1:
            raise ValueError(f"parallel degrees must be >= 1, got dp={self.dp} tp={self.tp}")

    @property
    def world(self) -> int:
        return self.dp * self.tp

    @property
    def ep(self) -> int:
        return self.world if self.expert_parallel else 1

    @property
    def single(self) -> bool:
        """One rank: today's single-process model."""
        return self.world == 1

    def coords(self, rank: int) -> tuple[int, int]:
        """(dp_rank, tp_rank) of `rank`."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside a replica of {self.world} ranks")
        return divmod(rank, self.tp)

    def shard(self, rank: int) -> Shard:
        _, tp_rank = self.coords(rank)
        return Shard(tp=self.tp, tp_rank=tp_rank, ep=self.ep, ep_rank=rank if self.expert_parallel else 0)

    def tp_groups(self) -> list[list[int]]:
        """The ranks of each attention-TP group (one per DP group)."""
        return [list(range(d * self.tp, (d + 1) * self.tp)) for d in range(self.dp)]

    def check(self, cfg: ModelConfig) -> None:
        """Raise ValueError naming the fix when `cfg` cannot be split this way."""
        if cfg.num_heads % self.tp or cfg.o_groups % self.tp:
            raise ValueError(
                f"attention-TP {self.tp} must divide the model's {cfg.num_heads} heads and {cfg.o_groups} output "
                f"groups; choose a TP degree that divides {cfg.o_groups}"
            )
        if self.expert_parallel and cfg.n_routed_experts % self.world:
            raise ValueError(
                f"{cfg.n_routed_experts} routed experts do not split evenly over {self.world} expert-parallel "
                f"ranks; choose dp * tp dividing {cfg.n_routed_experts}, or turn expert parallelism off"
            )

    def describe(self) -> str:
        """`DP2`, `DP2+EP`, `TP2`, `DP2xTP2+EP` ..."""
        parts = []
        if self.dp > 1 or self.tp == 1:
            parts.append(f"DP{self.dp}")
        if self.tp > 1:
            parts.append(f"TP{self.tp}")
        name = "x".join(parts)
        return f"{name}+EP{self.ep}" if self.expert_parallel else name

    @classmethod
    def parse(cls, text: str) -> ParallelLayout:
        """Inverse of `describe`, case-insensitive: `dp4+ep4`, `tp2`, `dp2xtp2+ep4`, `dp1`."""
        m = re.fullmatch(r"\s*(?:dp(\d+))?\s*x?\s*(?:tp(\d+))?\s*(\+\s*ep(\d+))?\s*", text.lower())
        if not m or not (m.group(1) or m.group(2)):
            raise ValueError(f"cannot read {text!r} as a parallel layout (examples: dp2, dp4+ep4, tp2, dp2xtp2+ep4)")
        layout = cls(dp=int(m.group(1) or 1), tp=int(m.group(2) or 1), expert_parallel=bool(m.group(3)))
        if m.group(4) and int(m.group(4)) != layout.world:
            raise ValueError(f"{text!r}: experts split over all {layout.world} ranks of the replica, so EP must be {layout.world}")
        return layout
