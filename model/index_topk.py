"""The indexer's top-k selection: one rule, computed untiled (one score matrix) or tiled (running top-k).

The rule: a query selects the `k = min(index_topk, entries)` visible entries with the highest
scores; among equal scores the lower entry id wins; too few visible entries leave -1 at the end.
Ties are not rare (a score is a weighted sum of ReLUs, so whole groups of entries score exactly 0),
and torch's own `topk` breaks them arbitrarily, so the rule is made total by ranking *keys*: the
score's bits made order-preserving in the high 32 bits and `0xFFFFFFFF - id` in the low 32 bits of
one int64. Distinct keys have one top-k, whichever way it is computed. The keys are made in
`kernels.index_topk_ref`, where the decode step's indexer (stored keys in, ids out) applies the same
rule; this module ranks scores a caller has already computed (prefill, training, checks).

`tiled_topk` scores the entries a tile at a time and keeps each query's best k keys, so its transient
memory is queries x tile whatever the context. Tiles go newest first (recent entries score high, so
the k-th best rises early). On the CPU only the scores that can still enter — at least the running
k-th best — become keys and get ranked; finding them costs one max per group of entries, so the
cost is the scoring, not the ranking. On CUDA every tile is merged with one `topk` over
[running | tile], which needs no host synchronisation, and so does a compiled (traced) step, which
must have no data-dependent shapes. All give the untiled result exactly, provided
an entry's score does not depend on the tile it is scored in (see `model.layers.Indexer.scores`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.index_topk_ref import EMPTY_KEY, key_ids, key_scores, merge_keys, selection_keys

GROUP = 64
"""Entries whose best score is compared with a query's k-th best at once, on the CPU path."""


SMALL = 256
"""Up to this many entries the untiled rule ranks keys directly (fewer ops); above it, and on the CPU,
only the candidates at or above each query's k-th best score become keys (int64 top-k is slow there)."""


def topk_keys(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    """The untiled rule: scores and visibility [..., n] -> ids [..., min(topk, n)], best first, -1 padded."""
    n = scores.shape[-1]
    k = min(topk, n)
    masked = scores.masked_fill(~visible, float("-inf")).reshape(-1, n)  # [rows, n]
    if torch.compiler.is_compiling() or masked.is_cuda or n <= SMALL:  # traced: no data-dependent shape, no guard on n
        keys = selection_keys(masked, torch.arange(n, device=scores.device)).topk(k, dim=-1).values
    else:
        empty = torch.full((masked.shape[0], k), EMPTY_KEY, dtype=torch.int64, device=scores.device)
        keys = _merge_survivors(empty, masked, 0)
    return key_ids(keys).view(*scores.shape[:-1], k)


def _merge_survivors(running: torch.Tensor, scores: torch.Tensor, first_id: int, tighten: bool = True) -> torch.Tensor:
    """Like `merge_keys` for a tile's scores [q, t] (any tile order), but only the scores that can
    enter the top k are turned into keys and ranked, and only the queries with such scores re-ranked.

    A score can enter only if it is at least the query's current k-th best and (with `tighten`,
    which pays while the running k-th best is still low) at least the tile's own k-th best; masked
    scores (-inf) never enter. Usually few pass, so they are found group by group (`GROUP` entries):
    one max reads the tile. When many pass, the whole tile is merged as keys instead, which bounds
    the bookkeeping per score.
    """
    q, t = scores.shape
    k = running.shape[1]
    thr = key_scores(running[:, -1])  # [q]
    if tighten:  # the tile's own k-th best: -inf where fewer than k are visible
        thr = torch.maximum(scores.topk(min(k, t), dim=1, sorted=False).values.amin(dim=1), thr)
    thr = thr[:, None]  # [q, 1]
    groups = _pad(scores, -(-t // GROUP) * GROUP).view(q, -1, GROUP)  # [q, groups, GROUP]
    gmax = groups.amax(dim=-1)
    gr, gg = ((gmax >= thr) & (gmax > float("-inf"))).nonzero(as_tuple=True)  # groups holding a candidate
    if gr.numel() == 0:
        return running
    vals = groups[gr, gg]  # [hit groups, GROUP]
    i, j = ((vals >= thr[gr]) & (vals > float("-inf"))).nonzero(as_tuple=True)
    if i.numel() > scores.numel() // 4:  # bookkeeping per candidate would exceed the keys of the whole tile
        return merge_keys(running, selection_keys(scores, torch.arange(first_id, first_id + t, device=scores.device)))
    r, c = gr[i], gg[i] * GROUP + j  # row-major: grouped by query
    keys = selection_keys(vals[i, j], c + first_id)  # [survivors]
    rows, row_of, per_row = torch.unique_consecutive(r, return_inverse=True, return_counts=True)
    slot = torch.arange(r.numel(), device=r.device) - (per_row.cumsum(0) - per_row)[row_of]  # rank within its row
    buf = torch.full((rows.numel(), k + int(per_row.max())), EMPTY_KEY, dtype=torch.int64, device=running.device)
    buf[:, :k] = running[rows]
    buf[row_of, k + slot] = keys
    running = running.clone()
    running[rows] = buf.topk(k, dim=1).values
    return running


def _pad(scores: torch.Tensor, width: int) -> torch.Tensor:
    """Scores [q, t] widened to `width` columns with -inf (scores that never enter)."""
    extra = width - scores.shape[1]
    return torch.cat((scores, scores.new_full((scores.shape[0], extra), float("-inf"))), dim=1) if extra else scores


ScoreFn = Callable[[slice, int, int], torch.Tensor]
"""score(query rows, first entry, end entry) -> scores [rows, end - first] (float32)."""


def tiled_topk(
    score: ScoreFn, counts: torch.Tensor, topk: int, tile: int, device: torch.device | str = "cpu",
    score_block: int | None = None, exhaustive: bool | None = None,
) -> torch.Tensor:
    """The rule of `topk_keys` for queries whose visible entries are a prefix `[0, counts[i])`.

    counts [queries] (a CPU tensor, so reading bounds costs no device sync) must be non-decreasing
    (queries in position order). Entries are scored `tile` at a time through `score`, in calls of
    `score_block` queries (default all; smaller keeps a call's intermediates in cache on a CPU).
    Returns ids [queries, min(topk, counts[-1])] on `device`, equal to `topk_keys` over the full
    score matrix. `exhaustive` merges every tile with one top-k (default: on CUDA only).
    """
    n_q = counts.shape[0]
    n = int(counts[-1]) if n_q else 0
    k = min(topk, n)
    if k == 0:
        return torch.full((n_q, k), -1, dtype=torch.long, device=device)
    if exhaustive is None:
        exhaustive = torch.device(device).type == "cuda"
    counts_dev = counts.to(device)
    running = torch.full((n_q, k), EMPTY_KEY, dtype=torch.int64, device=device)
    sub = score_block or n_q
    buf = torch.empty(n_q, min(tile, n), device=device)  # one tile of scores, reused
    # Newest entries first: attention (and so a trained indexer) favours recent entries, so the
    # running k-th best rises early and the older tiles have few candidates.
    for step, t0 in enumerate(reversed(range(0, n, tile))):
        t1 = min(t0 + tile, n)
        a = int(torch.searchsorted(counts, t0, right=True))  # queries before `a` see nothing of this tile
        s = buf[a:, : t1 - t0]  # [queries a.., t]
        for r in range(a, n_q, sub):
            s[r - a : r - a + sub] = score(slice(r, min(r + sub, n_q)), t0, t1)
        ids = torch.arange(t0, t1, device=device)
        if t1 > int(counts[a]):  # some queries see only part of this tile
            s.masked_fill_(ids[None, :] >= counts_dev[a:, None], float("-inf"))
        if exhaustive:
            running[a:] = merge_keys(running[a:], selection_keys(s, ids))
        else:
            running[a:] = _merge_survivors(running[a:], s, t0, tighten=step < 2)
    return key_ids(running)
