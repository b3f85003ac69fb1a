"""Prefill sparse attention: the torch reference against dense masked attention, and the Triton kernel
against the reference.

Run as a script (`python test_prefill_attention_kernel.py out.pt`, under `TRITON_INTERPRET=1`), this
file runs every case through `prefill_attention_triton` and saves the outputs; see `conftest.py`.
"""

from __future__ import annotations

import sys

import pytest
import torch

from kernels.attention_ref import masked_attention_ref
from kernels.prefill_attention_ref import prefill_attention_ref


def _unique_rows(gen, queries: int, n: int, width: int, holes: float = 0.3) -> torch.Tensor:
    """[queries, width] distinct rows of a pool of n per query, about `holes` of them -1."""
    rows = torch.stack([torch.randperm(n, generator=gen)[:width] for _ in range(queries)])
    return torch.where(torch.rand(queries, width, generator=gen) < holes, -1, rows)


def _window_rows(queries: int, old: int, window: int) -> torch.Tensor:
    rows = torch.arange(queries)[:, None] + (old - window + 1) + torch.arange(window)
    return rows.masked_fill(rows < 0, -1)


def make_cases() -> dict[str, tuple]:
    """name -> (q, segments, prefix or None, sinks, scale); deterministic, so this process and the child agree."""
    cases = {}
    for name, heads, dim, queries, old, window, c4, n_prefix, seed in (
        ("sliding", 2, 16, 9, 3, 4, 0, 0, 0),
        ("csa", 3, 24, 11, 5, 6, 7, 0, 1),  # dim not a power of two
        ("hca", 4, 32, 10, 0, 5, 0, 70, 2),  # a prefix over several row blocks
        ("csa_and_prefix", 2, 16, 8, 4, 4, 5, 40, 3),
        ("more_queries_than_a_block", 2, 16, 300, 4, 4, 5, 50, 4),  # the reference attends 256 queries at a time
    ):
        gen = torch.Generator().manual_seed(seed)
        q = torch.randn(queries, heads, dim, generator=gen)  # [queries, heads, dim]
        segments = [(torch.randn(old + queries, dim, generator=gen), _window_rows(queries, old, window))]
        if c4:
            n = 3 * c4
            segments.append((torch.randn(n, dim, generator=gen), _unique_rows(gen, queries, n, c4)))
        prefix = None
        if n_prefix:
            counts = torch.linspace(0, n_prefix, queries).long()  # query 0 sees no entry at all
            prefix = (torch.randn(n_prefix, dim, generator=gen), counts)
        cases[name] = (q, segments, prefix, torch.randn(heads, generator=gen), dim**-0.5)

    gen = torch.Generator().manual_seed(10)
    q = torch.randn(4, 2, 16, generator=gen)
    rows = torch.full((4, 3), -1)
    rows[1:, 0] = torch.tensor([0, 1, 2])
    counts = torch.tensor([0, 0, 2, 3])  # query 0 has no key anywhere: the sink takes everything, output 0
    cases["query_without_keys"] = (q, [(torch.randn(3, 16, generator=gen), rows)], (torch.randn(3, 16, generator=gen), counts),
                                   torch.full((2,), 2.0), 0.25)
    return cases


CASES = make_cases()


def dense_equivalent(q, segments, prefix, sinks, scale):
    """The same attention as one masked softmax over [every pool], for the reference to be checked against."""
    pools, masks = [], []
    for pool, rows in segments:
        m = torch.zeros(q.shape[0], pool.shape[0] + 1, dtype=torch.bool)
        m.scatter_(1, torch.where(rows >= 0, rows, pool.shape[0]), True)
        pools.append(pool)
        masks.append(m[:, :-1])
    if prefix is not None:
        pool, counts = prefix
        pools.append(pool)
        masks.append(torch.arange(pool.shape[0])[None, :] < counts[:, None])
    return masked_attention_ref(q, torch.cat(pools), torch.cat(masks, dim=1), sinks, scale)


@pytest.mark.parametrize("tile", [1, 3, 512])
@pytest.mark.parametrize("name", list(CASES))
def test_reference_equals_dense_attention(name, tile):
    q, segments, prefix, sinks, scale = CASES[name]
    got = prefill_attention_ref(q, segments, prefix, sinks, scale, tile)
    want = dense_equivalent(q, segments, prefix, sinks, scale)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5), f"max abs diff {(got - want).abs().max().item():.3g}"
    assert want.abs().max() > 0.1


def test_reference_query_without_keys_is_zero():
    got = prefill_attention_ref(*CASES["query_without_keys"], tile=2)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    assert got[1:].abs().min() > 0


@pytest.mark.parametrize("name", list(CASES))
def test_triton_matches_reference(triton_outputs, name):
    q, segments, prefix, sinks, scale = CASES[name]
    want = prefill_attention_ref(q, segments, prefix, sinks, scale)
    got = triton_outputs[name]
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), f"max abs diff {(got - want).abs().max().item():.3g}"


def test_triton_query_without_keys_is_zero(triton_outputs):
    got = triton_outputs["query_without_keys"]
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    assert got[1:].abs().max() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(CASES))
def test_compiled_triton_matches_reference_on_cuda(name):
    from kernels.prefill_attention_triton import prefill_attention_triton

    q, segments, prefix, sinks, scale = CASES[name]
    want = prefill_attention_ref(q, segments, prefix, sinks, scale)
    cuda_prefix = None if prefix is None else (prefix[0].cuda(), prefix[1].cuda())
    got = prefill_attention_triton(q.cuda(), [(p.cuda(), r.cuda()) for p, r in segments], cuda_prefix, sinks.cuda(), scale)
    assert torch.allclose(got.cpu(), want, atol=1e-5, rtol=1e-5)


def _main(out: str) -> None:
    from conftest import kernel_or_exit

    prefill_attention_triton = kernel_or_exit("kernels.prefill_attention_triton", "prefill_attention_triton")
    torch.save({name: prefill_attention_triton(*case) for name, case in CASES.items()}, out)


if __name__ == "__main__":
    _main(sys.argv[1])
