"""The packed weight formats of DeepSeek-V4 checkpoints: decoding, encoding and whole-tensor dequantization.

- FP8: e4m3 values (`torch.float8_e4m3fn`, max 448) with one scale per `FP8_BLOCK` x `FP8_BLOCK` tile of a
  [out, in] matrix, scales [ceil(out/128), ceil(in/128)]. Checkpoints store the scales as UE8M0 (powers of
  two, one byte each); DeepSeek-V3-style checkpoints store fp32 (`weight_scale_inv`). Both decode to fp32.
- FP4 (MXFP4): e2m1 values packed two per byte along the input axis, the even element in the low nibble,
  [out, in/2] bytes (stored as int8), with one UE8M0 scale per `FP4_BLOCK` inputs, [out, ceil(in/32)].
- UE8M0: an unsigned exponent byte b means 2**(b - 127); b = 0 is 2**-127 (a subnormal fp32) and b = 255 is
  NaN, as `torch.float8_e8m0fnu` decodes them.

The quantizers write the same formats (power-of-two scales chosen so that nothing clips, round to nearest
even) for test checkpoints and for activations of the W8A8 path.
"""

from __future__ import annotations

import torch

FP8_BLOCK = 128
"""Rows and columns of one FP8 weight scale tile, and the width of an activation scale group."""
FP4_BLOCK = 32
"""Inputs sharing one FP4 scale."""
FP8_MAX = 448.0
"""Largest finite e4m3 value."""
FP4_MAX = 6.0
"""Largest e2m1 value."""

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The value of each 4-bit e2m1 code (bit 3 is the sign)."""
# Round-to-nearest-even boundaries between consecutive e2m1 magnitudes (codes i and i + 1).
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Scales as fp32: UE8M0 bytes (`float8_e8m0fnu` or raw `uint8`) decode to powers of two; floats pass."""
    if scale.dtype == torch.uint8:
        scale = scale.view(torch.float8_e8m0fnu)
    return scale.float()


def float_to_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two scales (any float dtype) -> UE8M0 bytes as `uint8`; raises if a scale is not one."""
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.view(torch.uint8)
    if scale.dtype == torch.uint8:
        return scale
    s = scale.float()
    mantissa, exponent = torch.frexp(s)  # s = mantissa * 2**exponent with mantissa in [0.5, 1)
    ok = (mantissa == 0.5) & (exponent - 1 >= -127) & (exponent - 1 <= 127)
    if not bool(ok.all()):
        raise ValueError("scales are not all powers of two in [2**-127, 2**127], so they have no UE8M0 byte")
    return (exponent - 1 + 127).to(torch.uint8)


def pow2_to_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Scales known to be powers of two in the UE8M0 range -> UE8M0 bytes (`uint8`), without checking
    (no host sync: usable inside a compiled step). `float_to_e8m0` is the checked form."""
    return (torch.log2(scale.float()).round() + 127).to(torch.uint8)


def pow2_at_least(ratio: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= ratio (1 where ratio is 0), clamped to the UE8M0 range."""
    exp = torch.ceil(torch.log2(ratio.clamp(min=2.0**-127))).clamp(-127, 127)
    return torch.where(ratio > 0, torch.exp2(exp), torch.ones_like(ratio))


def _block_view(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[out, in] padded with zeros to whole tiles, as [row_tiles, rows, col_tiles, cols]."""
    out, inn = t.shape
    pad = torch.nn.functional.pad(t, (0, -inn % cols, 0, -out % rows))
    return pad.unflatten(0, (-1, rows)).unflatten(-1, (-1, cols))


def dequant_fp8(weight: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """e4m3 weight [out, in] with one scale per block x block tile -> fp32 [out, in]."""
    s = e8m0_to_float(scale)
    out, inn = weight.shape
    s = s.repeat_interleave(block, 0)[:out].repeat_interleave(block, 1)[:, :inn]
    return weight.float() * s


def fp4_codes(packed: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 pairs [..., in/2] (int8 or uint8) -> codes [..., in] as int64, even elements from the low nibble."""
    b = packed.view(torch.uint8)
    return torch.stack(((b & 0x0F), (b >> 4)), dim=-1).flatten(-2).long()


def e2m1_table(device=None) -> torch.Tensor:
    """The value of each e2m1 code, [16] fp32 on `device` (`E2M1_VALUES`), decoded from the code's bits (sign
    bit 3, exponent bits 1-2, mantissa bit 0) as the Triton FP4 kernel decodes them. Computed where it is
    used rather than copied from a host constant: nothing made from host data, so a captured step can make it."""
    codes = torch.arange(16, device=device)
    mag = codes & 7
    exp = mag >> 1
    half = (mag & 1).float() * 0.5
    pow2 = (1 << (exp - 1).clamp(min=0)).float()  # 1, 1, 2, 4 for exponents 0..3
    val = torch.where(exp == 0, half, pow2 * (1.0 + half))
    return torch.where(codes >= 8, -val, val)


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    """e2m1 pairs packed [..., out, in/2] with one scale per `block` inputs [..., out, ceil(in/block)] -> fp32."""
    vals = e2m1_table(packed.device)[fp4_codes(packed)]  # [..., out, in]
    s = e8m0_to_float(scale).repeat_interleave(block, dim=-1)[..., : vals.shape[-1]]
    return vals * s


def quantize_fp8(weight: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (e4m3 weight, fp32 power-of-two scales [ceil(out/block), ceil(in/block)]).

    Each tile's scale is the smallest power of two that keeps its largest magnitude within 448.
    """
    out, inn = weight.shape
    tiles = _block_view(weight.float(), block, block)  # [rt, block, ct, block]
    scale = pow2_at_least(tiles.abs().amax(dim=(1, 3)) / FP8_MAX)  # [rt, ct]
    q = (tiles / scale[:, None, :, None]).flatten(2).flatten(0, 1)[:out, :inn]
    return q.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def encode_e2m1(values: torch.Tensor) -> torch.Tensor:
    """Floats already divided by their scale -> e2m1 codes (int64), round to nearest even, saturating at 6."""
    mag = values.abs()
    code = torch.zeros_like(mag, dtype=torch.long)
    for i, mid in enumerate(_E2M1_MIDPOINTS):
        # a tie goes to the even code of the two: up when the lower code i is odd
        code += (mag >= mid).long() if i % 2 else (mag > mid).long()
    return code | ((values < 0) & (code > 0)).long() << 3


def quantize_fp4(weight: torch.Tensor, block: int = FP4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., out, in] float (in even) -> (packed int8 [..., out, in/2], UE8M0 uint8 scales [..., out, ceil(in/block)]).

    Each group's scale is the smallest power of two that keeps its largest magnitude within 6 (no clipping).
    """
    inn = weight.shape[-1]
    if inn % 2:
        raise ValueError(f"FP4 packs two values per byte along the input axis; {inn} inputs is odd")
    w = torch.nn.functional.pad(weight.float(), (0, -inn % block)).unflatten(-1, (-1, block))  # [..., out, groups, block]
    scale = pow2_at_least(w.abs().amax(dim=-1) / FP4_MAX)  # [..., out, groups]
    codes = encode_e2m1(w / scale[..., None]).flatten(-2)[..., :inn]
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, pow2_to_e8m0(scale)


def quantize_act_fp8(x: torch.Tensor, group: int = FP8_BLOCK, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group activation quantization: x [tokens, k] -> (e4m3 [tokens, k], fp32 scales [tokens, ceil(k/group)]).

    A scale is the group's largest magnitude over 448 (a power of two with `pow2`, as UE8M0 scales are).
    Static shapes, no host syncs.
    """
    tokens, k = x.shape
    g = torch.nn.functional.pad(x.float(), (0, -k % group)).unflatten(-1, (-1, group))  # [tokens, groups, group]
    ratio = g.abs().amax(dim=-1) / FP8_MAX
    scale = pow2_at_least(ratio) if pow2 else torch.where(ratio > 0, ratio, torch.ones_like(ratio))
    q = (g / scale[..., None]).flatten(-2)[:, :k].clamp(-FP8_MAX, FP8_MAX)
    return q.to(torch.float8_e4m3fn), scale
