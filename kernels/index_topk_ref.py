"""Torch reference of the decode indexer: one CSA layer's top-k entry ids per row, straight from the stored keys.

The score of entry s for a row's query is `I(s) = sum_h w[h] * relu(<q[h], key[s]>) / sqrt(dim)` (`entry_scores`
is its one definition, with the float arithmetic in a fixed order). A row selects the `min(topk, n)` entries
with the highest scores among its visible ones (a prefix `[0, count)` of the gather length `n`), best first,
an equal score going to the lower id, -1 padding where it sees fewer (the selection keys below make that
rule one total order).

Keys stay where the store keeps them (`PagedKeys`: a flat pool and, per row, where each block's keys
start) and are read a tile at a time: tile t holds entries `t*span .. (t+1)*span - 1` of every block of the
row, so the loop has a fixed number of tiles (`TILES`) whatever the context. That keeps a compiled step
symbolic in its block count (one graph for every bucket) and each tile's work the same ops on the same
shapes in the eager, compiled and captured steps. A tile is gathered as whole runs of stored keys (one
index per block, not per byte), decoded, scored and merged into each row's running best k; nothing is kept
across tiles but those k keys, so transient memory is a tile's, 1/TILES of scoring everything at once.
Fixed shapes, no host sync, nothing sized by data: a captured or compiled step can hold it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels.kv_format import KVCodec

TILES = 8
"""Tiles a step's keys are scored in (fewer when a block holds fewer entries): the bound on transient memory
(a tile's share of the keys) against the fixed cost of one more round of ops per CSA layer."""

# --- the selection rule as int64 keys ---------------------------------------------------------------
# Ties are common (a sum of ReLUs is exactly 0 for whole groups of entries) and torch's own topk breaks
# them arbitrarily, so a score and its entry id become one int64: the score's bits made order-preserving in
# the high 32 bits, `0xFFFFFFFF - id` in the low ones. Distinct keys have one top-k, however it is computed.

LOW = 0xFFFFFFFF
NEG_INF_ORD = -2139095041
"""Order-preserving int32 of float32 -inf (0xFF800000 ^ 0x7FFFFFFF): the high half of a masked entry's key."""
EMPTY_KEY = NEG_INF_ORD << 32
"""Key of "no entry": score -inf and the lowest id part, below every real key."""


def _ordered(scores: torch.Tensor) -> torch.Tensor:
    """float32 -> int32 with the same order (-0.0 and +0.0 made equal first)."""
    bits = (scores.float() + 0.0).view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def selection_keys(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Scores [...] and entry ids (broadcastable, < 2**32) -> int64 keys: higher score first, then lower id."""
    return (_ordered(scores).to(torch.int64) << 32) | (LOW - ids)


def key_scores(keys: torch.Tensor) -> torch.Tensor:
    """The float32 score each key was made from."""
    o = (keys >> 32).to(torch.int32)
    return torch.where(o < 0, o ^ 0x7FFFFFFF, o).view(torch.float32)


def key_ids(keys: torch.Tensor) -> torch.Tensor:
    """Entry id of each key; -1 where the score is -inf (a masked entry, or no entry)."""
    ids = LOW - (keys & LOW)
    return torch.where((keys >> 32) == NEG_INF_ORD, -1, ids)


def merge_keys(running: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Running best keys [rows, k] and new keys [rows, t] -> the best k of both, sorted (fixed shapes)."""
    return torch.cat((running, keys), dim=1).topk(running.shape[1], dim=1).values


# --- scores -------------------------------------------------------------------------------------------


def entry_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [rows, heads, dim], w [rows, heads] (fp32, the head weights), keys [rows, n, dim] -> scores [rows, n] fp32.

    The one definition of a decode score, in this order: fp32 products summed over channels (one batched
    matmul), ReLU, times 1/sqrt(dim), times the head weight, summed over heads. Each entry's score depends on
    its own key and the shape of the call only, so two stores holding the same keys score them alike."""
    s = torch.einsum("bhd,bnd->bhn", q.float(), keys.float())  # [rows, heads, n]
    return s.relu_().mul_(q.shape[-1] ** -0.5).mul_(w.unsqueeze(-1)).sum(dim=-2)


# --- where the keys are -------------------------------------------------------------------------------


@dataclass(frozen=True)
class PagedKeys:
    """One CSA layer's stored indexer keys for a batch of rows, where the store keeps them.

    Entry e of row r is the `codec.index_width`-element row at `pool[starts[r, e // per_block] + (e % per_block)
    * width]`: each block's keys are consecutive in the pool. The gather length is `blocks * per_block`; row r
    sees entries `[0, counts[r])` (what lies past them may be anything: it is never chosen).
    """

    pool: torch.Tensor
    """[elements] flat: packed MXFP4 bytes (`v4`) or key values (the codec's storage dtype)."""
    starts: torch.Tensor
    """[rows, blocks] int64: element offset of each block's first key."""
    counts: torch.Tensor
    """[rows] visible entries."""
    per_block: int
    codec: KVCodec

    @property
    def width(self) -> int:
        """Pool elements of one stored key."""
        return self.codec.index_width

    @property
    def num_entries(self) -> int:
        """The gather length: entries every row is scored over (those past its count masked)."""
        return self.starts.shape[1] * self.per_block

    def gather(self, first: int, span: int) -> torch.Tensor:
        """Stored keys `first .. first + span - 1` of every block: [rows, blocks * span, width], in entry order within
        each block. One copy of the stored elements: the pool is viewed as every run of `span` keys (overlapping,
        no copy) and each block's run is picked by its start."""
        run = span * self.width
        runs = self.pool.unfold(0, run, 1)  # [elements - run + 1, run], a view
        rows, blocks = self.starts.shape
        return runs[self.starts + first * self.width].view(rows, blocks * span, self.width)

    def dense(self) -> torch.Tensor:
        """Every stored key of every row, [rows, gather length, width] (for checks and the baseline of a bench)."""
        return self.gather(0, self.per_block)


def tile_span(per_block: int) -> int:
    """Entries of each block in one tile: `TILES` tiles, or one per entry when a block holds fewer."""
    return per_block // math.gcd(per_block, TILES)


def index_topk_ref(q: torch.Tensor, w: torch.Tensor, keys: PagedKeys, topk: int) -> torch.Tensor:
    """The decode indexer: q [rows, heads, dim] (in the keys' space: rotated and rounded as the codec rounds keys),
    w [rows, heads] fp32 -> ids [rows, min(topk, gather length)] int64, best first, -1 where a row sees fewer.

    Tiles as the module docstring says; each is decoded to fp32 (`KVCodec.unpack_index`), scored
    (`entry_scores`), masked past each row's count and merged into the running keys (`merge_keys`)."""
    rows, blocks = keys.starts.shape
    per = keys.per_block
    span = tile_span(per)
    n = blocks * per
    k = min(topk, n)
    dev = q.device
    local = torch.arange(n, device=dev).view(blocks, per)  # entry ids, block by block
    running = torch.full((rows, k), EMPTY_KEY, dtype=torch.int64, device=dev)
    for first in range(0, per, span):
        ids = local[:, first : first + span].flatten()  # [blocks * span]: the tile's entries
        vals = keys.codec.unpack_index(keys.gather(first, span), torch.float32)  # [rows, tile, dim]
        s = entry_scores(q, w, vals).masked_fill_(ids >= keys.counts[:, None], float("-inf"))  # [rows, tile]
        running = merge_keys(running, selection_keys(s, ids))
    return key_ids(running)
