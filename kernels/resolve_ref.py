"""Torch reference of the hot-buffer resolve (the CPU path, and the spec the Triton kernel must equal).

Per request and CSA layer the hot buffer has `lru` LRU-managed slots followed by `reserved` ring
slots that always hold the newest C4 entries (the store fills those when entries are emitted).
An *entry map* gives, for every C4 entry of a request, the hot slot holding it or -1; entries are
addressed by their *map row* (a row of the per-layer map tensor, derived from the block table),
and their host copy by a *host row* of the per-layer host pool.

Resolve, for one layer and the whole batch, given each request's selected entry ids:
1. hits: ids whose map row points at a slot; hits in the LRU part are stamped with `step`;
2. misses, taken in order of first appearance in the row (duplicates of a missing id resolve to the
   slot its first occurrence gets): each takes the LRU slot with the smallest (stamp, slot index)
   whose stamp is below `step` — never-used slots carry stamp -1, so they go first; the entry it held
   (if any) is evicted (its map row reset to -1); the host row is copied into the slot, which is
   stamped with `step` and recorded in `entry_row`;
3. the result is the slot of every id (-1 for -1 padding).
Counters (hits, misses, evictions) accumulate in a device tensor; nothing here needs a host sync
on CUDA except what the reference itself does.
"""

from __future__ import annotations

import torch

HITS, MISSES, EVICTIONS = 0, 1, 2


def resolve_ref(
    ids: torch.Tensor,
    map_rows: torch.Tensor,
    host_rows: torch.Tensor,
    state_slots: torch.Tensor,
    entry_map: torch.Tensor,
    hot_kv: torch.Tensor,
    hot_entry_row: torch.Tensor,
    hot_stamp: torch.Tensor,
    host_pool: torch.Tensor,
    step: int,
    counters: torch.Tensor,
) -> torch.Tensor:
    """Resolve selected entries to hot-buffer slots, copying misses in from the host pool.

    ids, map_rows, host_rows: [batch, k] int64 (ids -1 = padding; rows ignored there)
    state_slots: [batch] int64, which hot buffer (state slot) each batch row owns
    entry_map: [map_rows_total] int32, map row -> hot slot or -1 (updated in place)
    hot_kv: [state_slots_total, lru + reserved, dim]; hot_entry_row: [.., lru + reserved] int64;
    hot_stamp: [.., lru] int64 (all updated in place)
    host_pool: [host_rows_total, dim]; counters: [3] int64 (hits, misses, evictions), accumulated
    Returns slots [batch, k] int64.
    """
    batch, k = ids.shape
    lru = hot_stamp.shape[1]
    valid = ids >= 0
    rows = torch.where(valid, map_rows, 0)
    slot = torch.where(valid, entry_map[rows].long(), -1)
    hit = valid & (slot >= 0)

    # 1. stamp LRU hits
    bidx = state_slots[:, None].expand(batch, k)
    lru_hit = hit & (slot < lru)
    hot_stamp[bidx[lru_hit], slot[lru_hit]] = step

    # 2. misses: first occurrence of each missing id, ranked by position in the row
    miss = valid & ~hit
    sorted_ids, order = torch.sort(torch.where(miss, ids, -1), dim=1, stable=True)
    dup_sorted = torch.zeros_like(miss)
    dup_sorted[:, 1:] = (sorted_ids[:, 1:] == sorted_ids[:, :-1]) & (sorted_ids[:, 1:] >= 0)
    dup = torch.zeros_like(miss).scatter(1, order, dup_sorted)
    first = miss & ~dup
    rank = torch.cumsum(first.long(), dim=1) - 1

    stamps = hot_stamp[state_slots]  # [batch, lru]
    key = torch.where(stamps >= step, torch.iinfo(torch.int64).max, (stamps + 1) * lru + torch.arange(lru))
    victims_sorted = torch.argsort(key, dim=1)
    victim = victims_sorted.gather(1, rank.clamp(min=0))  # [batch, k], meaningful where `first`

    fb, fi = torch.nonzero(first, as_tuple=True)
    if fb.numel():
        sslot, vslot = state_slots[fb], victim[fb, fi]
        if bool((key[fb, vslot] == torch.iinfo(torch.int64).max).any()):
            raise RuntimeError("hot buffer smaller than the number of distinct selected entries")
        old = hot_entry_row[sslot, vslot]
        evicted = old >= 0
        entry_map[old[evicted]] = -1
        new_rows = map_rows[fb, fi]
        entry_map[new_rows] = vslot.to(entry_map.dtype)
        hot_entry_row[sslot, vslot] = new_rows
        hot_stamp[sslot, vslot] = step
        hot_kv[sslot, vslot] = host_pool[host_rows[fb, fi]].to(hot_kv.device, hot_kv.dtype)
        counters[EVICTIONS] += evicted.sum()
    counters[HITS] += hit.sum()
    counters[MISSES] += first.sum()

    # 3. every valid id now has a slot (duplicates of a miss share its slot)
    return torch.where(valid, entry_map[rows].long(), -1)
