"""KV storage formats: exact row sizes, round-trip error bounds, the dense fake-quant equals pack/unpack."""

import pytest
import torch

from core.kv_format import fp4_key_bytes, fp8_main_row_bytes, index_key_bytes, main_row_bytes
from kernels.kv_format import KVCodec, hadamard, pack_fp4_keys, pack_fp8_rows, unpack_fp4_keys, unpack_fp8_rows
from model.builtin import tiny_config


def test_row_bytes_at_v4_dims():
    assert fp8_main_row_bytes(512, 64) == 584  # 448 e4m3 + 128 bf16 rope + 7 scales + 1 pad
    assert fp4_key_bytes(128) == 68  # 64 packed pairs + 4 scales
    assert main_row_bytes(512, 64, "bf16", 2) == 1024 and index_key_bytes(128, "bf16", 2) == 256
    assert main_row_bytes(512, 64, "v4", 2) == 584 and index_key_bytes(128, "v4", 4) == 68
    with pytest.raises(ValueError):
        main_row_bytes(512, 64, "fp8", 2)


def test_packed_shapes_match_the_byte_rule():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 512)
    b = pack_fp8_rows(x, 64)
    assert b.dtype == torch.uint8 and b.shape == (3, 5, 584)
    k = pack_fp4_keys(torch.randn(7, 128))
    assert k.dtype == torch.uint8 and k.shape == (7, 68)
    assert pack_fp8_rows(torch.zeros(0, 512), 64).shape == (0, 584) and pack_fp4_keys(torch.zeros(0, 128)).shape == (0, 68)
    cfg = tiny_config()
    codec = KVCodec.for_model(cfg, "v4", torch.float32)
    assert codec.pack_main(torch.randn(2, cfg.head_dim)).shape[-1] == codec.main_bytes == fp8_main_row_bytes(
        cfg.head_dim, cfg.rope_head_dim)
    assert codec.pack_index(torch.randn(2, cfg.index_head_dim)).shape[-1] == codec.index_bytes


def test_fp8_row_round_trip_error_bound():
    torch.manual_seed(1)
    x = torch.randn(64, 512) * torch.logspace(-3, 3, 64)[:, None]  # rows of very different magnitudes
    y = unpack_fp8_rows(pack_fp8_rows(x, 64), 512, 64, torch.float32)
    nope, rope = slice(0, 448), slice(448, 512)
    # e4m3 keeps 3 mantissa bits: relative error <= 2**-4 for normal values, plus the subnormal step of the
    # block (scale * 2**-9) for small ones
    blocks = x[:, nope].abs().unflatten(-1, (7, 64)).amax(-1)
    scale = torch.exp2(torch.ceil(torch.log2(blocks / 448))).repeat_interleave(64, -1)
    err = (y[:, nope] - x[:, nope]).abs()
    assert bool((err <= x[:, nope].abs() * 2**-4 + scale * 2**-9).all())
    assert torch.equal(y[:, rope], x[:, rope].to(torch.bfloat16).float())  # rope channels: bf16 rounding only
    # zero rows survive, and re-packing a decoded row is exact (the format is idempotent)
    z = unpack_fp8_rows(pack_fp8_rows(torch.zeros(2, 512), 64), 512, 64, torch.float32)
    assert torch.equal(z, torch.zeros(2, 512))
    assert torch.equal(unpack_fp8_rows(pack_fp8_rows(y, 64), 512, 64, torch.float32), y)


def test_fp4_key_round_trip_error_bound():
    torch.manual_seed(2)
    x = torch.randn(256, 128)
    h = hadamard(128)
    assert torch.allclose(h @ h.T, torch.eye(128), atol=1e-6)
    y = unpack_fp4_keys(pack_fp4_keys(x), 128, torch.float32)  # in the rotated space
    r = x @ h
    blocks = r.abs().unflatten(-1, (4, 32)).amax(-1)
    scale = torch.exp2(torch.ceil(torch.log2(blocks / 6))).repeat_interleave(32, -1)
    # e2m1 values are at most 2 apart (4 -> 6) in scaled units: the rounding error is at most half that step
    assert bool(((y - r).abs() <= scale * 1.0 + 1e-7).all())
    rel = (y - r).norm() / r.norm()
    assert 0.02 < float(rel) < 0.2  # MXFP4 is coarse, but far from noise


def test_codec_bf16_is_the_identity_and_fake_equals_pack_unpack():
    cfg = tiny_config()
    torch.manual_seed(3)
    x, k = torch.randn(4, cfg.head_dim), torch.randn(4, cfg.index_head_dim)
    plain = KVCodec.for_model(cfg, "bf16", torch.float32)
    assert not plain.packed and plain.main_bytes == 4 * cfg.head_dim
    assert torch.equal(plain.fake_main(x), x) and torch.equal(plain.fake_index(k), k)
    v4 = KVCodec.for_model(cfg, "v4", torch.float32)
    assert torch.equal(v4.fake_main(x), v4.unpack_main(v4.pack_main(x)))
    assert torch.equal(v4.fake_index(k), v4.unpack_index(v4.pack_index(k)))
    # queries get the keys' rotation: scores in the rotated space approximate the unrotated ones
    q = torch.randn(4, cfg.index_head_dim)
    exact = q @ k.T
    approx = v4.index_query(q) @ v4.fake_index(k).T
    assert float((approx - exact).norm() / exact.norm()) < 0.3
    assert not torch.equal(approx, exact)
