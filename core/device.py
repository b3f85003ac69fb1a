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


DTYPES = ("auto", "bfloat16", "float32")
"""Serving dtypes (`--dtype`): what the model computes in and stores unquantized KV rows as."""


def serving_dtype(name: str = "auto", kind: str | None = None):
    """The torch dtype of `--dtype name` on a device of this kind: `auto` is bf16 on CUDA (tensor cores, the
    packed FP8/FP4 kernels' bf16 path, half the KV bytes) and fp32 on the CPU (where bf16 arithmetic is slower)."""
    import torch

    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {DTYPES}")
    if name == "auto":
        return torch.bfloat16 if (kind or current().kind) == "cuda" else torch.float32
    return getattr(torch, name)


def configure_math(kind: str | None = None) -> None:
    """Process-wide math settings for serving on this device: on CUDA, fp32 matmuls may use TF32 tensor
    cores (what is left in fp32 in a bf16 model — the indexer's scores, the router — and an fp32 model)."""
    import torch

    if (kind or current().kind) == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
