"""A guard for code that must fit in a CUDA graph (the fixed-shape decode step), real on a machine without a GPU.

A captured graph replays device work only. Inside the region it guards, this refuses, naming the op and
the lines of this project that called it:
- `HOST_DATA`: a tensor made from host data (`torch.tensor(list)`, `torch.as_tensor(array)`: the
  `aten.lift_fresh*` ops). On CUDA that is a pageable copy and a sync; in a graph, a value frozen at capture.
- `HOST_COPY`: a copy between host and device memory (`.cpu()`, `.to("cuda")` of a host tensor, `copy_`
  across them); `HOST_TENSOR`: any other op on host memory (a factory without `device=`, a host tensor
  fed to a device op). Host work runs once at capture and never on replay. Host memory mapped into the
  device's address space for zero-copy access counts as device memory: the step reads the host pool
  through its device view (`cachetier.host_pool.HostPool.on`, a CUDA tensor), and a registered host
  tensor handed to a kernel as it is can be named in `mapped`.
- `DEVICE_READ`: a read of device values on the host (`.item()`, `.tolist()`, `bool(t)`, `torch.equal`).
- `DATA_SHAPE`: an allocation whose size depends on values (`nonzero`, `masked_select`, boolean-mask
  indexing, `unique`, `repeat_interleave` without `output_size`, ...): a sync to learn the size.
The host checks apply when the step's `device` is not the CPU; the other two everywhere (a compiled CPU
step has the same rules: `fullgraph=True` refuses them as graph breaks).

Without a GPU the step runs on *fake* CUDA tensors (`fake_cuda()`: PyTorch's FakeTensorMode, which
computes shapes, dtypes and devices but no values), so a model and a store built on fake `cuda` take the
CUDA branches of our code, and the guard sees every aten op they issue. On a CUDA device the guard runs
over real tensors as it is (and asks CUDA to raise on synchronising calls too).

What it cannot see: Triton launches (not aten ops: their grids come from shapes, and on a machine
without CUDA the kernels' dispatchers pick the torch references, which is what gets checked here),
kernels' own host logic (pointer checks, autotuning), and host work that touches no tensor. Fake tensors
have no values, so the guard checks structure; a value frozen into a graph by a Python number computed
from host state is out of its reach too.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import tempfile
import threading
import traceback
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode, is_fake
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

HOST_DATA = "tensor made from host data"
HOST_COPY = "copy between host and device"
HOST_TENSOR = "op on host memory"
DEVICE_READ = "device value read on the host"
DATA_SHAPE = "allocation sized by data"

_REPO = Path(__file__).resolve().parents[1]
_HERE = str(Path(__file__).resolve())
_STACK_DEPTH = 6
"""Frames of our own code shown per violation, innermost last."""

_aten = torch.ops.aten
_LIFTS = {_aten.lift_fresh.default, _aten.lift_fresh_copy.default}
_COPIES = {_aten._to_copy.default, _aten.copy_.default, _aten.copy.default, _aten._copy_from.default,
           _aten._copy_from_and_resize.default, _aten.to.device, _aten.to.dtype_layout, _aten.to.other}
"""Ops that copy between tensors (`to` itself reaches the dispatcher under inference mode)."""
_HOST_READS = {_aten.equal.default, _aten.is_nonzero.default}
"""Ops that return a Python value computed from a tensor's data, beside those tagged `data_dependent_output`."""
_INDEXING = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default, _aten._index_put_impl_.default}
_METADATA = {torch.ops.prim.device.default}
"""Ops that read a tensor's metadata, never its memory."""
_SYNC_REFUSED = "synchronizing CUDA operation"
"""What CUDA's sync debug mode says when it refuses a call."""


def _tensors(*trees):
    """The tensors among an op's arguments or results (at most one list deep, as aten signatures go)."""
    for tree in trees:
        for a in tree.values() if isinstance(tree, dict) else tree if isinstance(tree, (list, tuple)) else (tree,):
            if isinstance(a, torch.Tensor):
                yield a
            elif isinstance(a, (list, tuple)):
                yield from (t for t in a if isinstance(t, torch.Tensor))


@dataclass(frozen=True)
class Violation:
    kind: str
    op: str
    where: tuple[str, ...]
    """`path:line in function: source` of our code, innermost last."""

    def __str__(self) -> str:
        lines = "".join(f"\n    {w}" for w in self.where) or "\n    (no frame of this project on the stack)"
        return f"{self.op}: {self.kind}, from{lines}"


class CaptureUnsafe(RuntimeError):
    """Code inside a guarded region did something a CUDA graph cannot hold."""

    def __init__(self, violations: list[Violation]) -> None:
        self.violations = list(violations)
        body = "\n".join(f"- {v}" for v in self.violations)
        super().__init__(f"{len(self.violations)} op(s) a CUDA graph cannot hold ran in the guarded region:\n{body}")


def _our_frames() -> tuple[str, ...]:
    out = []
    for f in traceback.extract_stack():
        path = Path(f.filename)
        if f.filename == _HERE or "site-packages" in f.filename or not path.is_relative_to(_REPO):
            continue
        out.append(f"{path.relative_to(_REPO)}:{f.lineno} in {f.name}: {(f.line or '').strip()}")
    return tuple(out[-_STACK_DEPTH:])


def _data_shaped(func, args, kwargs) -> bool:
    """Whether `func` sizes its output from values: tagged so, unless its arguments pin the size."""
    if func in _INDEXING:  # data-dependent only with boolean masks (they become `nonzero`)
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)
    if torch.Tag.dynamic_output_shape not in func.tags:
        return False
    if func is _aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    if func is _aten.one_hot.default:
        return (args[1] if len(args) > 1 else kwargs.get("num_classes", -1)) < 0
    return True


class CaptureGuard(TorchDispatchMode):
    """The dispatch mode behind `capture_guard`: records every op that a graph on `device` cannot hold."""

    def __init__(self, device: torch.device | str, mapped: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.guard_host = torch.device(device).type != "cpu"
        self._mapped = {StorageWeakRef(t.untyped_storage()) for t in mapped}
        self.violations: list[Violation] = []
        self._seen: set[tuple[str, str, tuple[str, ...]]] = set()
        self._lifted: dict[int, weakref.ref] = {}
        """Host tensors `torch.tensor(...)` made here (by id): their copy to the device is the same violation."""

    def _record(self, kind: str, func) -> None:
        where = _our_frames()
        key = (kind, str(func), where)
        if key not in self._seen:  # a step runs the same line once per layer: one report per site
            self._seen.add(key)
            self.violations.append(Violation(kind, str(func), where))

    def _on_host(self, tensors) -> bool:
        return any(t.device.type == "cpu" and not self._was_lifted(t) and StorageWeakRef(t.untyped_storage()) not in self._mapped
                   for t in tensors)

    def _was_lifted(self, t: torch.Tensor) -> bool:
        ref = self._lifted.get(id(t))
        return ref is not None and ref() is t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            return func(*args, **kwargs)
        host_in = self.guard_host and self._on_host(_tensors(args, kwargs))
        flagged = True
        if func in _LIFTS:
            self._record(HOST_DATA, func)
        elif func in _HOST_READS or torch.Tag.data_dependent_output in func.tags:
            self._record(DEVICE_READ, func)
        elif _data_shaped(func, args, kwargs):
            self._record(DATA_SHAPE, func)
        elif host_in:
            self._record(HOST_COPY if func in _COPIES else HOST_TENSOR, func)
        else:
            flagged = False
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            # fake tensors cannot go on past a value they do not have: report what was found so far
            self._record(DEVICE_READ if func in _HOST_READS else DATA_SHAPE, func)
            raise CaptureUnsafe(self.violations) from None
        except Exception as exc:
            if not flagged and _SYNC_REFUSED in str(exc):  # on CUDA: the runtime refused a sync (see `capture_guard`)
                self._record(DEVICE_READ, func)
                flagged = True
            if flagged:  # (mixing host and device tensors fails outright, on fake tensors as on CUDA)
                raise CaptureUnsafe(self.violations) from exc
            raise
        if func in _LIFTS:
            self._lifted.update((id(t), weakref.ref(t)) for t in _tensors(out))
        elif not flagged and self.guard_host and self._on_host(_tensors(out)):  # made on, or copied to, the host
            self._record(HOST_COPY if func in _COPIES else HOST_TENSOR, func)
        return out


@contextmanager
def capture_guard(device: torch.device | str = "cuda", mapped: Iterable[torch.Tensor] = ()) -> Iterator[CaptureGuard]:
    """Run the body as a graph on `device` would have to run it; raise `CaptureUnsafe` listing every op it
    could not hold (at the end, or at the first value a fake tensor does not have). `mapped`: host tensors
    the device reads and writes zero-copy (registered and mapped), which count as device memory. On a real
    CUDA device the runtime is also told to refuse synchronising calls (`torch.cuda.set_sync_debug_mode`),
    which catches syncs inside ops the dispatch mode sees only as a whole."""
    guard = CaptureGuard(device, mapped)
    strict_sync = guard.guard_host and torch.device(device).type == "cuda" and torch.cuda.is_available()
    before = torch.cuda.get_sync_debug_mode() if strict_sync else 0
    if strict_sync:
        torch.cuda.set_sync_debug_mode("error")
    try:
        with guard:
            yield guard
    finally:
        if strict_sync:
            torch.cuda.set_sync_debug_mode(before)
    if guard.violations:
        raise CaptureUnsafe(guard.violations)


# --- fake CUDA tensors on a machine without CUDA ------------------------------------------------------

# Python indexing (`t[i]`, `t[mask] = v`) takes a device guard for the tensor's device in C++. A CPU-only
# build of torch has none for CUDA, so indexing a fake CUDA tensor fails there (FakeTensorMode installs
# torch's no-op guard itself only on CUDA builds without a device). This registers the same no-op guard.
_GUARD_SOURCE = """
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>
namespace {
const c10::impl::FakeGuardImpl<c10::DeviceType::CUDA> no_op_cuda_guard;
struct Install {
  Install() {
    auto& slot = c10::impl::device_guard_impl_registry[static_cast<size_t>(c10::DeviceType::CUDA)];
    if (slot.load() == nullptr) c10::impl::registerDeviceGuard(c10::DeviceType::CUDA, &no_op_cuda_guard);
  }
} install;
}
"""
_guard_lock = threading.Lock()
_guard_lib: ctypes.CDLL | None = None


def _install_cuda_device_guard() -> None:
    """Give a CPU-only torch a no-op CUDA device guard (compiled once per torch version, a second or two)."""
    global _guard_lib
    with _guard_lock:
        if _guard_lib is not None or torch.backends.cuda.is_built():
            return
        from torch.utils.cpp_extension import include_paths, library_paths

        lib_dir = library_paths()[0]
        out = Path(tempfile.gettempdir()) / f"hisparse-fake-cuda-guard-{torch.__version__}-{os.getuid()}.so"
        if not out.exists():
            src = out.with_suffix(f".{os.getpid()}.cpp")
            src.write_text(_GUARD_SOURCE)
            tmp = out.with_suffix(f".{os.getpid()}.so")
            cmd = [os.environ.get("CXX", "c++"), "-std=c++17", "-O1", "-shared", "-fPIC",
                   *(f"-I{p}" for p in include_paths()), str(src), f"-L{lib_dir}", "-lc10", f"-Wl,-rpath,{lib_dir}",
                   "-o", str(tmp)]
            try:
                subprocess.run(cmd, check=True, capture_output=True, text=True)
            except (OSError, subprocess.CalledProcessError) as exc:
                detail = getattr(exc, "stderr", "") or str(exc)
                raise RuntimeError(f"fake CUDA tensors on a CPU-only torch need a C++ compiler for a no-op device "
                                   f"guard; building it failed:\n{detail[-2000:]}") from exc
            finally:
                src.unlink(missing_ok=True)
            os.replace(tmp, out)  # atomic: racing processes build the same file
        _guard_lib = ctypes.CDLL(str(out))


class _FakeDevice(FakeTensorMode):
    """Fake tensors for the device, real ones for the host: an op on host memory alone (real CPU tensors, or a
    factory for the CPU) runs for real, so host bookkeeping (NumPy views of staging buffers, the host pool,
    prefilled layouts) keeps its values; anything that touches the device is fake. Pinning needs a CUDA
    driver, so host memory made here stays pageable (pinning changes speed, not structure)."""

    _depth = 0  # > 0 while the fake mode itself runs an op (its decompositions dispatch again, and stay fake)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._depth:
            return super().__torch_dispatch__(func, types, args, kwargs)
        tensors = list(_tensors(args, kwargs))
        real = [t for t in tensors if not is_fake(t)]
        if len(real) == len(tensors) and all(t.device.type == "cpu" for t in real) and not self._names_device(args, kwargs):
            if func is _aten._pin_memory.default:
                return args[0].clone()
            if kwargs.get("pin_memory"):
                kwargs = {**kwargs, "pin_memory": False}
            return func(*args, **kwargs)
        if real:  # real inputs of a device op become fake first (else the mode may run the op for real)
            args, kwargs = tree_map_only(torch.Tensor, lambda t: t if is_fake(t) else self.from_tensor(t), (args, kwargs))
        self._depth += 1
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self._depth -= 1

    @staticmethod
    def _names_device(args, kwargs) -> bool:
        """Whether an op is asked for a device other than the CPU (`to(device)` passes it positionally)."""
        device = kwargs.get("device")
        if device is not None and torch.device(device).type != "cpu":
            return True
        return any(isinstance(a, torch.device) and a.type != "cpu" for a in args)


def fake_cuda() -> FakeTensorMode:
    """A FakeTensorMode in which device tensors live on a fake `cuda` device, on any machine, while host
    tensors stay real (see `_FakeDevice`).

    Real tensors are accepted as inputs of device ops (they become fake ones), so a model built and filled
    on the CPU moves onto the fake device with `.to("cuda")` inside the mode. Enter one mode around
    building, admitting and stepping: fake tensors belong to the mode that made them."""
    _install_cuda_device_guard()
    return _FakeDevice(allow_non_fake_inputs=True)


