"""Torch reference of the hot-buffer resolve (the CPU path, and the spec the Triton kernel must equal).

Per request and CSA layer the hot buffer has `lru` LRU-managed slots followed by `reserved` ring
slots that always hold the newest C4 entries (the store fills those when entries are emitted).
An *entry map* gives, for every C4 entry of a request, the hot slot holding it or -1; entries are
addressed by their *map row* (an element of the layer's map, derived from the block table), and
their host copy by a *host row* of the layer's host pool. A request's LRU bookkeeping (which map
row each slot holds, when each LRU slot was last used) is row `book` of `hot_entry_row` /
`hot_stamp`; its slot s holds its vector in row `hot_row + s` of `kv_pool`.

Resolve, for one layer and the whole batch, given each request's selected entry ids:
1. hits: ids whose map row points at a slot; hits in the LRU part are stamped with `step`;
2. misses, taken in order of first appearance in the row (duplicates of a missing id resolve to the
   slot its first occurrence gets): each takes the LRU slot with the smallest (stamp, slot index)
   whose stamp is below `step` — never-used slots carry stamp -1, so they go first; the entry it held
   (if any) is evicted (its map row reset to -1); the host row is copied into the slot, which is
   stamped with `step` and recorded in `hot_entry_row`. A miss that finds no free slot (only
   possible when `lru` < distinct ids of a row) is counted but gets no slot (-1, as do its
   duplicates) and evicts nothing. `victim_slots` limits the search to the first that many LRU slots (hits
   anywhere are still hits and stamped): a step that selects fewer entries than the buffer holds (a plain step
   over a buffer sized for speculative ones, `Geometry.plain_lru`) searches only as many as it could need;
3. the result is the slot of every id (-1 for -1 padding).

Static shapes, no host synchronisation, no data-dependent branch: every lane of [batch, k] does the
same work and a lane with nothing to write writes to a *scratch* location instead. The caller
provides those: the last element of `entry_map`, the last row of `hot_entry_row` / `hot_stamp` and
the last `dim`-wide row of `kv_pool` belong to nobody. Every in-place tensor is updated with one
`index_put_` on the tensor itself (never through a narrower view), so under `torch.compile` the
updates happen in place rather than on a copy. Counters (hits, misses, evictions) accumulate in a
device tensor, and `step` is a device tensor too, so a captured step replays correctly.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

HITS, MISSES, EVICTIONS = 0, 1, 2
NOT_FREE = torch.iinfo(torch.int64).max  # victim key of a slot that may not be taken this step


class HotState(NamedTuple):
    """One CSA layer's hot-buffer bookkeeping as resolve reads and updates it (its owner is
    `cachetier.hot_tier.HotTier`; see the module docstring for each part)."""

    entry_map: torch.Tensor
    hot_entry_row: torch.Tensor
    hot_stamp: torch.Tensor
    host_pool: torch.Tensor
    step: torch.Tensor
    counters: torch.Tensor


def victim_count(lru: int, victim_slots: int | None) -> int:
    """The LRU slots a resolve searches for victims: `victim_slots` of the `lru` (None: all)."""
    if victim_slots is None:
        return lru
    if not 1 <= victim_slots <= lru:
        raise ValueError(f"victim_slots ({victim_slots}) must be in 1..{lru}, the hot buffer's LRU slots")
    return victim_slots


def resolve_ref(
    ids: torch.Tensor,
    map_rows: torch.Tensor,
    host_rows: torch.Tensor,
    books: torch.Tensor,
    hot_rows: torch.Tensor,
    kv_pool: torch.Tensor,
    state: HotState,
    victim_slots: int | None = None,
) -> torch.Tensor:
    """Resolve selected entries to hot-buffer slots, copying misses in from the host pool.

    ids, map_rows, host_rows: [batch, k] int64 (ids -1 = padding; rows ignored there)
    books: [batch] int64, the row of `hot_entry_row` / `hot_stamp` of each batch row's hot buffer
    hot_rows: [batch] int64, the row of `kv_pool` (as rows of `dim`) holding each hot buffer's slot 0
    entry_map: [map_rows_total] int32, map row -> hot slot or -1 (updated in place)
    kv_pool: 1-D, rows of `dim` = host_pool.shape[1] (updated in place)
    hot_entry_row: [books, lru + reserved] int64; hot_stamp: [books, lru] int64 (updated in place)
    host_pool: [host_rows_total, dim], read only; step: 0-d int64; counters: [3] int64, accumulated
    victim_slots: how many leading LRU slots a miss may take (None: all of them)
    Returns slots [batch, k] int64.
    """
    entry_map, hot_entry_row, hot_stamp, host_pool, step, counters = state
    batch, k = ids.shape
    lru = hot_stamp.shape[1]
    pick = victim_count(lru, victim_slots)
    dim = host_pool.shape[1]
    map_dump = entry_map.shape[0] - 1
    book_dump = hot_entry_row.shape[0] - 1
    kv_dump = kv_pool.shape[0] // dim - 1
    step = step.to(torch.int64)
    books_k = books[:, None].expand(batch, k)  # [batch, k]

    valid = ids >= 0
    rows = torch.where(valid, map_rows, map_dump)  # [batch, k]
    slot = torch.where(valid, entry_map[rows].long(), -1)
    hit = valid & (slot >= 0)

    # 1. stamp LRU hits; ring hits are the store's, not the LRU's
    lru_hit = hit & (slot < lru)
    hot_stamp.index_put_(
        (torch.where(lru_hit, books_k, book_dump), torch.where(lru_hit, slot, 0)), step.expand(batch, k)
    )

    # 2. misses: first occurrence of each missing id, ranked by position in the row
    miss = valid & ~hit
    sorted_ids, order = torch.sort(torch.where(miss, ids, -1), dim=1, stable=True)
    same = (sorted_ids[:, 1:] == sorted_ids[:, :-1]) & (sorted_ids[:, 1:] >= 0)  # [batch, k-1]
    dup_sorted = torch.cat((torch.zeros_like(miss[:, :1]), same), dim=1)
    dup = torch.zeros_like(miss).scatter(1, order, dup_sorted)
    first = miss & ~dup
    number = torch.cumsum(first.long(), dim=1)  # [batch, k]: 1, 2, ... for the first misses in row order
    rank = (number - 1).clamp(0, pick - 1)

    stamps = hot_stamp[books, :pick]  # [batch, pick], this step's hits included
    key = torch.where(stamps >= step, NOT_FREE, (stamps + 1) * lru + torch.arange(pick, device=stamps.device))
    # the min(k, pick) smallest keys in order: ranks never reach past them (keys are unique per slot, so
    # the order is total)
    key_sorted, victims_sorted = torch.topk(key, min(k, pick), dim=1, largest=False)
    victim = victims_sorted.gather(1, rank)  # [batch, k]
    served = number <= pick
    placed = first & served & (key_sorted.gather(1, rank) < NOT_FREE)

    old = hot_entry_row[books_k, victim]  # [batch, k], the entry each victim slot held
    evicted = placed & (old >= 0)
    # Counted before the writes below: a value read before an update and used after it would make
    # torch.compile copy the updated tensor to keep the old one.
    counters.add_(torch.stack((hit.sum(), first.sum(), evicted.sum())).to(counters.dtype))
    # Resets before assignments: with stale bookkeeping an evicted row may also be one placed now.
    entry_map.index_put_((torch.where(evicted, old, map_dump),), torch.full_like(rows, -1, dtype=entry_map.dtype))
    entry_map.index_put_((torch.where(placed, rows, map_dump),), victim.to(entry_map.dtype))
    # `placed | evicted` is `placed` (evicted lanes are placed ones), but it makes these writes depend on
    # the read of `old` above: otherwise torch.compile may order the write first and then copy the whole
    # table (every request's row) to keep the values `old` must see, on every step.
    written = placed | evicted
    book_or_dump = torch.where(written, books_k, book_dump)
    slot_or_0 = torch.where(written, victim, 0)
    hot_entry_row.index_put_((book_or_dump, slot_or_0), rows)
    hot_stamp.index_put_((book_or_dump, slot_or_0), step.expand(batch, k))
    # copy every lane's host row (static shape); only placed lanes land in a real slot
    dst = torch.where(placed, hot_rows[:, None] + victim, kv_dump)  # [batch, k]
    # A decode step passes the pool's device view (`cachetier.host_pool.HostPool.on`): the gather is then device
    # work on mapped memory. Given the host pool itself (tests, tools) it reads there and copies back (a sync).
    values = host_pool[host_rows.clamp(min=0).to(host_pool.device)].to(kv_pool.device, kv_pool.dtype)  # [batch, k, dim]
    kv_pool.index_put_((dst[..., None] * dim + torch.arange(dim, device=dst.device),), values)

    # 3. every valid id now has a slot (duplicates of a miss share its slot), or -1 if none was free
    return torch.where(valid, entry_map[rows].long(), -1)
