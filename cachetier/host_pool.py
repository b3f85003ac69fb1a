"""The host pool: the authoritative copy of every C4 entry while a request decodes with the tier.

One preallocated region per process, sized in bytes, cut into blocks of `entries_per_block` C4
entries for every CSA layer; entry `e` of a request sits in its host block `e // entries_per_block`.
With CUDA the region is page-locked at its exact size (allocated as ordinary memory, then registered
with the driver) — torch's pinned caching allocator would round a large request up to a power of two.
Without CUDA it is ordinary pageable memory.

A decode step reads and writes the pool zero-copy through its *device view* (`HostPool.on`): on CUDA a
CUDA tensor over the registered memory's device address, so the step's kernels (Triton, or the torch
references) index it like device memory, with no copy and no sync; on the CPU the pool itself.
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch

from cachetier.geometry import block_rows
from core.configs import format_bytes

log = logging.getLogger(__name__)


class HostPoolTooLarge(MemoryError):
    pass


def available_ram_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else a sysconf estimate, else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


class HostPool:
    def __init__(self, num_layers: int, num_blocks: int, entries_per_block: int, dim: int, dtype: torch.dtype, pin: bool) -> None:
        self.num_blocks = num_blocks
        self.entries_per_block = entries_per_block
        self.dim = dim
        nbytes = num_layers * num_blocks * entries_per_block * dim * torch.empty((), dtype=dtype).element_size()
        self.nbytes = nbytes
        avail = available_ram_bytes()
        if avail is not None and nbytes > avail:
            raise HostPoolTooLarge(
                f"the host pool needs {format_bytes(nbytes)} but only {format_bytes(avail)} of RAM is available; "
                "lower --host-pool-bytes (or the device budget it defaults from)"
            )
        # [layers, rows, dim]: one contiguous row space per CSA layer so a layer's rows gather with one index
        self.kv = torch.empty(num_layers, num_blocks * entries_per_block, dim, dtype=dtype)
        self.pinned = False
        self._views: dict[torch.device, torch.Tensor] = {}
        if pin and nbytes:
            self._pin()

    def _pin(self) -> None:
        cudart = torch.cuda.cudart()
        rc = cudart.cudaHostRegister(self.kv.data_ptr(), self.nbytes, 0)
        if int(rc) != 0:
            raise HostPoolTooLarge(f"cudaHostRegister of {format_bytes(self.nbytes)} failed with code {int(rc)}; "
                                   "check the memlock limit (ulimit -l) or lower --host-pool-bytes")
        self.pinned = True
        log.info("pinned a %s host pool", format_bytes(self.nbytes))

    def on(self, device: torch.device | str) -> torch.Tensor:
        """`kv` as `device` addresses it: the pool itself on the CPU; on CUDA a CUDA tensor over the same memory
        (made once per device). Made outside the step (a view is built with its store's buffers)."""
        device = torch.device(device)
        if device.type == "cpu":
            return self.kv
        if device not in self._views:
            self._views[device] = self._device_view(device)
        return self._views[device]

    def _device_view(self, device: torch.device) -> torch.Tensor:
        if device.type != "cuda":
            raise ValueError(f"a host pool has no view on {device}")
        if not torch.cuda.is_available():
            # No CUDA runtime, so no memory to map: a CUDA device here is the capture guard's fake one, and a
            # stand-in of the same shape is all its (shape-only) tensors need.
            return torch.empty(self.kv.shape, dtype=self.kv.dtype, device=device)
        if not self.pinned:
            raise ValueError("only a pinned (registered) host pool is mapped into the device's address space")
        ptr = _device_pointer(self.kv.data_ptr())
        # [nbytes] uint8 over the pool's memory; torch finds the device from the pointer (no copy)
        raw = torch.as_tensor(_MappedBytes(ptr, self.nbytes))
        if raw.device.type != "cuda" or raw.data_ptr() != ptr:
            raise RuntimeError(f"the host pool's device view landed on {raw.device} at {raw.data_ptr():#x}, not at {ptr:#x}")
        return raw.view(self.kv.dtype).view(self.kv.shape)

    def close(self) -> None:
        self._views.clear()  # they address memory that is about to be unregistered
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.kv.data_ptr())
            self.pinned = False

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def rows(self, blocks: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """Host rows of entry ids (>= 0) given each request's host block table row: blocks[..., e // E] * E + e % E."""
        return block_rows(blocks, entries, self.entries_per_block)


class _MappedBytes:
    """`nbytes` bytes at device address `ptr`, as CUDA's array interface describes memory (torch wraps it without
    copying, keeping this object alive as long as the tensor)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}


def _device_pointer(host_ptr: int) -> int:
    """The device address of registered host memory, as the CUDA runtime gives it (cudaHostGetDevicePointer).
    With unified addressing (every 64-bit platform torch supports) it equals the host address, which is
    the answer too where torch's runtime library cannot be opened by name."""
    try:
        rt = ctypes.CDLL(f"libcudart.so.{torch.version.cuda.split('.')[0]}")
    except OSError:
        return host_ptr
    out = ctypes.c_void_p()
    rc = rt.cudaHostGetDevicePointer(ctypes.byref(out), ctypes.c_void_p(host_ptr), 0)
    if rc != 0:
        raise RuntimeError(f"cudaHostGetDevicePointer failed with code {rc}: is the host pool registered?")
    return out.value
