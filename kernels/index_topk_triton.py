"""Triton decode indexer: stored keys in, each row's top-k entry ids out, one launch (two with a split).

Same contract as `kernels.index_topk_ref.index_topk_ref`. A program takes one row and one split (a
contiguous slice of its entries, never past the row's count, so a short row in a long bucket reads only its
own keys). It walks the slice a chunk at a time; a chunk is `CHUNK // BLOCK_N` blocks of `BLOCK_N` entries:
- the entries' keys are gathered through the row's block starts (a page holds a block's keys consecutively)
  and MXFP4 is decoded in registers with integer arithmetic (e2m1 as a count of halves, times a power of two
  built from the UE8M0 byte's bits), which is exact, so the kernel scores the values the reference decodes;
- all heads score the block in one dot, q [heads, dim] x keys^T: bf16 on tensor cores when the values are
  bf16 exactly (bf16 queries, or MXFP4-rounded keys and queries, whose values have two significant bits), an
  IEEE fp32 dot otherwise; then ReLU, times 1/sqrt(dim), times the head weight, summed over heads;
- each score and its id become the reference's int64 selection key (order-preserving score bits high,
  `0xFFFFFFFF - id` low; masked lanes the empty key), placed in the chunk's row of keys.
The chunk's best K (`tl.topk`, a bitonic top-k) merge into the program's running best K: the elementwise
maximum of the running keys (descending) and the chunk's (ascending) holds exactly the best K of both as a
bitonic sequence, and one bitonic merge sorts it. A chunk whose best key does not beat the running K-th is
skipped. With one split the program writes the ids; otherwise it writes its K keys and a merge program per
row folds the splits' keys the same way and writes the ids. Only those winners leave the chip.

The score's float arithmetic is the reference's up to summation order (tensor-core or tree sums against
torch's): equal keys score equally in either, so ties go to the lower id in both; scores a rounding apart
may rank differently. Grid and block sizes come from shapes and the SM count only, so a captured step has
one launch per bucket and every bound inside is read on the device.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kernels.index_topk_ref import EMPTY_KEY, LOW, NEG_INF_ORD, PagedKeys

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_EMPTY = tl.constexpr(EMPTY_KEY)
_LOW = tl.constexpr(LOW)
_NEG_INF = tl.constexpr(NEG_INF_ORD)

BLOCK_N = 64
"""Entries scored per dot: keys [64, 128] and scores [64 heads, 64] in registers at V4's dimensions."""
MIN_SPLIT = 2048
"""Fewest entries a split is given: below it the merge costs more than the parallelism buys."""
MAX_SPLITS = 64


@triton.jit
def _load_keys(pool_ptr, starts_ptr, n_blocks, r, e, ok, offs_d, in_d,
               PER: tl.constexpr, WIDTH: tl.constexpr, DIM: tl.constexpr, PACKED: tl.constexpr):
    """Keys of entries e [BLOCK_N] of row r -> fp32 [BLOCK_N, BLOCK_D], 0 where masked."""
    block = tl.load(starts_ptr + r * n_blocks + e // PER, mask=ok, other=0)  # element offset of the block's first key
    base = block + (e % PER).to(tl.int64) * WIDTH  # [BLOCK_N]
    live = ok[:, None] & in_d[None, :]
    if PACKED:
        byte = tl.load(pool_ptr + base[:, None] + (offs_d // 2)[None, :], mask=live, other=0).to(tl.int32)
        code = (byte >> ((offs_d & 1) * 4)[None, :]) & 15  # even channel in the low nibble
        mag = code & 7
        ex = mag >> 1
        halves = tl.where(ex == 0, mag & 1, (2 + (mag & 1)) << tl.maximum(ex - 1, 0))  # |value| * 2
        val = halves.to(tl.float32) * 0.5
        val = tl.where(code >= 8, -val, val)
        sbyte = tl.load(pool_ptr + base[:, None] + (DIM // 2 + offs_d // 32)[None, :], mask=live, other=127).to(tl.int32)
        # 2**(b - 127): the byte is the fp32 exponent field (b = 0 is the subnormal 2**-127, bits 0x00400000)
        scale = tl.where(sbyte == 0, 0x00400000, sbyte << 23).to(tl.float32, bitcast=True)
        return val * scale
    else:
        return tl.load(pool_ptr + base[:, None] + offs_d[None, :], mask=live, other=0.0).to(tl.float32)


@triton.jit
def _dot(a, b, BF16: tl.constexpr, INTERPRETED: tl.constexpr):
    """a @ b with an fp32 result: bf16 operands on tensor cores, or an IEEE fp32 dot (the interpreter rounds
    the operands to bf16 and multiplies them in fp32, which is what the tensor cores do with them)."""
    if BF16 and not INTERPRETED:
        out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), out_dtype=tl.float32)
    elif BF16:
        out = tl.dot(a.to(tl.bfloat16).to(tl.float32), b.to(tl.bfloat16).to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return out


@triton.jit
def _selection_keys(score, e):
    """Scores and entry ids [BLOCK_N] -> the reference's int64 keys (`selection_keys`)."""
    score = tl.where(score == 0.0, 0.0, score)  # -0.0 and +0.0 are one score
    bits = score.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (ordered.to(tl.int64) << 32) | (_LOW - e.to(tl.int64))


@triton.jit
def _merge(best, top_ascending):
    """Running best keys [K] (descending) and K more (ascending) -> the best K of both, descending."""
    return tl.bitonic_merge(tl.maximum(best, top_ascending), descending=True)


@triton.jit
def _store_ids(out_ptr, r, best, offs_k, k):
    """The first k of a row's sorted keys as entry ids, -1 for the empty ones."""
    ids = tl.where((best >> 32) == _NEG_INF, -1, _LOW - (best & _LOW))
    tl.store(out_ptr + r * k + offs_k, ids, mask=offs_k < k)


@triton.jit
def _index_topk_kernel(
    q_ptr, q_stride_r, q_stride_h, q_stride_d, w_ptr, w_stride_r, w_stride_h,
    pool_ptr, starts_ptr, counts_ptr, n_blocks, out_ptr, part_ptr,
    heads, k, split_len, splits, scale,
    PER: tl.constexpr, WIDTH: tl.constexpr, DIM: tl.constexpr, PACKED: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, K: tl.constexpr,
    BF16: tl.constexpr, SPLIT: tl.constexpr, INTERPRETED: tl.constexpr,
):
    s_id = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, K)
    in_h, in_d = offs_h < heads, offs_d < DIM
    q = tl.load(q_ptr + r * q_stride_r + offs_h[:, None] * q_stride_h + offs_d[None, :] * q_stride_d,
                mask=in_h[:, None] & in_d[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    w = tl.load(w_ptr + r * w_stride_r + offs_h * w_stride_h, mask=in_h, other=0.0).to(tl.float32)  # padded heads weigh 0
    count = tl.load(counts_ptr + r)
    lo = s_id.to(tl.int64) * split_len
    hi = tl.minimum(lo + split_len, count)
    ROWS: tl.constexpr = CHUNK // BLOCK_N
    slot = tl.arange(0, ROWS)
    best = tl.full([K], _EMPTY, tl.int64)
    for c0 in range(lo, hi, CHUNK):
        chunk = tl.full([ROWS, BLOCK_N], _EMPTY, tl.int64)
        for i in range(ROWS):
            e = c0 + i * BLOCK_N + offs_n  # [BLOCK_N]
            ok = e < hi
            keys = _load_keys(pool_ptr, starts_ptr, n_blocks, r, e, ok, offs_d, in_d, PER, WIDTH, DIM, PACKED)
            s = _dot(q, tl.trans(keys), BF16, INTERPRETED)  # [BLOCK_H, BLOCK_N]
            s = tl.maximum(s, 0.0) * scale * w[:, None]
            key = tl.where(ok, _selection_keys(tl.sum(s, axis=0), e), _EMPTY)  # [BLOCK_N]
            chunk = tl.where((slot == i)[:, None], key[None, :], chunk)
        flat = tl.reshape(chunk, [CHUNK])  # [CHUNK]
        if tl.max(flat, axis=0) > tl.min(best, axis=0):  # something in the chunk beats the running K-th best
            best = _merge(best, tl.flip(tl.topk(flat, K)))
    if SPLIT:
        tl.store(part_ptr + (r * splits + s_id) * K + offs_k, best)
    else:
        _store_ids(out_ptr, r, best, offs_k, k)


@triton.jit
def _merge_splits_kernel(part_ptr, out_ptr, k, splits, K: tl.constexpr):
    """One row: fold its splits' sorted keys into the best K and write the first k ids."""
    r = tl.program_id(0).to(tl.int64)
    offs_k = tl.arange(0, K)
    best = tl.full([K], _EMPTY, tl.int64)
    for s in range(splits):
        best = _merge(best, tl.load(part_ptr + (r * splits + s) * K + (K - 1 - offs_k)))  # read back to front: ascending
    _store_ids(out_ptr, r, best, offs_k, k)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _programs(dev: torch.device) -> int:
    """Programs the device runs side by side: its SM count (asked once), 1 off CUDA."""
    if dev.type != "cuda":
        return 1
    return _sm_count(torch.cuda.current_device() if dev.index is None else dev.index)


def plan_splits(rows: int, n: int, chunk: int, programs: int, splits: int | None = None) -> tuple[int, int]:
    """(splits, entries per split) for rows x n entries: enough programs for two per SM, each with whole chunks and
    at least MIN_SPLIT entries (fewer only where a row has fewer). `splits` forces a count (tests)."""
    chunks = triton.cdiv(max(n, 1), chunk)
    if splits is None:
        splits = min(triton.cdiv(2 * programs, max(rows, 1)), triton.cdiv(n, MIN_SPLIT), MAX_SPLITS)
    per_split = triton.cdiv(chunks, max(1, min(splits, chunks))) * chunk
    return triton.cdiv(max(n, 1), per_split), per_split


def index_topk_triton(q: torch.Tensor, w: torch.Tensor, keys: PagedKeys, topk: int, *, splits: int | None = None) -> torch.Tensor:
    """Triton twin of `index_topk_ref`: q [rows, heads, dim], w [rows, heads] over `keys` -> ids [rows, min(topk, n)]."""
    rows, heads, dim = q.shape
    codec = keys.codec
    if dim != codec.index_dim or w.shape != (rows, heads) or keys.starts.shape[0] != rows or keys.pool.dim() != 1:
        raise ValueError(f"q {tuple(q.shape)}, w {tuple(w.shape)} and keys of {codec.index_dim} channels for "
                         f"{keys.starts.shape[0]} rows do not fit")
    n = keys.num_entries
    k = min(topk, n)
    out = torch.empty((rows, k), dtype=torch.int64, device=q.device)
    if rows == 0 or k == 0:
        return out
    kp = max(16, triton.next_power_of_2(k))
    chunk = max(kp, BLOCK_N)
    n_splits, split_len = plan_splits(rows, n, chunk, _programs(q.device), splits)
    split = n_splits > 1
    part = torch.empty((rows, n_splits, kp), dtype=torch.int64, device=q.device) if split else out  # [rows, splits, K]
    # bf16 holds the operands exactly: bf16 queries (keys stored or rounded to bf16 values), or MXFP4-rounded ones
    bf16 = codec.rounds or (q.dtype == torch.bfloat16 and keys.pool.dtype == torch.bfloat16)
    starts, counts = keys.starts.contiguous(), keys.counts.contiguous()
    block_h, block_d = max(16, triton.next_power_of_2(heads)), max(16, triton.next_power_of_2(dim))
    _index_topk_kernel[(n_splits, rows)](
        q, *q.stride(), w, *w.stride(), keys.pool, starts, counts, starts.shape[1], out, part,
        heads, k, split_len, n_splits, dim**-0.5,
        PER=keys.per_block, WIDTH=keys.width, DIM=dim, PACKED=codec.packed,
        BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_N=BLOCK_N, CHUNK=chunk, K=kp,
        BF16=bf16, SPLIT=split, INTERPRETED=_INTERPRETED, num_warps=8 if block_h * block_d >= 4096 else 4,
    )
    if split:
        _merge_splits_kernel[(rows,)](part, out, k, n_splits, K=kp, num_warps=4)
    return out
