"""Group (token, expert) pairs by expert into fixed-size row blocks, with static shapes and no host syncs.

A grouped expert GEMM wants every block of BLOCK_M rows to belong to one expert. Pairs are sorted by
expert and each expert's run is padded to a multiple of BLOCK_M. The number of slots is bounded by
`pairs + experts * (BLOCK_M - 1)` whatever the routing, so every tensor here has a shape fixed by the
batch size alone: a compiled or graph-captured step never asks the host how many tokens an expert got.
Blocks past the used part, and padding slots, are marked -1 and skipped by the kernel.
"""

from __future__ import annotations

import torch

BLOCK_M_SIZES = (16, 32, 64)
"""Row-block sizes of the grouped expert GEMM, smallest first. 16 is the least a tensor-core dot takes;
64 keeps the fp32 accumulator of a 64-output tile within registers."""


def expected_rows_per_expert(pairs: int, routed_experts: int) -> float:
    """Rows one expert gets on average: the batch's (token, expert) pairs over every expert the router picks
    from. On an expert-parallel rank that is the whole model's count, not the rank's: the rank sees every
    gathered pair but holds only its share of the experts, and the rest of the pairs are marked -1."""
    return pairs / max(routed_experts, 1)


def block_m(pairs: int, routed_experts: int, largest: int = BLOCK_M_SIZES[-1]) -> int:
    """BLOCK_M for a grouped expert matmul, from static shapes only (a captured step keeps one choice per batch).

    A block's rows past its expert's count are padding the dot still computes, and every further block of
    the same expert decodes that expert's weights again. So the block is the smallest size that holds the
    expected rows of one expert: 16 at decode sizes (12 rows per expert for 64 rows per rank on EP8 of
    V4-Flash), larger only once prefill-sized batches fill them, and never above `largest` (the kernel's
    register budget for its accumulator).
    """
    rows = expected_rows_per_expert(pairs, routed_experts)
    sizes = [size for size in BLOCK_M_SIZES if size <= largest] or [BLOCK_M_SIZES[0]]
    return next((size for size in sizes if rows <= size), sizes[-1])


def num_slots(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound of padded slots, rounded up to whole blocks."""
    bound = num_pairs + num_experts * (block_m - 1)
    return -(-bound // block_m) * block_m


def expert_blocks(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """experts [pairs] (-1 = no expert) -> (slot_pair [slots], block_expert [slots // block_m]).

    `slot_pair[s]` is the pair in slot s or -1 for padding; `block_expert[b]` is the expert of block b or -1
    when the block holds no pair. Pairs of one expert keep their original order.
    """
    pairs = experts.numel()
    dev = experts.device
    slots = num_slots(pairs, num_experts, block_m)
    e = torch.where(experts < 0, num_experts, experts)  # the "no expert" pairs sort last, into bucket E
    order = torch.argsort(e, stable=True)  # [pairs]
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev).scatter_add_(0, e, torch.ones_like(e))
    counts = counts[:num_experts]  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)  # [E]
    start = torch.cumsum(counts, 0) - counts  # first sorted index of each expert
    e_sorted = e[order]
    valid = e_sorted < num_experts
    ec = e_sorted.clamp(max=num_experts - 1)
    slot = pad_end[ec] - padded[ec] + torch.arange(pairs, device=dev) - start[ec]
    slot = torch.where(valid, slot, slots)  # unused pairs land in a spare slot that is cut off below
    slot_pair = torch.full((slots + 1,), -1, dtype=torch.long, device=dev)
    slot_pair.scatter_(0, slot, order)
    block_start = torch.arange(0, slots, block_m, device=dev)  # [blocks]
    block_expert = torch.searchsorted(pad_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return slot_pair[:slots], block_expert
