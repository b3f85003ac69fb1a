"""KV storage formats: their names and the byte size of one stored row (no torch, so the planner can use it).

Two formats a runtime can store its KV in:
- `bf16`: every row as it is computed, in the model's compute dtype (`head_dim` or `index_head_dim` values).
- `v4`: DeepSeek-V4's trained formats.
  - *main row* (SWA keys, C4 entries, HCA entries): the `head_dim - rope_head_dim` leading ("nope") channels
    as e4m3 bytes, the `rope_head_dim` trailing channels as bf16, one UE8M0 scale byte per `MAIN_SCALE_BLOCK`
    nope channels, the row padded with zeros to a multiple of `ROW_ALIGN` bytes. At V4's dimensions
    (512 channels, 64 rotary) that is 448 + 128 + 7 + 1 = 584 bytes.
  - *indexer key*: Hadamard-rotated, then MXFP4: two e2m1 codes per byte plus one UE8M0 scale byte per
    `INDEX_SCALE_BLOCK` channels; 64 + 4 = 68 bytes for a 128-channel key.

Byte layout of a v4 main row: [nope e4m3 | rope bf16 (little endian) | scales | pad];
of a v4 indexer key: [packed e2m1 pairs, even channel in the low nibble | scales].
The codec is `kernels.kv_format`; the planner's `fp8` / `fp4` entry formats are these rows.
"""

from __future__ import annotations

import math

BF16 = "bf16"
V4 = "v4"
V4_DENSE = "v4-dense"
KV_FORMATS = (BF16, V4)
"""Storage formats a runtime serves with (`--kv-format`)."""
MODEL_KV_FORMATS = (BF16, V4, V4_DENSE)
"""Values of `ModelConfig.kv_format`: the serving formats plus `v4-dense`, the reference numerics
(every v4 rounding applied where rows are made, rows then kept unpacked in the compute dtype)."""

MAIN_SCALE_BLOCK = 64
"""Nope channels sharing one UE8M0 scale in a v4 main row."""
INDEX_SCALE_BLOCK = 32
"""Channels sharing one UE8M0 scale in a v4 indexer key (MXFP4)."""
ROW_ALIGN = 8
"""A v4 main row is padded to a multiple of this many bytes."""


AUTO = "auto"
"""`--kv-format auto`: what the checkpoint was trained for (`model.config.trained_kv_format`)."""


def check_format(name: str) -> str:
    if name not in MODEL_KV_FORMATS:
        raise ValueError(f"unknown kv format {name!r}; expected one of {MODEL_KV_FORMATS}")
    return name


def is_packed(fmt: str) -> bool:
    """Whether rows of `fmt` are stored as bytes (`v4`) rather than in the compute dtype."""
    return check_format(fmt) == V4


def fp8_main_row_bytes(head_dim: int, rope_dim: int) -> int:
    """Bytes of a v4 main row: e4m3 nope channels, bf16 rope channels, UE8M0 scales, padding."""
    nope = head_dim - rope_dim
    raw = nope + 2 * rope_dim + math.ceil(nope / MAIN_SCALE_BLOCK)
    return -(-raw // ROW_ALIGN) * ROW_ALIGN


def fp4_key_bytes(dim: int) -> int:
    """Bytes of a v4 (MXFP4) indexer key: two channels per byte plus one scale per block."""
    return math.ceil(dim / 2) + math.ceil(dim / INDEX_SCALE_BLOCK)


def main_row_bytes(head_dim: int, rope_dim: int, fmt: str, elem_bytes: int) -> int:
    """Bytes of one SWA / C4 / HCA row in `fmt` (`elem_bytes`: the compute dtype's size, for `bf16`)."""
    return fp8_main_row_bytes(head_dim, rope_dim) if is_packed(fmt) else head_dim * elem_bytes


def index_key_bytes(index_dim: int, fmt: str, elem_bytes: int) -> int:
    """Bytes of one indexer key in `fmt`."""
    return fp4_key_bytes(index_dim) if is_packed(fmt) else index_dim * elem_bytes
