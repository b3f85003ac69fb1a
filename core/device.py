"""The one place that decides where tensors live and which kernels run.

CUDA when present: device tensors on the GPU, the host pool in pinned memory, Triton kernels.
Otherwise the CPU: the "device" is ordinary memory held to the same byte budget, the host pool is
pageable, and the torch reference kernels run. `HISPARSE_DEVICE=cpu` forces the CPU path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache


@dataclass(frozen=True)
class DeviceInfo:
    kind: str
    """`cuda` or `cpu`."""
    pin_host_memory: bool
    """Whether the host pool is page-locked (only meaningful with CUDA)."""
    use_triton: bool
    """Whether kernels dispatch to Triton rather than the torch reference."""

    @property
    def torch_device(self):
        import torch

        return torch.device(self.kind)


def _triton_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


@cache
def _detect(forced: str | None) -> DeviceInfo:
    import torch

    cuda = torch.cuda.is_available() and forced != "cpu"
    if forced == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("HISPARSE_DEVICE=cuda was asked for but torch sees no CUDA device")
    if cuda:
        return DeviceInfo(kind="cuda", pin_host_memory=True, use_triton=_triton_importable())
    return DeviceInfo(kind="cpu", pin_host_memory=False, use_triton=False)


def current() -> DeviceInfo:
    """The device this process computes on (cached; reads `HISPARSE_DEVICE` once per value)."""
    return _detect(os.environ.get("HISPARSE_DEVICE") or None)
