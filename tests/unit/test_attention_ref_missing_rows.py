"""The attention reference reads a missing row (-1) as zeros, whatever bytes pool row 0 holds (the kernels' masked
loads read 0 there too): in a packed arena row 0 may be another field's bytes, which can decode to NaN."""

from __future__ import annotations

import torch

from kernels.attention_ref import sparse_attention_ref
from kernels.kv_format import KVCodec


def test_a_missing_row_never_reads_pool_row_zero():
    gen = torch.Generator().manual_seed(0)
    codec = KVCodec("v4", 128, 16, 32, torch.float32)
    pool = codec.pack_main(torch.randn(10, 128, generator=gen))  # [rows, 152] bytes
    assert not codec.main_reader(torch.full_like(pool[:1], 0x7F)).isfinite().all()  # e4m3 0x7f is NaN
    q = torch.randn(2, 4, 128, generator=gen)
    sinks = torch.randn(4, generator=gen)
    rows = torch.tensor([[3, 5, -1, -1], [7, -1, 2, -1]])
    hca = torch.tensor([[9, -1], [-1, -1]])  # a segment with nothing in one row
    clean = sparse_attention_ref(q, [(pool, rows), (pool, hca)], sinks, 128**-0.5, codec.main_reader)
    poisoned = pool.clone()
    poisoned[0] = 0x7F  # bytes of something else that decode to NaN
    got = sparse_attention_ref(q, [(poisoned, rows), (poisoned, hca)], sinks, 128**-0.5, codec.main_reader)
    assert got.isfinite().all()
    assert torch.equal(got, clean)
