"""Triton hot-buffer resolve: the whole batch of one layer in one launch, with no host synchronisation.

Same contract as `kernels.resolve_ref.resolve_ref` (read its docstring for the policy); one program
per batch row, so a decode step can be captured in a CUDA graph. `step` is read from a device
tensor, so a captured graph replays with whatever step the store has counted up to. Lanes with
nothing to write are masked off, so the kernel never touches the scratch locations the reference
writes to.

Where the bytes come from: on CUDA `host_pool` stays a *pinned* CPU tensor and the kernel reads it
through its pointer. With unified virtual addressing a pinned host allocation has the same address
on the device, so a miss is a zero-copy PCIe read of one `dim`-wide row, with no staging buffer and
no extra launch. A pageable host pool has no device mapping and is refused before launch. Under
`TRITON_INTERPRET=1` every tensor is an ordinary CPU tensor.

The program for batch row b:
1. loads its k ids, looks each map row up in `entry_map` (vectorised) and stamps the LRU hits;
2. walks the k ids in order; each first occurrence of a missing id takes the free LRU slot with the
   smallest key `(stamp + 1) * lru + slot` (slots stamped `step` are not free), evicts the entry the
   slot held, copies the host row in, and stamps the slot;
3. points the entry map at the new slots and reads every id's slot back from it.
Counters are added atomically, so concurrent programs (and steps) accumulate without a sync.

A miss that finds no free LRU slot is counted but gets no slot (-1, as do its duplicates) and
evicts nothing, as in the reference; with `lru >= k` it cannot happen.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

INT64_MAX = tl.constexpr(0x7FFFFFFFFFFFFFFF)  # stands for 'not a candidate' in the victim key


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
    host_stride_d,
    slots_ptr,
    counters_ptr,
    step_ptr,
    k,
    lru,
    dim,
    BLOCK_K: tl.constexpr,
    BLOCK_LRU: tl.constexpr,
    BLOCK_D: tl.constexpr,
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
    kv_base = hot_kv_ptr + tl.load(hot_rows_ptr + b) * dim  # slot s at kv_base + s * dim

    # Phase 1. Hits in the reserved ring are left alone: the store, not the LRU, owns those slots.
    lru_hit = hit & (slot < lru)
    tl.store(stamp_base + slot * stamp_stride_slot, tl.zeros([BLOCK_K], tl.int64) + step, mask=lru_hit)
    # The victim search reads those stamps back; other threads of this program may have written them.
    tl.debug_barrier()

    offs_l = tl.arange(0, BLOCK_LRU)
    in_l = offs_l < lru
    stamps = tl.load(stamp_base + offs_l * stamp_stride_slot, mask=in_l, other=0)  # [BLOCK_LRU]
    owners = tl.load(row_base + offs_l * row_stride_slot, mask=in_l, other=-1)  # [BLOCK_LRU]
    # Kept in registers from here on, so the loop never reads memory that it writes.
    busy = (stamps >= step) | (offs_l >= lru)  # [BLOCK_LRU]
    order_key = (stamps + 1) * lru + offs_l  # [BLOCK_LRU], unique per slot
    victims = tl.full([BLOCK_K], -1, tl.int64)  # [BLOCK_K], slot given to each first miss
    first = tl.zeros([BLOCK_K], tl.int32)  # [BLOCK_K], 1 where an id is the first occurrence of a miss
    evicted = tl.zeros([BLOCK_K], tl.int32)  # [BLOCK_K], 1 where that miss pushed an entry out
    offs_d = tl.arange(0, BLOCK_D)

    # Phase 2. Sequential: each victim depends on the ones chosen before it.
    for j in range(0, k):
        at_j = offs_k == j
        id_j = tl.sum(tl.where(at_j, ids, 0))
        miss_j = tl.sum(tl.where(at_j, miss.to(tl.int32), 0)) > 0
        # A duplicate is judged by id among the ids that missed in phase 1, as the reference does.
        seen = tl.sum(tl.where((offs_k < j) & miss & (ids == id_j), 1, 0))
        is_first = miss_j & (seen == 0)
        key = tl.where(busy, INT64_MAX, order_key)  # [BLOCK_LRU]
        best = tl.min(key, axis=0)
        v = tl.argmin(key, axis=0).to(tl.int64)
        first = tl.where(at_j & is_first, 1, first)
        if is_first & (best < INT64_MAX):
            at_v = offs_l == v
            old = tl.sum(tl.where(at_v, owners, 0))
            # Resets go out now and assignments after the loop, the order the reference uses.
            tl.store(entry_map_ptr + old * map_stride, -1, mask=old >= 0)
            evicted = tl.where(at_j & (old >= 0), 1, evicted)
            row_j = tl.load(map_rows_ptr + b * k + j)
            host_j = tl.load(host_rows_ptr + b * k + j)
            tl.store(row_base + v * row_stride_slot, row_j)
            tl.store(stamp_base + v * stamp_stride_slot, step)
            owners = tl.where(at_v, row_j, owners)
            busy = busy | at_v
            victims = tl.where(at_j, v, victims)
            for d0 in range(0, dim, BLOCK_D):
                in_d = d0 + offs_d < dim
                vals = tl.load(host_pool_ptr + host_j * host_stride_row + (d0 + offs_d) * host_stride_d, mask=in_d)  # [BLOCK_D]
                tl.store(
                    kv_base + v * dim + d0 + offs_d,
                    vals.to(hot_kv_ptr.dtype.element_ty),
                    mask=in_d,
                )

    # Phase 3. Every reset must land before the assignments, and those before the read-back.
    tl.debug_barrier()
    placed = victims >= 0
    tl.store(entry_map_ptr + rows * map_stride, victims.to(entry_map_ptr.dtype.element_ty), mask=placed)
    tl.debug_barrier()
    out = tl.load(entry_map_ptr + rows * map_stride, mask=valid, other=-1).to(tl.int64)  # [BLOCK_K]
    tl.store(slots_ptr + b * k + offs_k, tl.where(valid, out, -1), mask=in_k)

    tl.atomic_add(counters_ptr + 0, tl.sum(hit.to(tl.int64)))
    tl.atomic_add(counters_ptr + 1, tl.sum(first.to(tl.int64)))
    tl.atomic_add(counters_ptr + 2, tl.sum(evicted.to(tl.int64)))


def resolve_triton(
    ids: torch.Tensor,
    map_rows: torch.Tensor,
    host_rows: torch.Tensor,
    books: torch.Tensor,
    hot_rows: torch.Tensor,
    entry_map: torch.Tensor,
    kv_pool: torch.Tensor,
    hot_entry_row: torch.Tensor,
    hot_stamp: torch.Tensor,
    host_pool: torch.Tensor,
    step: torch.Tensor,
    counters: torch.Tensor,
) -> torch.Tensor:
    """Triton twin of `resolve_ref`: same arguments, same in-place updates, returns slots [batch, k] int64."""
    batch, k = ids.shape
    lru = hot_stamp.shape[1]
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
    block_d = min(triton.next_power_of_2(dim), 256)
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
        *host_pool.stride(),
        slots,
        counters,
        step,
        k,
        lru,
        dim,
        BLOCK_K=triton.next_power_of_2(k),
        BLOCK_LRU=triton.next_power_of_2(lru),
        BLOCK_D=block_d,
    )
    return slots
