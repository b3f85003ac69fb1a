"""The capture guard (`kernels.capture_guard`) on fake CUDA tensors and on the CPU, and the pieces of the step it
made capture-safe: the e2m1 table and the Hadamard matrix built on the device, the host pool's device view,
and the resolve reference reading the pool through it."""

from __future__ import annotations

import pytest
import torch

from cachetier.host_pool import HostPool
from kernels import kv_format
from kernels.capture_guard import (
    DATA_SHAPE,
    DEVICE_READ,
    HOST_COPY,
    HOST_DATA,
    HOST_TENSOR,
    CaptureUnsafe,
    capture_guard,
    fake_cuda,
)
from kernels.formats import E2M1_VALUES, e2m1_table
from kernels.host_write_ref import write_rows_ref
from kernels.resolve_ref import HotState, resolve_ref


@pytest.fixture(scope="module")
def fake():
    return fake_cuda()


def _violations(fn, device="cuda", mapped=()):
    """What the guard reports for `fn()`: [(kind, op)], [] when it passes."""
    try:
        with capture_guard(device, mapped):
            fn()
    except CaptureUnsafe as err:
        return err.violations
    return []


def _kinds(violations):
    return [(v.kind, v.op) for v in violations]


def test_device_work_passes(fake):
    with fake:
        x = torch.randn(4, 8, device="cuda")
        idx = torch.tensor([3, 0], device="cuda")  # made before the region: fine
        reps = torch.tensor([1, 2, 0, 1], device="cuda")

        def step():
            y = (x @ x.T).relu()[idx]  # [2, 4]
            y.index_put_((torch.arange(2, device="cuda"),), torch.zeros(2, 4, device="cuda"))
            torch.where(y > 0, y, torch.full_like(y, -1.0)).topk(2, dim=-1)
            x.repeat_interleave(reps, dim=0, output_size=4)

        assert _violations(step) == []


def test_a_tensor_from_host_data_is_named_with_our_line(fake):
    with fake:
        x = torch.zeros(4, device="cuda")
        (v,) = _violations(lambda: x + torch.tensor([1.0, 2.0, 3.0, 4.0], device="cuda"))
    assert (v.kind, v.op) == (HOST_DATA, "aten.lift_fresh.default")
    assert v.where and v.where[-1].startswith("tests/unit/test_capture_guard.py:")
    assert "torch.tensor([1.0, 2.0, 3.0, 4.0]" in v.where[-1]


def test_copies_and_host_tensors_are_refused(fake):
    with fake:
        x = torch.zeros(4, device="cuda")
        host = torch.ones(4)
        assert _kinds(_violations(lambda: x.cpu())) == [(HOST_COPY, "aten._to_copy.default")]
        assert _kinds(_violations(lambda: host.to("cuda"))) == [(HOST_COPY, "aten._to_copy.default")]
        assert _kinds(_violations(lambda: x.copy_(host))) == [(HOST_COPY, "aten.copy_.default")]
        # a host tensor fed to a device op: refused, and the op itself fails on mixed devices
        assert _kinds(_violations(lambda: x + torch.arange(4))) == [(HOST_TENSOR, "aten.arange.default"),
                                                                    (HOST_TENSOR, "aten.add.Tensor")]


def test_host_reads_and_data_sized_allocations_are_refused(fake):
    with fake:
        x = torch.randn(6, device="cuda")
        reps = torch.ones(6, dtype=torch.long, device="cuda")
        for read in (lambda: x[0].item(), lambda: x.tolist(), lambda: bool(x[0] > 0)):
            assert DEVICE_READ in {v.kind for v in _violations(read)}
        for shaped, op in ((lambda: x.nonzero(), "aten.nonzero.default"), (lambda: x[x > 0], "aten.index.Tensor"),
                           (lambda: torch.unique(x), "aten._unique2.default"),
                           (lambda: x.repeat_interleave(reps), "aten.repeat_interleave.Tensor")):
            assert (DATA_SHAPE, op) in _kinds(_violations(shaped))


def test_one_report_per_site(fake):
    with fake:
        x = torch.zeros(2, device="cuda")

        def step():
            for _ in range(3):  # a step runs a layer's line once per layer
                x.add_(torch.tensor([1.0, 1.0], device="cuda"))

        assert len(_violations(step)) == 1


def test_mapped_host_memory_counts_as_device_memory(fake):
    with fake:
        pool = torch.zeros(8, 3)  # a real host tensor, as a registered pool is
        rows = torch.tensor([1, 5], device="cuda")
        assert _violations(lambda: pool[1:3].add_(1.0), mapped=[pool]) == []
        assert _kinds(_violations(lambda: pool[1:3].add_(1.0))) == [(HOST_TENSOR, "aten.slice.Tensor"),
                                                                    (HOST_TENSOR, "aten.add_.Tensor")]
        assert (HOST_COPY, "aten._to_copy.default") in _kinds(_violations(lambda: pool[rows.cpu()]))


def test_on_the_cpu_only_reads_data_and_shapes_are_refused():
    x = torch.randn(5)
    assert _violations(lambda: x * torch.arange(5), device="cpu") == []
    assert _kinds(_violations(lambda: x[0].item(), device="cpu")) == [(DEVICE_READ, "aten._local_scalar_dense.default")]
    assert _kinds(_violations(lambda: x.nonzero(), device="cpu")) == [(DATA_SHAPE, "aten.nonzero.default")]
    assert _kinds(_violations(lambda: torch.tensor([1.0]), device="cpu")) == [(HOST_DATA, "aten.lift_fresh.default")]


def test_fake_cuda_keeps_host_tensors_real(fake):
    with fake:
        host = torch.zeros(3, 2, dtype=torch.long, pin_memory=True)  # pinning needs CUDA: stays pageable here
        host.numpy()[1] = 7  # real memory behind it
        dev = host.to("cuda")
        assert type(host) is torch.Tensor and host[1].tolist() == [7, 7]
        assert type(dev) is not torch.Tensor and dev.device.type == "cuda"
        assert type(dev.cpu()) is not torch.Tensor  # a device value has no host value to copy back


# --- what the step builds on the device -------------------------------------------------------------------


def test_e2m1_table_is_the_code_table_and_needs_no_host_data(fake):
    t = e2m1_table()
    want = torch.tensor(E2M1_VALUES)
    assert torch.equal(t, want) and torch.equal(t.signbit(), want.signbit())  # -0.0 for code 8 too
    with fake:
        assert _violations(lambda: e2m1_table("cuda")) == []


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / n**0.5


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 32, 128, 512])
def test_hadamard_is_sylvester_and_builds_on_the_device(fake, n):
    assert torch.equal(kv_format.hadamard(n), _sylvester(n).float())
    assert torch.equal(kv_format.hadamard(n, dtype=torch.bfloat16), _sylvester(n).to(torch.bfloat16))
    with fake:
        assert _violations(lambda: kv_format.hadamard(n, "cuda")) == []
    assert all(type(h) is torch.Tensor for h in kv_format._HADAMARD.values())  # no fake tensor kept


def test_host_pool_device_view(fake):
    pool = HostPool(2, 3, 4, 5, torch.float32, pin=False)
    assert pool.on("cpu") is pool.kv
    with fake:
        view = pool.on("cuda")
        assert view.device.type == "cuda" and view.shape == pool.kv.shape and view.dtype == pool.kv.dtype
        assert pool.on(torch.device("cuda")) is view


def _resolve_case(device):
    """One layer, one request: k = 3 ids (one hit in the ring, two misses), lru = 4, rows of dim 2."""
    dim, lru, reserved = 2, 4, 2
    host = torch.arange(40, dtype=torch.float32).view(20, dim)  # [host rows, dim]
    entry_map = torch.full((9,), -1, dtype=torch.int32)
    entry_map[7] = lru  # map row 7 sits in ring slot 0
    kw = dict(device=device)
    return dict(
        ids=torch.tensor([[5, 2, 7]], **kw), map_rows=torch.tensor([[5, 2, 7]], **kw), host_rows=torch.tensor([[11, 3, 8]], **kw),
        books=torch.tensor([0], **kw), hot_rows=torch.tensor([0], **kw), entry_map=entry_map.to(device),
        kv_pool=torch.zeros((lru + reserved + 1) * dim, **kw), hot_entry_row=torch.full((2, lru + reserved), -1, **kw),
        hot_stamp=torch.full((2, lru), -1, **kw), host_pool=host, step=torch.tensor(1, **kw),
        counters=torch.zeros(3, dtype=torch.long, **kw),
    )


def _resolve(case: dict) -> torch.Tensor:
    state = HotState(*(case[k] for k in ("entry_map", "hot_entry_row", "hot_stamp", "host_pool", "step", "counters")))
    return resolve_ref(*(case[k] for k in ("ids", "map_rows", "host_rows", "books", "hot_rows", "kv_pool")), state)


def test_resolve_reads_the_pool_through_its_device_view(fake):
    ref = _resolve_case("cpu")
    slots = _resolve(ref)
    assert slots.tolist() == [[0, 1, 4]] and ref["counters"].tolist() == [1, 2, 0]
    assert ref["kv_pool"].view(-1, 2)[:2].tolist() == [[22.0, 23.0], [6.0, 7.0]]  # host rows 11 and 3
    with fake:
        case = _resolve_case("cuda")
        host = case["host_pool"]
        assert _violations(lambda: _resolve(case)) != []  # the host tensor itself: read there, copied back
        case = _resolve_case("cuda")
        case["host_pool"] = torch.empty(host.shape, device="cuda")  # stands for HostPool.on("cuda")
        assert _violations(lambda: _resolve(case)) == []
        rows = torch.tensor([4, 0], device="cuda")
        assert _violations(lambda: write_rows_ref(torch.empty(2, 6, 3, device="cuda"), 1, rows, torch.ones(2, 3, device="cuda"))) == []
