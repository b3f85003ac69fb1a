"""The host pool's device view on CUDA (`HostPool.on`): a CUDA tensor over the registered host memory, with no
copy, which the resolve and host-write kernels (the torch references and the Triton ones) index like device
memory, also inside a captured graph and under the capture guard. Needs a GPU; skipped without one."""

from __future__ import annotations

import pytest
import torch

from cachetier.host_pool import HostPool
from kernels.capture_guard import capture_guard
from kernels.host_write_ref import write_rows_ref
from kernels.resolve_ref import resolve_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(params=[torch.float32, torch.bfloat16, torch.uint8], ids=str)
def pool(request):
    p = HostPool(2, 4, 4, 6, request.param, pin=True)  # kv [2 layers, 16 rows, 6]
    p.kv.copy_((torch.arange(p.kv.numel()) % 251).view(p.kv.shape).to(request.param))
    yield p
    p.close()


def test_the_view_is_the_pool_memory(pool):
    view = pool.on("cuda")
    assert view.is_cuda and view.shape == pool.kv.shape and view.dtype == pool.kv.dtype and pool.on("cuda") is view
    assert torch.equal(view.cpu(), pool.kv)
    view[1, 3] = 9
    torch.cuda.synchronize()
    assert pool.kv[1, 3].tolist() == [9] * 6  # a device write lands in host memory
    pool.kv[0, 2] = 4
    assert view[0, 2].cpu().tolist() == [4] * 6  # and a host write is what the device reads


def test_host_write_reference_writes_through_the_view(pool):
    rows = torch.tensor([3, 14], device="cuda")
    values = torch.full((2, 6), 7, dtype=pool.kv.dtype, device="cuda")
    want = pool.kv.clone()
    want[1, [3, 14]] = 7
    with capture_guard("cuda"):
        write_rows_ref(pool.on("cuda"), 1, rows, values)
    torch.cuda.synchronize()
    assert torch.equal(pool.kv, want)


def _resolve_args(device, host_pool, lru=4, reserved=2):
    """One request, k = 3 ids: a ring hit and two misses copied in from host rows 11 and 3 of layer 0."""
    dim = host_pool.shape[-1]
    entry_map = torch.full((9,), -1, dtype=torch.int32)
    entry_map[7] = lru
    kw = dict(device=device)
    return dict(
        ids=torch.tensor([[5, 2, 7]], **kw), map_rows=torch.tensor([[5, 2, 7]], **kw), host_rows=torch.tensor([[11, 3, 8]], **kw),
        books=torch.tensor([0], **kw), hot_rows=torch.tensor([0], **kw), entry_map=entry_map.to(device),
        kv_pool=torch.zeros((lru + reserved + 1) * dim, dtype=host_pool.dtype, **kw),
        hot_entry_row=torch.full((2, lru + reserved), -1, **kw), hot_stamp=torch.full((2, lru), -1, **kw),
        host_pool=host_pool, step=torch.tensor(1, **kw), counters=torch.zeros(3, dtype=torch.long, **kw),
    )


def _state(args) -> dict:
    return {k: v.cpu() for k, v in args.items() if k in ("entry_map", "kv_pool", "hot_entry_row", "hot_stamp", "counters")}


def test_resolve_reference_reads_through_the_view_in_a_captured_graph(pool):
    ref = _resolve_args("cpu", pool.kv[0])
    want = resolve_ref(**ref)
    args = _resolve_args("cuda", pool.on("cuda")[0])
    fresh = {k: v.clone() for k, v in args.items() if k != "host_pool"}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), capture_guard("cuda"):
        resolve_ref(**args)  # warm-up (outside the capture), under the guard: nothing a graph cannot hold
    torch.cuda.current_stream().wait_stream(side)
    for k, v in fresh.items():
        args[k].copy_(v)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        slots = resolve_ref(**args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(slots.cpu(), want)
    got, exp = _state(args), _state(ref)
    assert all(torch.equal(got[k], exp[k]) for k in exp)


def test_resolve_triton_reads_through_the_view(pool):
    pytest.importorskip("triton")
    from kernels.resolve_triton import resolve_triton

    ref = _resolve_args("cpu", pool.kv[0])
    want = resolve_ref(**ref)
    args = _resolve_args("cuda", pool.on("cuda")[0])
    assert torch.equal(resolve_triton(**args).cpu(), want)
    got, exp = _state(args), _state(ref)
    assert all(torch.equal(got[k], exp[k]) for k in exp)
