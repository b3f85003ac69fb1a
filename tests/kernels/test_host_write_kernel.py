"""Writing emitted C4 entries into the host pool: the Triton kernel against the torch reference.

Run as a script (`python test_host_write_kernel.py out.pt`, under `TRITON_INTERPRET=1`), this file
runs every case through `write_rows_triton` and saves the pools; see `conftest.py` for why.
"""

from __future__ import annotations

import sys

import pytest
import torch

from kernels.host_write_ref import write_rows_ref


def make_cases() -> dict[str, tuple]:
    """name -> (pool, layer, rows, values); the pool is written in place, so each run gets a clone."""
    gen = torch.Generator().manual_seed(0)
    cases = {}
    for name, layers, n_rows, dim, rows, dtype in (
        ("one_row", 2, 9, 6, [4], torch.float32),
        ("scattered_rows_layer_1", 3, 40, 20, [3, 0, 39, 17], torch.float32),
        ("wide_rows_bf16_pool", 2, 12, 300, [11, 2, 5], torch.bfloat16),  # past the kernel's 256-wide block
    ):
        pool = torch.randn(layers, n_rows, dim, generator=gen).to(dtype)  # [layers, rows, dim]
        values = torch.randn(len(rows), dim, generator=gen).to(dtype)  # [n, dim]; entries come in the pool's dtype
        cases[name] = (pool, layers - 1, torch.tensor(rows), values)
    return cases


CASES = make_cases()


def _run(fn, case) -> torch.Tensor:
    pool, layer, rows, values = case
    pool = pool.clone()
    fn(pool, layer, rows, values)
    return pool


def test_reference_writes_only_the_named_rows():
    pool, layer, rows, values = CASES["scattered_rows_layer_1"]
    got = _run(write_rows_ref, CASES["scattered_rows_layer_1"])
    assert torch.equal(got[layer, rows], values)
    untouched = torch.ones(pool.shape[:2], dtype=torch.bool)
    untouched[layer, rows] = False
    assert torch.equal(got[untouched], pool[untouched])


@pytest.mark.parametrize("name", list(CASES))
def test_triton_matches_reference(triton_outputs, name):
    assert torch.equal(triton_outputs[name], _run(write_rows_ref, CASES[name]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(CASES))
def test_triton_writes_pinned_host_memory_on_cuda(name):
    from kernels.host_write_triton import write_rows_triton

    pool, layer, rows, values = CASES[name]
    pinned = pool.clone().pin_memory()
    write_rows_triton(pinned, layer, rows.cuda(), values.cuda())
    torch.cuda.synchronize()
    assert torch.equal(pinned, _run(write_rows_ref, CASES[name]))


def _main(out: str) -> None:
    from conftest import kernel_or_exit

    write_rows_triton = kernel_or_exit("kernels.host_write_triton", "write_rows_triton")
    torch.save({name: _run(write_rows_triton, case) for name, case in CASES.items()}, out)


if __name__ == "__main__":
    _main(sys.argv[1])
