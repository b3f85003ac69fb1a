"""Triton decode-time sparse attention: one query per batch row over gathered rows, with a per-head sink.

Same contract as `kernels.attention_ref.sparse_attention_ref`. V4 has one KV head and its keys are its values,
so one gathered KV row serves every head of the query. A program takes one batch row, a group of heads and a
slice of the row's keys; it loads a tile of KV rows once (packed v4 rows are dequantised once, as they are
loaded), computes the [heads, tile] logits with one dot, folds them into an online softmax and adds the
probabilities times the same tile to a [heads, head_dim] accumulator. The segments (SWA ring, C4 top-k, HCA
entries) are read as one list of keys, segment after segment; `splits` programs share that list.

**Register budget.** At V4's shapes (64 heads x 512 channels) an fp32 accumulator for every head is
64 x 512 x 4 B = 128 KiB, and q beside it 64 KiB in bf16. An SM has 256 KiB of registers, a thread at most 255
of them; at 8 warps (256 threads) accumulator and q would need 192 registers a thread before the KV tile,
logits and addresses, so the compiler would spill. The plan bounds accumulator plus q to `REGISTER_BUDGET`
(96 KiB, 96 registers a thread at 8 warps): 32 heads per program in bf16 (32 x 512 x (4 + 2) B = 96 KiB),
16 in fp32. V4's 64 heads are then two programs per (batch row, split); they are neighbours on the grid's
fastest axis, so they run together and the second one's tile reads normally come from L2: HBM sees each
row about once, and in bf16 the dequantisation runs twice per row instead of four times (the previous
kernel's 16 heads per program). A KV tile is `TILE_BUDGET` (32 KiB) at most: 32 rows of 512 bf16 channels, 16 in fp32.

**Tensor cores.** With bf16 q (and rows that are bf16: plain bf16 pools, or v4 rows, whose e4m3 x power of
two values are exact in bf16) both dots take bf16 operands and accumulate in fp32 (the probabilities are
rounded to bf16 for the second dot; their sum, the softmax denominator, stays fp32). Per row and head the
work is 2 x 512 x 2 FLOP, so 64 heads do 131 KFLOP per 584-B row: about 224 FLOP/B, close to the H200's
bf16 ridge (about 990 TFLOP/s over 4.8 TB/s = 206 FLOP/B) and far above the fp32-core ridge (about 14), which
is why fp32 FMA dots made this kernel compute-bound. fp32 q keeps IEEE fp32 dots (`input_precision="ieee"`),
which equal the reference up to summation order: TF32 would cost about three decimal digits. Triton's
interpreter multiplies bf16 dot operands as raw 16-bit patterns, so under it the bf16 path rounds its
operands to bf16 exactly as on a GPU and multiplies them in an fp32 dot: the same products, tested on the CPU.

**Split over keys (flash-decoding).** At batch 1 the heads give two programs for a 132-SM GPU. When batch x
head groups is below the SM count, each (row, group) is split into `splits` programs over contiguous slices of
its keys (at least `MIN_SPLIT_ROWS` keys each); each writes its unnormalised (max, sum, accumulator) and one
merge kernel combines them and adds the sink. The split count comes from the bucket's shapes and the device's
SM count only, so a captured step has one grid whatever the rows hold. The sink enters once, at the end, as
exp(sink - max): every program starts its running maximum at the sink (finite, so a slice without a valid
key gives p = 0 and not NaN) with a zero sum, and a row without any valid key gets 0, as in the reference.

**Loads on the 584-B stride.** Row r of a v4 pool starts at 584 r = 8 x 73 r bytes: 8-byte aligned, and
16-byte aligned only for even r, so 8 bytes is the widest access every row allows. The kernel reads a row
as three 8-byte-aligned parts: the e4m3 nope bytes at offset 0 (448 B: 56 8-byte vectors), the bf16 rope
channels at offset 448 through a bf16 pointer (128 B: 16 vectors of four channels), and the UE8M0 scales at
offset 576 as one 8-byte word (7 scales and the pad), from which each channel shifts out its block's byte.
That is 73 loads a row instead of the previous kernel's 1,024 byte loads (448 nope, 448 scale, 128 rope). `tl.multiple_of` tells the
compiler the 8-byte alignment of each row's offset, which the wrapper checks (base pointer and row stride
multiples of `ROW_ALIGN`) and `reads_packed` guarantees for the fields (nope and scale offsets multiples of
8, at most 8 scale blocks); other row geometries are dequantised by the dispatcher before the kernel.
e4m3 is decoded by the hardware conversion (a bitcast to fp8 and a cast) and the scale by building the
power of two's bits, both exact: the kernel sees the values `MainRowReader` gives.

Not measured: no GPU was available to this work, so the budgets above are arithmetic, not profiles
(docs/decode-step.md, "Sparse attention kernel").
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from core.kv_format import MAIN_SCALE_BLOCK, ROW_ALIGN
from kernels.kv_format import MainRowReader

MAX_SEGMENTS = 3
REGISTER_BUDGET = 96 * 1024
"""Bytes of q plus the fp32 accumulator one program holds (see the module docstring)."""
TILE_BUDGET = 32 * 1024
"""Bytes of one tile of KV rows in the dot's operand dtype."""
MAX_TILE_ROWS = 32
MIN_SPLIT_ROWS = 128
"""Fewest keys a split program reads: below this its q load and partial write outweigh its share of rows."""
MAX_SPLITS = 64
MAX_SCALE_BLOCKS = 8
"""Scale bytes that one 8-byte word holds: v4 rows whose nope channels need more are not read in place."""

_SCALE_BLOCK = tl.constexpr(MAIN_SCALE_BLOCK)
_LAST_SCALE = tl.constexpr(MAX_SCALE_BLOCKS - 1)
# Triton 3.9's interpreter multiplies bf16 dot operands as their raw 16-bit patterns (see the docstring).
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def reads_packed(reader: MainRowReader) -> bool:
    """Whether the kernels read v4 rows of this geometry in place: every field starts on an 8-byte boundary
    of the row and the scales fit one 8-byte word. True at V4's (512 / 64) and the built-in model's (64 / 8) dims."""
    blocks = -(-reader.nope // MAIN_SCALE_BLOCK)
    return reader.nope % ROW_ALIGN == 0 and reader.scale_offset % ROW_ALIGN == 0 and 0 < blocks <= MAX_SCALE_BLOCKS


def packed_pool_error(pool: torch.Tensor) -> str | None:
    """Why the kernels cannot read this pool of v4 rows in place (None when they can): its rows must be uint8,
    contiguous within a row, and start on `ROW_ALIGN`-byte boundaries (the 8-byte loads rely on it)."""
    if pool.dim() != 2 or pool.dtype != torch.uint8 or pool.stride(1) != 1:
        return f"packed pool {tuple(pool.shape)} {pool.dtype} strides {pool.stride()} is not uint8 rows of bytes"
    if pool.data_ptr() % ROW_ALIGN or pool.stride(0) % ROW_ALIGN:
        return f"packed pool rows must start on {ROW_ALIGN}-byte boundaries (base {pool.data_ptr()}, row stride {pool.stride(0)})"
    return None


# --- device code ------------------------------------------------------------------------------------------


@triton.jit
def _load_packed(pool_ptr, rows, ok, row_bytes, offs_d, in_d, NOPE: tl.constexpr, SCALE_OFF: tl.constexpr):
    """Rows [T] of packed v4 bytes -> fp32 values [T, D] (0 where masked). Needs what `reads_packed` and
    `packed_pool_error` check: every row and field offset a multiple of 8 bytes."""
    start = tl.multiple_of(tl.where(ok, rows, 0).to(tl.int64) * row_bytes, 8)  # [T] byte offset of each row
    live = ok[:, None] & in_d[None, :]
    is_nope = offs_d < NOPE  # [D]
    byte = tl.load(pool_ptr + start[:, None] + offs_d[None, :], mask=live & is_nope[None, :], other=0)  # [T, D] e4m3 bits
    val = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    # the row's scale bytes as one word; channel d's block is d // 64, its byte (d // 64) * 8 bits up
    words = pool_ptr.to(tl.pointer_type(tl.int64))
    word = tl.load(words + (start + SCALE_OFF) // 8, mask=ok, other=0)  # [T]
    shift = (tl.minimum(offs_d // _SCALE_BLOCK, _LAST_SCALE) * 8).to(tl.int64)  # [D]; rope channels: any byte, unused
    sbyte = (word[:, None] >> shift[None, :]) & 255  # [T, D]
    # 2**(s - 127) from its bits: exponent field s, or the subnormal 2**-127 for s == 0
    scale = tl.where(sbyte > 0, sbyte << 23, 1 << 22).to(tl.int32).to(tl.float32, bitcast=True)
    halves = pool_ptr.to(tl.pointer_type(tl.bfloat16))
    r = tl.where(is_nope, 0, offs_d - NOPE)  # rope channel index, kept in range where unused
    rope = tl.load(halves + ((start + NOPE) // 2)[:, None] + r[None, :], mask=live & ~is_nope[None, :], other=0.0)
    return tl.where(is_nope[None, :], val * scale, rope.to(tl.float32))  # [T, D]


@triton.jit
def _load_kv(pool_ptr, rows, ok, stride_row, stride_d, offs_d, in_d, PACKED_NOPE: tl.constexpr, SCALE_OFF: tl.constexpr,
             OUT: tl.constexpr):
    """Pool rows `rows` [T] (where `ok`) as values [T, D] in `OUT`: packed v4 rows dequantised, plain rows cast."""
    if PACKED_NOPE > 0:
        kv = _load_packed(pool_ptr, rows, ok, stride_row, offs_d, in_d, PACKED_NOPE, SCALE_OFF).to(OUT)
    else:
        kv = tl.load(
            pool_ptr + rows[:, None].to(tl.int64) * stride_row + offs_d[None, :] * stride_d,
            mask=ok[:, None] & in_d[None, :],
            other=0.0,
        ).to(OUT)
    return kv


@triton.jit
def _dot(a, b, BF16: tl.constexpr, INTERPRETED: tl.constexpr):
    """a @ b with an fp32 result: bf16 operands on tensor cores, or an IEEE fp32 dot."""
    if BF16 and not INTERPRETED:
        out = tl.dot(a, b, out_dtype=tl.float32)
    else:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return out


@triton.jit
def _fold_tile(q, m, denom, acc, kv, ok, scale, BF16: tl.constexpr, INTERPRETED: tl.constexpr):
    """Fold one tile of keys kv [T, D] (valid where `ok`) into the running (max [H], sum [H], numerator [H, D])."""
    s = _dot(q, tl.trans(kv), BF16, INTERPRETED) * scale  # [H, T]
    s = tl.where(ok[None, :], s, float("-inf"))
    # m starts at the sink logit, so it is finite and a fully masked tile gives p == 0, not NaN.
    m_new = tl.maximum(m, tl.max(s, axis=1))  # [H]
    alpha = tl.exp(m - m_new)  # [H]
    p = tl.exp(s - m_new[:, None])  # [H, T]
    denom = denom * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.to(kv.dtype), kv, BF16, INTERPRETED)  # [H, D]
    return m_new, denom, acc


@triton.jit
def _fold_rows(q, m, denom, acc, pool_ptr, rows, ok, pool_stride_row, pool_stride_d, offs_d, in_d, scale,
               PACKED_NOPE: tl.constexpr, SCALE_OFF: tl.constexpr):
    """Load pool rows `rows` (where `ok`) and fold them in, in fp32 (the prefill kernel's block step)."""
    kv = _load_kv(pool_ptr, rows, ok, pool_stride_row, pool_stride_d, offs_d, in_d, PACKED_NOPE, SCALE_OFF, tl.float32)
    return _fold_tile(q, m, denom, acc, kv, ok, scale, False, False)


@triton.jit
def _attend_slice(q, m, denom, acc, pool_ptr, stride_row, stride_d, rows_ptr, rows_stride_b, rows_stride_j, seg_len,
                  seg_start, lo, hi, b, offs_d, in_d, scale, BLOCK_T: tl.constexpr, PACKED_NOPE: tl.constexpr,
                  SCALE_OFF: tl.constexpr, BF16: tl.constexpr, INTERPRETED: tl.constexpr):
    """Fold the keys of one segment that fall in [lo, hi) of the row's key list (the segment's keys are
    seg_start .. seg_start + seg_len - 1 there)."""
    first = tl.maximum(lo - seg_start, 0)
    last = tl.minimum(hi - seg_start, seg_len)
    offs_t = tl.arange(0, BLOCK_T)
    for start in range(first, last, BLOCK_T):
        j = start + offs_t
        rows = tl.load(rows_ptr + b * rows_stride_b + j * rows_stride_j, mask=j < last, other=-1)  # [T]
        ok = rows >= 0
        kv = _load_kv(pool_ptr, rows, ok, stride_row, stride_d, offs_d, in_d, PACKED_NOPE, SCALE_OFF,
                      tl.bfloat16 if BF16 else tl.float32)  # [T, D]
        m, denom, acc = _fold_tile(q, m, denom, acc, kv, ok, scale, BF16, INTERPRETED)
    return m, denom, acc


@triton.jit
def _attend_segment(q, m, denom, acc, pool_ptr, pool_stride_row, pool_stride_d, rows_ptr, rows_stride_b, rows_stride_j,
                    seg_len, b, offs_d, in_d, scale, BLOCK_L: tl.constexpr, PACKED_NOPE: tl.constexpr,
                    SCALE_OFF: tl.constexpr):
    """Fold `pool[rows[b, :seg_len]]` in, in fp32 (the prefill kernel's segment walk): the whole segment as one slice."""
    return _attend_slice(q, m, denom, acc, pool_ptr, pool_stride_row, pool_stride_d, rows_ptr, rows_stride_b, rows_stride_j,
                         seg_len, 0, 0, seg_len, b, offs_d, in_d, scale, BLOCK_L, PACKED_NOPE, SCALE_OFF, False, False)


@triton.jit
def _sparse_decode_kernel(
    q_ptr, q_stride_b, q_stride_h, q_stride_d,
    out_ptr, out_stride_b, out_stride_h, out_stride_d,
    part_ptr, max_ptr, sum_ptr,
    sinks_ptr,
    pool0_ptr, pool0_stride_row, pool0_stride_d, rows0_ptr, rows0_stride_b, rows0_stride_j, len0, start0,
    pool1_ptr, pool1_stride_row, pool1_stride_d, rows1_ptr, rows1_stride_b, rows1_stride_j, len1, start1,
    pool2_ptr, pool2_stride_row, pool2_stride_d, rows2_ptr, rows2_stride_b, rows2_stride_j, len2, start2,
    heads, dim, chunk, scale,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
    PACKED_NOPE: tl.constexpr, SCALE_OFF: tl.constexpr, BF16: tl.constexpr, SPLIT: tl.constexpr,
    INTERPRETED: tl.constexpr,
):  # fmt: skip
    """Program (head group, split, batch row): keys [split * chunk, (split + 1) * chunk) of the row's key list.
    SPLIT: write the unnormalised partials [batch, splits, heads, (dim)]; else the output itself."""
    g, split, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    splits = tl.num_programs(1)
    offs_h = g * BLOCK_H + tl.arange(0, BLOCK_H)
    in_h = offs_h < heads
    offs_d = tl.arange(0, BLOCK_D)
    in_d = offs_d < dim
    q = tl.load(
        q_ptr + b * q_stride_b + offs_h[:, None] * q_stride_h + offs_d[None, :] * q_stride_d,
        mask=in_h[:, None] & in_d[None, :],
        other=0.0,
    ).to(tl.bfloat16 if BF16 else tl.float32)  # [H, D]
    sink = tl.load(sinks_ptr + offs_h, mask=in_h, other=0.0).to(tl.float32)  # [H]
    m = sink
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    lo = split * chunk
    hi = lo + chunk
    m, denom, acc = _attend_slice(q, m, denom, acc, pool0_ptr, pool0_stride_row, pool0_stride_d, rows0_ptr, rows0_stride_b,
                                  rows0_stride_j, len0, start0, lo, hi, b, offs_d, in_d, scale, BLOCK_T, PACKED_NOPE,
                                  SCALE_OFF, BF16, INTERPRETED)
    m, denom, acc = _attend_slice(q, m, denom, acc, pool1_ptr, pool1_stride_row, pool1_stride_d, rows1_ptr, rows1_stride_b,
                                  rows1_stride_j, len1, start1, lo, hi, b, offs_d, in_d, scale, BLOCK_T, PACKED_NOPE,
                                  SCALE_OFF, BF16, INTERPRETED)
    m, denom, acc = _attend_slice(q, m, denom, acc, pool2_ptr, pool2_stride_row, pool2_stride_d, rows2_ptr, rows2_stride_b,
                                  rows2_stride_j, len2, start2, lo, hi, b, offs_d, in_d, scale, BLOCK_T, PACKED_NOPE,
                                  SCALE_OFF, BF16, INTERPRETED)
    if SPLIT:
        at = (b * splits + split) * heads + offs_h  # [H] into [batch, splits, heads]
        tl.store(max_ptr + at, m, mask=in_h)
        tl.store(sum_ptr + at, denom, mask=in_h)
        tl.store(part_ptr + at[:, None] * dim + offs_d[None, :], acc, mask=in_h[:, None] & in_d[None, :])
    else:
        out = acc / (denom + tl.exp(sink - m))[:, None]  # [H, D]: the sink's share of the denominator, once
        tl.store(
            out_ptr + b * out_stride_b + offs_h[:, None] * out_stride_h + offs_d[None, :] * out_stride_d,
            out.to(out_ptr.dtype.element_ty),
            mask=in_h[:, None] & in_d[None, :],
        )


@triton.jit
def _merge_splits_kernel(
    part_ptr, max_ptr, sum_ptr, sinks_ptr,
    out_ptr, out_stride_b, out_stride_h, out_stride_d,
    heads, dim, splits,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Program (head block, channel block, batch row): the splits' partials rescaled to their common maximum,
    summed, with the sink added to the denominator once."""
    hb, db, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    in_h = offs_h < heads
    offs_d = db * BLOCK_D + tl.arange(0, BLOCK_D)
    in_d = offs_d < dim
    sink = tl.load(sinks_ptr + offs_h, mask=in_h, other=0.0).to(tl.float32)  # [H]
    top = sink  # every split's maximum started at the sink
    for s in range(splits):
        top = tl.maximum(top, tl.load(max_ptr + (b * splits + s) * heads + offs_h, mask=in_h, other=0.0))
    denom = tl.exp(sink - top)  # [H]
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s in range(splits):
        at = (b * splits + s) * heads + offs_h  # [H]
        w = tl.exp(tl.load(max_ptr + at, mask=in_h, other=0.0) - top)  # [H]
        denom += w * tl.load(sum_ptr + at, mask=in_h, other=0.0)
        part = tl.load(part_ptr + at[:, None] * dim + offs_d[None, :], mask=in_h[:, None] & in_d[None, :], other=0.0)
        acc += w[:, None] * part  # [H, D]
    tl.store(
        out_ptr + b * out_stride_b + offs_h[:, None] * out_stride_h + offs_d[None, :] * out_stride_d,
        (acc / denom[:, None]).to(out_ptr.dtype.element_ty),
        mask=in_h[:, None] & in_d[None, :],
    )


# --- host side --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodePlan:
    """Block sizes and key splits of one launch, from static shapes only (a captured step has one grid)."""

    block_h: int
    block_d: int
    block_t: int
    num_warps: int
    head_groups: int
    splits: int
    chunk: int
    """Keys of the row's key list per split: a multiple of block_t."""

    def grid(self, batch: int) -> tuple[int, int, int]:
        # head groups fastest: the programs that read the same tiles run side by side
        return (self.head_groups, self.splits, batch)


def _floor_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def plan_decode(batch: int, heads: int, dim: int, keys: int, bf16: bool, programs: int,
                splits: int | None = None, block_h: int | None = None, block_t: int | None = None) -> DecodePlan:
    """Blocks and splits for q [batch, heads, dim] over `keys` keys a row, on a device that runs `programs`
    programs at once (its SM count; 1 under the interpreter). `splits`, `block_h` and `block_t` force a choice
    (tests, benches); a forced split count still shrinks when whole tiles leave the last splits without keys.

    tl.dot wants every block dimension to be at least 16. Heads per program: the most that keep q and the fp32
    accumulator within REGISTER_BUDGET. Splits: only when batch x head groups leaves SMs idle, and never below
    MIN_SPLIT_ROWS keys a split."""
    for name, forced in (("block_h", block_h), ("block_t", block_t)):
        if forced is not None and (forced < 1 or forced & (forced - 1)):
            raise ValueError(f"{name} must be a power of two, got {forced}")
    block_d = max(16, triton.next_power_of_2(dim))
    q_bytes = 2 if bf16 else 4
    if block_h is None:
        block_h = min(_floor_pow2(REGISTER_BUDGET // (block_d * (4 + q_bytes))), triton.next_power_of_2(heads))
    block_h = max(16, block_h)
    if block_t is None:
        block_t = min(MAX_TILE_ROWS, _floor_pow2(TILE_BUDGET // (block_d * q_bytes)))
    block_t = max(16, block_t)
    groups = triton.cdiv(heads, block_h)
    if splits is None:
        busy = batch * groups
        splits = 1 if busy >= programs else min(programs // busy, max(1, keys // MIN_SPLIT_ROWS), MAX_SPLITS)
    chunk = triton.cdiv(triton.cdiv(max(keys, 1), max(1, splits)), block_t) * block_t
    splits = triton.cdiv(max(keys, 1), chunk)  # no program left without keys by the rounding
    num_warps = 8 if block_h * block_d >= 8192 else 4
    return DecodePlan(block_h, block_d, block_t, num_warps, groups, splits, chunk)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_programs(dev: torch.device) -> int:
    """Programs `dev` runs side by side for the split choice: its SM count (asked once, cached, so a captured
    step reads a dict), and 1 off CUDA (the interpreter runs one program at a time)."""
    if dev.type != "cuda":
        return 1
    return _sm_count(torch.cuda.current_device() if dev.index is None else dev.index)


def sparse_attention_triton(
    q: torch.Tensor, segments: list[tuple[torch.Tensor, torch.Tensor]], sinks: torch.Tensor, scale: float,
    packed: MainRowReader | None = None, *, splits: int | None = None, block_h: int | None = None,
    block_t: int | None = None,
) -> torch.Tensor:
    """Triton twin of `sparse_attention_ref`: q [batch, heads, dim] over `pool[rows]` of each segment -> [batch, heads, dim].

    `packed`: the pools are uint8 v4 main rows, dequantised on load (a geometry `reads_packed` accepts).
    `splits`, `block_h`, `block_t` override the plan (`plan_decode`)."""
    if not 1 <= len(segments) <= MAX_SEGMENTS:
        raise ValueError(f"expected 1..{MAX_SEGMENTS} segments, got {len(segments)}")
    batch, heads, dim = q.shape
    if packed is not None and (packed.head_dim != dim or not reads_packed(packed)):
        raise ValueError(f"packed rows of {packed.head_dim} / {packed.rope_dim} channels are not read in place for q {tuple(q.shape)}")
    for pool, rows in segments:
        if packed is not None and (err := packed_pool_error(pool)):
            raise ValueError(err)
        if pool.dim() != 2 or (packed is None and pool.shape[1] != dim) or rows.dim() != 2 or rows.shape[0] != batch:
            raise ValueError(f"segment pool {tuple(pool.shape)} / rows {tuple(rows.shape)} do not fit q {tuple(q.shape)}")
    out = torch.empty_like(q)  # [batch, heads, dim]
    if batch == 0 or heads == 0:
        return out
    bf16 = q.dtype == torch.bfloat16 and (packed is not None or all(pool.dtype == torch.bfloat16 for pool, _ in segments))
    lengths = [rows.shape[1] for _, rows in segments]
    plan = plan_decode(batch, heads, dim, sum(lengths), bf16, device_programs(q.device), splits, block_h, block_t)
    # Missing segments are length 0, so the kernel has one shape whatever the caller passes.
    padded = list(segments) + [segments[0]] * (MAX_SEGMENTS - len(segments))
    lengths += [0] * (MAX_SEGMENTS - len(segments))
    seg_args, start = [], 0
    for (pool, rows), seg_len in zip(padded, lengths):
        seg_args += [pool, pool.stride(0), pool.stride(1), rows, rows.stride(0), rows.stride(1), seg_len, start]
        start += seg_len
    split = plan.splits > 1
    if split:  # fp32 partials of every (row, split, head): [batch, splits, heads, dim] and [batch, splits, heads]
        part = torch.empty((batch, plan.splits, heads, dim), dtype=torch.float32, device=q.device)
        top = torch.empty((batch, plan.splits, heads), dtype=torch.float32, device=q.device)
        total = torch.empty_like(top)
    else:
        part = top = total = out  # never written
    sinks = sinks.contiguous()
    _sparse_decode_kernel[plan.grid(batch)](
        q, *q.stride(), out, *out.stride(), part, top, total, sinks, *seg_args, heads, dim, plan.chunk, scale,
        BLOCK_H=plan.block_h, BLOCK_D=plan.block_d, BLOCK_T=plan.block_t,
        PACKED_NOPE=packed.nope if packed is not None else 0,
        SCALE_OFF=packed.scale_offset if packed is not None else 0,
        BF16=bf16, SPLIT=split, INTERPRETED=_INTERPRETED, num_warps=plan.num_warps,
    )
    if split:
        merge_h, merge_d = min(16, triton.next_power_of_2(heads)), min(128, triton.next_power_of_2(dim))
        grid = (triton.cdiv(heads, merge_h), triton.cdiv(dim, merge_d), batch)
        _merge_splits_kernel[grid](part, top, total, sinks, out, *out.stride(), heads, dim, plan.splits,
                                   BLOCK_H=merge_h, BLOCK_D=merge_d, num_warps=4)
    return out
