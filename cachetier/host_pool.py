"""The host pool: the authoritative copy of every C4 entry while a request decodes with the tier.

One preallocated region per process, sized in bytes, cut into blocks of `entries_per_block` C4
entries for every CSA layer; entry `e` of a request sits in its host block `e // entries_per_block`.
With CUDA the region is page-locked at its exact size (allocated as ordinary memory, then registered
with the driver) — torch's pinned caching allocator would round a large request up to a power of two.
Without CUDA it is ordinary pageable memory.
"""

from __future__ import annotations

import logging
import os

import torch

from cachetier.geometry import block_rows
from core.roles import format_bytes

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

    def close(self) -> None:
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
