"""The HiSparse tier's resolve on a GPU: time per CSA layer at chosen miss rates (prints one JSON object).

    python -m bench.tier_gpu [--batch 64] [--iters 20] [--rates 0,0.134,1]

One CSA layer's resolve at V4-Flash's shapes: batch 64, top-512, 2 x 512 LRU slots plus the reserved ring,
584-byte v4 rows in a registered `HostPool` read through its device view (as a decode step reads them).
Each miss rate is a prepared hot buffer and one selection per row with exactly round(rate x k) ids not
resident: below 1 the buffer is full (every miss evicts), at 1 it is cold (admission: nothing resident,
nothing evicted). Per rate: the Triton kernel's and the torch reference's device time per call (CUDA
events around the call alone, the state restored before each; median), the kernel's time over V4-Flash's
21 CSA layers, and whether kernel and reference left the same slots and state.

`resolve_per_layer(device, small)` is the part another script (gpu_check) calls. Without CUDA nothing is
timed: it runs the kernel at cut shapes, which needs the Triton interpreter (`TRITON_INTERPRET=1` in the
environment before any kernel module is imported; `main` sets it), and reports equality only.
"""

from __future__ import annotations

import argparse
import os

import torch

from bench.common import emit, environment
from bench.tier import PUBLISHED_LRU_MISS
from cachetier.host_pool import HostPool
from core.configs import TierConfig
from core.kv_format import fp8_main_row_bytes
from core.presets import V4_FLASH
from kernels.resolve_ref import HotState

RATES = (0.0, PUBLISHED_LRU_MISS["2k"], 1.0)
"""0%, the published LRU miss rate with 2k slots (13.4%), and a cold buffer."""


def _shapes(batch: int | None, small: bool) -> dict:
    if small:
        return {"batch": batch or 2, "k": 32, "lru": 64, "reserved": 4, "dim": 24}
    k = V4_FLASH.index_topk
    return {"batch": batch or 64, "k": k, "lru": 2 * k, "reserved": TierConfig.reserved_slots,
            "dim": fp8_main_row_bytes(V4_FLASH.head_dim, V4_FLASH.rope_head_dim)}


def _prepared(shape: dict, rate: float, seed: int) -> tuple[dict, list[torch.Tensor], int]:
    """A hot buffer per row (book b = row b, one scratch book last) and a selection with round(rate * k) misses.

    Request r's entry e is map row r * entries + e and host row the same; below rate 1 the LRU slots hold
    entries 0..lru-1 (shuffled) with distinct stamps below the step, so the step's misses evict."""
    batch, k, lru, reserved, dim = shape["batch"], shape["k"], shape["lru"], shape["reserved"], shape["dim"]
    entries = lru + k
    slots = lru + reserved
    gen = torch.Generator().manual_seed(seed)
    st = {
        "entry_map": torch.full((batch * entries + 1,), -1, dtype=torch.int32),
        "kv": torch.zeros((batch + 1) * slots * dim, dtype=torch.uint8),
        "entry_row": torch.full((batch + 1, slots), -1, dtype=torch.int64),
        "stamp": torch.full((batch + 1, lru), -1, dtype=torch.int64),
        "counters": torch.zeros(3, dtype=torch.int64),
    }
    misses = round(rate * k)
    cold = misses == k
    step = lru + 1
    ids = []
    for r in range(batch):
        if cold:
            ids.append(torch.randperm(entries, generator=gen)[:k])
            continue
        held = torch.randperm(lru, generator=gen)  # [lru], slot s holds entry held[s]
        st["entry_row"][r, :lru] = r * entries + held
        st["entry_map"][r * entries + held] = torch.arange(lru, dtype=torch.int32)
        st["stamp"][r] = torch.randperm(lru, generator=gen)  # all below `step`
        resident = held[torch.randperm(lru, generator=gen)[: k - misses]]
        absent = lru + torch.randperm(k, generator=gen)[:misses]
        row = torch.cat((resident, absent))
        ids.append(row[torch.randperm(k, generator=gen)])
    ids = torch.stack(ids)  # [batch, k]
    rows = torch.arange(batch)[:, None] * entries + ids  # map rows = host rows
    books = torch.arange(batch)
    return st, [ids, rows, rows, books, books * slots], step


def _call(fn, args: list[torch.Tensor], st: dict, host: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    return fn(*args, st["kv"], HotState(st["entry_map"], st["entry_row"], st["stamp"], host, step, st["counters"]))


def _same(a: dict, b: dict, shape: dict) -> bool:
    """Equal outside the scratch locations (the reference's idle lanes write there, the kernel does not)."""
    kv_end = shape["batch"] * (shape["lru"] + shape["reserved"]) * shape["dim"]
    return all((torch.equal(a["entry_map"][:-1].cpu(), b["entry_map"][:-1].cpu()),
                torch.equal(a["entry_row"][:-1].cpu(), b["entry_row"][:-1].cpu()),
                torch.equal(a["stamp"][:-1].cpu(), b["stamp"][:-1].cpu()),
                torch.equal(a["kv"][:kv_end].cpu(), b["kv"][:kv_end].cpu()),
                torch.equal(a["counters"].cpu(), b["counters"].cpu())))


def _device_ms(fn, args: list[torch.Tensor], st: dict, host: torch.Tensor, step: torch.Tensor, prepared: dict, iters: int) -> float:
    """Median device milliseconds of one resolve by `fn` on `st`, put back to `prepared` before each call (not timed)."""
    times = []
    for _ in range(iters + 2):  # the first two warm caches and the allocator
        for name, t in st.items():
            t.copy_(prepared[name])
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _call(fn, args, st, host, step)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times = sorted(times[2:])
    return times[len(times) // 2]


def resolve_per_layer(device: str = "cuda", small: bool = False, batch: int | None = None, iters: int = 20,
                      rates: tuple[float, ...] = RATES) -> dict:
    """Resolve time per CSA layer (CUDA) or equality only (CPU, under the interpreter), per miss rate."""
    from kernels.resolve_ref import resolve_ref
    from kernels.resolve_triton import resolve_triton

    cuda = torch.device(device).type == "cuda"
    shape = _shapes(batch, small or not cuda)
    csa_layers = len(V4_FLASH.csa_layers)
    out = {**shape, "row_bytes": shape["dim"], "csa_layers": csa_layers, "timed": cuda, "rates": {}}
    for i, rate in enumerate(rates):
        st0, args, step_n = _prepared(shape, rate, seed=40 + i)
        entries = shape["lru"] + shape["k"]
        pool = HostPool(1, -(-shape["batch"] * entries // 64), 64, shape["dim"], torch.uint8, pin=cuda)
        try:
            pool.kv.copy_(torch.randint(0, 256, pool.kv.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(i)))
            host = pool.on(device)[0]
            dargs = [a.to(device) for a in args]
            step = torch.tensor(step_n, device=device)
            prepared = {name: t.to(device) for name, t in st0.items()}
            kern = {name: t.clone() for name, t in prepared.items()}
            ref = {name: t.clone() for name, t in prepared.items()}
            slots_k = _call(resolve_triton, dargs, kern, host, step)
            slots_r = _call(resolve_ref, dargs, ref, host, step)
            row = {"misses_per_row": round(rate * shape["k"]),
                   "counters_hits_misses_evictions": ref["counters"].tolist(),
                   "equal": bool(torch.equal(slots_k.cpu(), slots_r.cpu()) and _same(kern, ref, shape))}
            if cuda:
                ms = _device_ms(resolve_triton, dargs, kern, host, step, prepared, iters)
                ref_ms = _device_ms(resolve_ref, dargs, ref, host, step, prepared, iters)
                miss_bytes = row["misses_per_row"] * shape["batch"] * shape["dim"]
                row.update({"ms_per_layer": round(ms, 4), "ms_per_step": round(ms * csa_layers, 3),
                            "reference_ms_per_layer": round(ref_ms, 4),
                            "miss_gb_per_s": round(miss_bytes / ms / 1e6, 2) if miss_bytes else None})
        finally:
            pool.close()
        out["rates"][f"{rate:g}"] = row
    out["ok"] = all(r["equal"] for r in out["rates"].values())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rates", default=",".join(f"{r:g}" for r in RATES))
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel module is imported, below
    rates = tuple(float(r) for r in args.rates.split(","))
    emit({"env": environment(), "resolve": resolve_per_layer("cuda" if cuda else "cpu", batch=args.batch, iters=args.iters,
                                                             rates=rates)})


if __name__ == "__main__":
    main()
