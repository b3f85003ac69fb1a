"""The KV storage formats as tensors: pack rows into their stored bytes, read them back, and the dense
fake-quantization (pack then unpack) that the reference numerics apply.

Formats and byte layouts are defined in `core.kv_format`. A `KVCodec` is built for one model geometry
and compute dtype; with `bf16` it stores rows as they are (in the compute dtype) and every function is
the identity up to a cast; with `v4-dense` (the reference numerics) `pack_*` applies every rounding of
`v4` but keeps the rows in the compute dtype; with `v4` rows become `uint8` byte rows:
- main rows (SWA keys, C4 and HCA entries): e4m3 nope channels with one power-of-two scale per 64
  channels (the smallest that keeps the block within 448; an all-zero block gets 1), bf16 rope channels;
- indexer keys: multiplied by the orthonormal Hadamard matrix, then MXFP4 (e2m1 with one power-of-two
  scale per 32 channels, the smallest that keeps the block within 6). Indexer queries get the same
  rotation and rounding (`index_query`), so scores are inner products in the rotated space (the
  rotation alone would not change them).

Everything here has static shapes and no host syncs, so it runs inside a compiled decode step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.config import ModelConfig
from core.kv_format import (
    BF16,
    INDEX_SCALE_BLOCK,
    MAIN_SCALE_BLOCK,
    V4_DENSE,
    check_format,
    fp8_main_row_bytes,
    index_key_bytes,
    is_packed,
    main_row_bytes,
)
from kernels.formats import e2m1_table, pow2_to_e8m0, quantize_act_fp8, quantize_fp4

_HADAMARD: dict[tuple[int, str, torch.dtype], torch.Tensor] = {}


def hadamard(n: int, device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix of order n (a power of two), H / sqrt(n); symmetric.

    Entry (i, j) is (-1)**popcount(i & j) / sqrt(n), computed on `device` from index arithmetic alone: no
    host data crosses, so even a first use inside a captured step is device work (the graph recomputes the
    same values on each replay, and the cached tensor keeps its memory). Cached per device; tensor
    subclasses (the capture guard's fake tensors, tracing proxies) hold no memory to reuse and are not kept."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two width, got {n}")
    key = (n, str(device), dtype)
    h = _HADAMARD.get(key)
    if h is None:
        i = torch.arange(n, device=device)
        v = i[:, None] & i  # [n, n]; the parity of its set bits is the sign
        bits = (n - 1).bit_length()  # of an index
        shift = 1 << ((bits - 1).bit_length() - 1) if bits > 1 else 0  # the largest power of two below `bits`
        while shift:  # fold the bits onto bit 0 (xor keeps the parity): 4, 2, 1 for indices of up to 8 bits
            v = v ^ (v >> shift)
            shift >>= 1
        h = ((1 - 2 * (v & 1)).to(torch.float64) / n**0.5).to(dtype)  # divided in float64: 1/sqrt(n) rounded once
        if type(h) is torch.Tensor:
            _HADAMARD[key] = h
    return h


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] @ H (fp32): the rotation applied to indexer keys and queries."""
    return x.float() @ hadamard(x.shape[-1], x.device)


def ue8m0_value(b: torch.Tensor) -> torch.Tensor:
    """UE8M0 scale bytes (uint8) -> fp32 powers of two, 2**(b - 127). The same values as
    `kernels.formats.e8m0_to_float` (the codes 255 = NaN never occur here), written with arithmetic
    that every compiler backend supports (Inductor's CPU code has no float8_e8m0fnu type)."""
    return torch.exp2(b.float() - 127.0)


# --- v4 main rows -----------------------------------------------------------------------------------


def pack_fp8_rows(x: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """Rows [..., head_dim] (nope channels first, rope last) -> v4 main rows [..., row_bytes] uint8."""
    lead, d = x.shape[:-1], x.shape[-1]
    nope = d - rope_dim
    flat = x.reshape(-1, d)
    q, scale = quantize_act_fp8(flat[:, :nope], group=MAIN_SCALE_BLOCK, pow2=True)  # [n, nope], [n, blocks]
    rope = flat[:, nope:].to(torch.bfloat16).contiguous().view(torch.uint8)  # [n, 2 * rope]
    parts = [q.view(torch.uint8), rope, pow2_to_e8m0(scale)]
    width = fp8_main_row_bytes(d, rope_dim)
    pad = width - sum(p.shape[-1] for p in parts)
    if pad:
        parts.append(flat.new_zeros(flat.shape[0], pad, dtype=torch.uint8))
    return torch.cat(parts, dim=-1).view(*lead, width)


def unpack_fp8_rows(b: torch.Tensor, head_dim: int, rope_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """v4 main rows [..., row_bytes] uint8 -> [..., head_dim] in `dtype`."""
    nope = head_dim - rope_dim
    blocks = -(-nope // MAIN_SCALE_BLOCK)
    vals = b[..., :nope].contiguous().view(torch.float8_e4m3fn).float()
    rope = b[..., nope : nope + 2 * rope_dim].contiguous().view(torch.bfloat16)
    scale = ue8m0_value(b[..., nope + 2 * rope_dim : nope + 2 * rope_dim + blocks])
    vals = (vals.unflatten(-1, (-1, MAIN_SCALE_BLOCK)) * scale[..., None]).flatten(-2) if nope % MAIN_SCALE_BLOCK == 0 \
        else vals * scale.repeat_interleave(MAIN_SCALE_BLOCK, dim=-1)[..., :nope]
    return torch.cat((vals.to(dtype), rope.to(dtype)), dim=-1)


@dataclass(frozen=True)
class MainRowReader:
    """Reads v4 main rows back (`unpack_fp8_rows`); kernels that dequantize on load read its dims."""

    head_dim: int
    rope_dim: int
    dtype: torch.dtype

    @property
    def nope(self) -> int:
        return self.head_dim - self.rope_dim

    @property
    def scale_offset(self) -> int:
        """Byte offset of the first UE8M0 scale in a row."""
        return self.nope + 2 * self.rope_dim

    def __call__(self, b: torch.Tensor) -> torch.Tensor:
        return unpack_fp8_rows(b, self.head_dim, self.rope_dim, self.dtype)


# --- v4 indexer keys --------------------------------------------------------------------------------


def pack_fp4_keys(x: torch.Tensor) -> torch.Tensor:
    """Keys [..., dim] -> Hadamard-rotated MXFP4 rows [..., dim/2 + dim/32] uint8."""
    q, scale = quantize_fp4(hadamard_rotate(x), block=INDEX_SCALE_BLOCK)
    return torch.cat((q.view(torch.uint8), scale), dim=-1)


def unpack_fp4_keys(b: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 rows [..., bytes] -> the keys in the rotated space [..., dim] (the rotation is not undone).

    Each byte is looked up whole in a table of the value pairs of its two codes (int32 index, fp32 pair: 12 bytes
    written per stored byte rather than the 40 of int64 codes and a lookup per channel); the decode step reads
    every stored key through this."""
    half = dim // 2
    table = e2m1_table(b.device)
    byte = torch.arange(256, device=b.device)
    pairs = torch.stack((table[byte & 15], table[byte >> 4]), dim=-1)  # [256, 2]: even channel in the low nibble
    vals = pairs[b[..., :half].int()].flatten(-2)  # [..., dim]
    scale = ue8m0_value(b[..., half:])  # [..., blocks]
    if dim % INDEX_SCALE_BLOCK == 0:  # scaled in place: one [..., dim] buffer, not two
        vals.unflatten(-1, (-1, INDEX_SCALE_BLOCK)).mul_(scale[..., None])
    else:
        vals.mul_(scale.repeat_interleave(INDEX_SCALE_BLOCK, dim=-1)[..., :dim])
    return vals.to(dtype)


# --- one model's codec ------------------------------------------------------------------------------


@dataclass(frozen=True)
class KVCodec:
    """How one model's KV rows are stored in `format`, computed in `dtype`."""

    format: str
    head_dim: int
    rope_dim: int
    index_dim: int
    dtype: torch.dtype

    @staticmethod
    def for_model(cfg: ModelConfig, fmt: str, dtype: torch.dtype) -> KVCodec:
        return KVCodec(check_format(fmt), cfg.head_dim, cfg.rope_head_dim, cfg.index_head_dim, dtype)

    @property
    def packed(self) -> bool:
        """Rows stored as bytes (`v4`)."""
        return is_packed(self.format)

    @property
    def rounds(self) -> bool:
        """Rows rounded as v4 stores them (`v4` and `v4-dense`)."""
        return self.format != BF16

    @property
    def storage_dtype(self) -> torch.dtype:
        """Dtype of stored rows: bytes when packed, the compute dtype otherwise."""
        return torch.uint8 if self.packed else self.dtype

    @property
    def elem_bytes(self) -> int:
        return self.dtype.itemsize  # no tensor made: the step reads row widths through the codec

    @property
    def main_bytes(self) -> int:
        """Bytes of one stored SWA / C4 / HCA row."""
        return main_row_bytes(self.head_dim, self.rope_dim, self.format, self.elem_bytes)

    @property
    def index_bytes(self) -> int:
        """Bytes of one stored indexer key."""
        return index_key_bytes(self.index_dim, self.format, self.elem_bytes)

    @property
    def main_width(self) -> int:
        """Width of a stored main row in storage elements."""
        return self.main_bytes if self.packed else self.head_dim

    @property
    def index_width(self) -> int:
        return self.index_bytes if self.packed else self.index_dim

    # the rounding itself (v4 numerics), whatever the storage
    def fake_main(self, x: torch.Tensor) -> torch.Tensor:
        """x rounded as a v4 main row rounds it (the identity for `bf16`), in x's dtype."""
        if not self.rounds:
            return x
        return unpack_fp8_rows(pack_fp8_rows(x, self.rope_dim), self.head_dim, self.rope_dim, x.dtype)

    def fake_index(self, x: torch.Tensor) -> torch.Tensor:
        """An indexer key (or query) as v4 stores it and reads it back: rotated and MXFP4-rounded, in the
        rotated space (the identity for `bf16`)."""
        if not self.rounds:
            return x
        return unpack_fp4_keys(pack_fp4_keys(x), self.index_dim, x.dtype)

    def index_query(self, q: torch.Tensor) -> torch.Tensor:
        """Indexer queries [..., index_dim] in the keys' space (the same rotation and rounding as keys)."""
        return self.fake_index(q)

    @property
    def main_reader(self) -> MainRowReader | None:
        """What attention reads stored main rows through: None when rows are stored as values."""
        return MainRowReader(self.head_dim, self.rope_dim, self.dtype) if self.packed else None

    # stored rows <-> computed rows: quantize once where rows are made, dequantize where they are read
    def pack_main(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return pack_fp8_rows(x, self.rope_dim)
        return self.fake_main(x).to(self.dtype)

    def unpack_main(self, b: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.dtype
        return unpack_fp8_rows(b, self.head_dim, self.rope_dim, dtype) if self.packed else b.to(dtype)

    def pack_index(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return pack_fp4_keys(x)
        return self.fake_index(x).to(self.dtype)

    def unpack_index(self, b: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.dtype
        return unpack_fp4_keys(b, self.index_dim, dtype) if self.packed else b.to(dtype)


def model_codec(cfg: ModelConfig, dtype: torch.dtype) -> KVCodec:
    """The codec of `cfg.kv_format` for a model computing in `dtype`."""
    return KVCodec.for_model(cfg, cfg.kv_format, dtype)


def dense_twin(codec: KVCodec) -> KVCodec:
    """The reference numerics of a codec: the same roundings, rows kept unpacked."""
    return KVCodec(V4_DENSE if codec.rounds else BF16, codec.head_dim, codec.rope_dim, codec.index_dim, codec.dtype)
