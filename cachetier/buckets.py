"""How a decode step's shapes are chosen: batch-size buckets and context buckets.

A captured (CUDA graph) or compiled step has fixed shapes, so a step pads its batch and its gather
lengths to a *bucket* and reuses the graph of that bucket:
- rows: the number of running requests rounded up to a power of two (1, 2, 4, ...), capped at
  `max_rows` (the worker's `max_running`, itself the last bucket); padded rows write to scratch;
- context: the block-table width, `ceil(tokens / block_tokens)` of the longest request of the
  step rounded up to a power of two. Every per-request gather (indexer keys, HCA entries) is sized
  from it: `blocks * block_tokens / rate` entries, the invalid tail masked off.

Context grows one token per step, so a step changes context bucket only when its longest request
crosses a power-of-two number of blocks (256, 512, 1024, ... tokens with 256-token blocks): about
log2(max context / block) buckets over a request's life, each reused for every step inside it.
"""

from __future__ import annotations


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def batch_bucket(num_rows: int, max_rows: int) -> int:
    """Rows a step of `num_rows` requests is padded to."""
    if not 1 <= num_rows <= max_rows:
        raise ValueError(f"a step of {num_rows} requests does not fit max_running={max_rows}")
    return min(_pow2_at_least(num_rows), max_rows)


def batch_buckets(max_rows: int) -> list[int]:
    """Every row bucket up to `max_rows`: 1, 2, 4, ..., max_rows."""
    return sorted({batch_bucket(n, max_rows) for n in range(1, max_rows + 1)})


def context_blocks(num_tokens: int, block_tokens: int) -> int:
    """Block-table width of a step whose longest request holds `num_tokens` tokens (this step's included)."""
    return _pow2_at_least(max(1, -(-num_tokens // block_tokens)))


def gather_len(num_blocks: int, block_tokens: int, rate: int) -> int:
    """Entries of one compression rate that a table of `num_blocks` blocks can hold: the gather length."""
    return num_blocks * block_tokens // rate
