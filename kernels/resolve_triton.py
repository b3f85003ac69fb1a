"""Triton hot-buffer resolve: the whole batch of one layer in one launch, parallel within each row.

Same contract as `kernels.resolve_ref.resolve_ref` (read its docstring for the policy); one program
per batch row and a grid fixed by the batch, so a decode step can be captured in a CUDA graph. `step`
is read from a device tensor, so a captured graph replays with whatever step the store has counted
up to. Lanes with nothing to write are masked off, so the kernel never touches the scratch locations
the reference writes to.

Where the bytes come from: on CUDA `host_pool` is the pool's device view (or a pinned CPU tensor)
and the kernel reads it through its pointer. With unified virtual addressing a pinned host allocation
has the same address on the device, so a miss is a zero-copy PCIe read of one row, with no staging
buffer and no extra launch. A pageable host pool has no device mapping and is refused before launch.
Under `TRITON_INTERPRET=1` every tensor is an ordinary CPU tensor.

Why it is built this way: a decode step resolves every CSA layer, and the serial form this replaces
(one id at a time, each miss a dependent chain ending in a PCIe read) was estimated at about 0.27 ms
a layer at V4's top-512, 6 ms a step (docs/kv-formats.md, "Resolve"; not measured). Here nothing
walks the ids; the program for batch row b:
1. loads its k ids and looks all their map rows up at once; LRU hits are stamped with `step`;
2. finds the first occurrence of each missing id: one sort of the missing ids tells whether any id
   repeats, and only then (rare: the indexer's top-k is distinct) a pairwise pass says which lanes
   repeat an earlier one; a cumulative sum over the first occurrences gives each its rank 0, 1, ...;
3. orders the free LRU slots by the reference's key `(stamp + 1) * lru + slot` with one sort (the key
   is unique per slot and decodes back to the slot), and miss of rank i takes the i-th of them;
4. resets the entries the victims held, then points the entry map, the slots' owners and stamps at
   the new entries, and reads every id's slot back from the map (the reference's order of updates);
5. copies the misses' rows in tiles of `COPY_ROWS` rows, so that many PCIe reads are in flight at
   once instead of one after the other. A row moves as whole machine words (8, 4 or 2 bytes) when the
   pool and the hot buffer share a dtype and the row's bytes allow it: a 584-byte v4 row is 73 words.
Counters are added atomically, so concurrent programs (and steps) accumulate without a sync.

A miss that finds no free LRU slot is counted but gets no slot (-1, as do its duplicates) and
evicts nothing, as in the reference; with `lru >= k` it cannot happen.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.resolve_ref import HotState, victim_count

INT64_MAX = tl.constexpr(0x7FFFFFFFFFFFFFFF)  # stands for 'not free' in the victim key
TILE = 8192
"""Elements one program holds at once in its two-dimensional passes (the copy tile, the duplicate check):
with NUM_WARPS warps that is 32 per thread, so a copy tile of 584-byte rows keeps 64 row reads in flight."""
NUM_WARPS = 8
WORDS = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


@triton.jit
def _bitonic_sort(x, offs, LOG_N: tl.constexpr):
    """`x` [2**LOG_N] in ascending order by a bitonic network, `offs` = arange(0, 2**LOG_N).

    Each compare-exchange fetches every lane's partner (lane ^ j) with one gather and keeps the smaller or
    the larger value; the blocks of 2**stage lanes alternate direction until the last stage sorts all up.
    Written out rather than taken from `tl.sort` because the library's sort is a deep tree of small helper
    functions, each of which the interpreter the tests run in re-enters at a cost of milliseconds."""
    for stage in tl.static_range(1, LOG_N + 1):
        up = ((offs >> stage) & 1) == 0  # [2**LOG_N], this lane's block sorts ascending
        for back in tl.static_range(stage):
            j: tl.constexpr = 1 << (stage - 1 - back)
            partner = tl.gather(x, offs ^ j, 0)  # [2**LOG_N]
            x = tl.where(((offs & j) == 0) == up, tl.minimum(x, partner), tl.maximum(x, partner))
    return x


@triton.jit
def _resolve_kernel(
    ids_ptr,
    map_rows_ptr,
    host_rows_ptr,
    books_ptr,
    hot_rows_ptr,
    entry_map_ptr,
    map_stride,
    hot_kv_ptr,
    entry_row_ptr,
    row_stride_s,
    row_stride_slot,
    stamp_ptr,
    stamp_stride_s,
    stamp_stride_slot,
    host_pool_ptr,
    host_stride_row,
    host_stride_w,
    slots_ptr,
    counters_ptr,
    step_ptr,
    k,
    lru,
    victims,
    width,
    BLOCK_K: tl.constexpr,
    LOG_K: tl.constexpr,
    BLOCK_LRU: tl.constexpr,
    LOG_LRU: tl.constexpr,
    DUP_ROWS: tl.constexpr,
    COPY_ROWS: tl.constexpr,
    BLOCK_W: tl.constexpr,
    CONVERT: tl.constexpr,
    WORD: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    step = tl.load(step_ptr).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    in_k = offs_k < k
    ids = tl.load(ids_ptr + b * k + offs_k, mask=in_k, other=-1)  # [BLOCK_K]
    valid = ids >= 0
    rows = tl.load(map_rows_ptr + b * k + offs_k, mask=valid, other=0)  # [BLOCK_K]
    slot = tl.load(entry_map_ptr + rows * map_stride, mask=valid, other=-1).to(tl.int64)  # [BLOCK_K]
    hit = valid & (slot >= 0)
    miss = valid & (slot < 0)

    book = tl.load(books_ptr + b)
    stamp_base = stamp_ptr + book * stamp_stride_s
    row_base = entry_row_ptr + book * row_stride_s

    # 1. Hits in the reserved ring are left alone: the store, not the LRU, owns those slots.
    lru_hit = hit & (slot < lru)
    tl.store(stamp_base + slot * stamp_stride_slot, tl.zeros([BLOCK_K], tl.int64) + step, mask=lru_hit)

    # 2. First occurrences, judged by id among the ids that missed (valid ids are >= 0, so -1 marks the rest).
    miss_ids = tl.where(miss, ids, -1)  # [BLOCK_K]
    sorted_ids = _bitonic_sort(miss_ids, offs_k, LOG_K)  # [BLOCK_K]
    before = tl.gather(sorted_ids, tl.maximum(offs_k - 1, 0), 0)  # [BLOCK_K], each sorted id's predecessor
    repeats = tl.sum(((offs_k > 0) & (sorted_ids >= 0) & (sorted_ids == before)).to(tl.int32))
    first = miss.to(tl.int32)  # [BLOCK_K]
    if repeats > 0:
        # Which lanes repeat an earlier missing id: DUP_ROWS earlier lanes against all lanes at a time.
        offs_d = tl.arange(0, DUP_ROWS)
        for c0 in range(0, BLOCK_K, DUP_ROWS):
            lane_c = c0 + offs_d  # [DUP_ROWS]
            ids_c = tl.gather(miss_ids, lane_c, 0)  # [DUP_ROWS]
            same = (ids_c[:, None] >= 0) & (ids_c[:, None] == ids[None, :]) & (lane_c[:, None] < offs_k[None, :])
            first = tl.where(tl.max(same.to(tl.int32), axis=0) > 0, 0, first)  # [DUP_ROWS, BLOCK_K] -> [BLOCK_K]
    number = tl.cumsum(first, 0)  # [BLOCK_K], 1, 2, ... over the first occurrences in row order

    # 3. Victims: the free LRU slots in key order. The search reads the stamps written in 1 by other threads.
    tl.debug_barrier()
    offs_l = tl.arange(0, BLOCK_LRU)
    stamps = tl.load(stamp_base + offs_l * stamp_stride_slot, mask=offs_l < victims, other=0)  # [BLOCK_LRU]
    free = (offs_l < victims) & (stamps < step)  # only the first `victims` LRU slots may be taken
    key = tl.where(free, (stamps + 1) * lru + offs_l, INT64_MAX)  # [BLOCK_LRU], unique per free slot
    free_slots = tl.sum(free.to(tl.int32))
    ordered = _bitonic_sort(key, offs_l, LOG_LRU)  # [BLOCK_LRU], the free slots' keys first
    by_rank = ((ordered % lru) + lru) % lru  # [BLOCK_LRU], the slot of each key (a floored remainder either way)
    placed = (first > 0) & (number <= free_slots)
    victim = tl.gather(by_rank, tl.minimum(tl.maximum(number - 1, 0), BLOCK_LRU - 1), 0)  # [BLOCK_K]
    victim = tl.where(placed, victim, -1)

    # 4. Bookkeeping. Every reset lands before the assignments, and those before the read-back.
    old = tl.load(row_base + victim * row_stride_slot, mask=placed, other=-1)  # [BLOCK_K], the entry each victim held
    evicted = placed & (old >= 0)
    tl.store(entry_map_ptr + old * map_stride, tl.full([BLOCK_K], -1, entry_map_ptr.dtype.element_ty), mask=evicted)
    tl.debug_barrier()
    tl.store(entry_map_ptr + rows * map_stride, victim.to(entry_map_ptr.dtype.element_ty), mask=placed)
    tl.store(row_base + victim * row_stride_slot, rows, mask=placed)
    tl.store(stamp_base + victim * stamp_stride_slot, tl.zeros([BLOCK_K], tl.int64) + step, mask=placed)
    tl.debug_barrier()
    out = tl.load(entry_map_ptr + rows * map_stride, mask=valid, other=-1).to(tl.int64)  # [BLOCK_K]
    tl.store(slots_ptr + b * k + offs_k, tl.where(valid, out, -1), mask=in_k)
    tl.atomic_add(counters_ptr + 0, tl.sum(hit.to(tl.int64)))
    tl.atomic_add(counters_ptr + 1, tl.sum(first.to(tl.int64)))
    tl.atomic_add(counters_ptr + 2, tl.sum(evicted.to(tl.int64)))

    # 5. The copy, COPY_ROWS placed misses at a time in rank order (the first `moves` ranks are the placed ones).
    if CONVERT:
        kv = hot_kv_ptr
        pool = host_pool_ptr
    else:
        kv = hot_kv_ptr.to(tl.pointer_type(WORD), bitcast=True)
        pool = host_pool_ptr.to(tl.pointer_type(WORD), bitcast=True)
    kv_base = kv + tl.load(hot_rows_ptr + b) * width  # slot s at kv_base + s * width
    moves = tl.sum(placed.to(tl.int32))
    host = tl.load(host_rows_ptr + b * k + offs_k, mask=placed, other=0)  # [BLOCK_K]
    offs_r = tl.arange(0, COPY_ROWS)
    offs_w = tl.arange(0, BLOCK_W)
    for r0 in range(0, moves, COPY_ROWS):
        rank = r0 + offs_r  # [COPY_ROWS]
        live = rank < moves
        # The lane of rank r is how many lanes still count <= r first misses (`number` never decreases):
        # a binary search, one gather per bit.
        lane = tl.zeros([COPY_ROWS], tl.int32)
        for i in tl.static_range(LOG_K):
            probe = lane + (1 << (LOG_K - 1 - i))  # [COPY_ROWS], at most BLOCK_K - 1 + 1
            lane = tl.where(tl.gather(number, probe - 1, 0) <= rank, probe, lane)
        src = tl.gather(host, lane, 0)  # [COPY_ROWS], host rows
        dst = tl.gather(victim, lane, 0)  # [COPY_ROWS], their slots
        for w0 in range(0, width, BLOCK_W):
            w = w0 + offs_w  # [BLOCK_W]
            m = live[:, None] & (w < width)[None, :]
            vals = tl.load(pool + src[:, None] * host_stride_row + w[None, :] * host_stride_w, mask=m)  # [COPY_ROWS, BLOCK_W]
            tl.store(kv_base + dst[:, None] * width + w[None, :], vals.to(kv.dtype.element_ty), mask=m)


def copy_word(kv_pool: torch.Tensor, host_pool: torch.Tensor) -> int | None:
    """Bytes per word the copy moves a row in, or None when the values must be converted (dtypes differ).

    The widest integer word (at most 8 bytes) that divides the row's bytes and the pool's row stride and on
    which both base addresses are aligned; otherwise the element itself. Decided per call from shapes and
    addresses alone (no sync): a v4 row of 584 bytes moves as 73 words of 8, a bf16 row of 512 as 128."""
    if kv_pool.dtype != host_pool.dtype:
        return None
    size = host_pool.element_size()
    dim = host_pool.shape[1]
    if host_pool.stride(1) != 1 and dim > 1:
        return size
    for word in (8, 4, 2):
        if word > size and (dim * size) % word == 0 and (host_pool.stride(0) * size) % word == 0 \
                and host_pool.data_ptr() % word == 0 and kv_pool.data_ptr() % word == 0:
            return word
    return size


def resolve_triton(
    ids: torch.Tensor,
    map_rows: torch.Tensor,
    host_rows: torch.Tensor,
    books: torch.Tensor,
    hot_rows: torch.Tensor,
    kv_pool: torch.Tensor,
    state: HotState,
    victim_slots: int | None = None,
) -> torch.Tensor:
    """Triton twin of `resolve_ref`: same arguments, same in-place updates, returns slots [batch, k] int64."""
    entry_map, hot_entry_row, hot_stamp, host_pool, step, counters = state
    batch, k = ids.shape
    lru = hot_stamp.shape[1]
    victims = victim_count(lru, victim_slots)
    dim = host_pool.shape[1]
    # (checked when not capturing: a CUDA graph capture allows no pointer queries)
    if kv_pool.is_cuda and not host_pool.is_cuda and not torch.cuda.is_current_stream_capturing() and not host_pool.is_pinned():
        raise ValueError("host_pool must be pinned (or on the device) for the kernel to read it through UVA")
    if counters.stride(0) != 1 or kv_pool.dim() != 1 or kv_pool.stride(0) != 1:
        raise ValueError("counters and kv_pool must be contiguous, kv_pool one-dimensional")
    slots = torch.empty((batch, k), dtype=torch.int64, device=ids.device)  # [batch, k]
    if batch == 0 or k == 0:
        return slots
    # The id tensors are small and read-only; the in-place state goes by strides so views work.
    ids = ids.contiguous()
    map_rows = map_rows.contiguous()
    host_rows = host_rows.contiguous()
    books = books.contiguous()
    hot_rows = hot_rows.contiguous()
    word = copy_word(kv_pool, host_pool)
    per_word = (word or host_pool.element_size()) // host_pool.element_size()  # elements per word
    width = dim // per_word  # words (or, converting, elements) per row
    host_strides = host_pool.stride() if per_word == 1 else (host_pool.stride(0) // per_word, 1)
    block_k, block_lru = triton.next_power_of_2(k), triton.next_power_of_2(victims)
    block_w = min(triton.next_power_of_2(width), 256)
    _resolve_kernel[(batch,)](
        ids,
        map_rows,
        host_rows,
        books,
        hot_rows,
        entry_map,
        entry_map.stride(0),
        kv_pool,
        hot_entry_row,
        *hot_entry_row.stride(),
        hot_stamp,
        *hot_stamp.stride(),
        host_pool,
        *host_strides,
        slots,
        counters,
        step,
        k,
        lru,
        victims,
        width,
        BLOCK_K=block_k,
        LOG_K=block_k.bit_length() - 1,
        BLOCK_LRU=block_lru,
        LOG_LRU=block_lru.bit_length() - 1,
        DUP_ROWS=max(1, min(block_k, TILE // block_k)),
        COPY_ROWS=max(1, min(block_k, TILE // block_w)),
        BLOCK_W=block_w,
        CONVERT=word is None,
        WORD=WORDS[word or host_pool.element_size()],
        num_warps=NUM_WARPS,
    )
    return slots
