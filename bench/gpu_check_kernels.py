"""`kernels`: the Triton kernels of the decode and prefill paths against their torch references, at V4 shapes.

- sparse attention over packed v4 main rows (e4m3 nope + bf16 rope + UE8M0 scales, 584 bytes at 512 / 64) and
  over plain rows, q in fp32 and bf16: 64 heads x 512 dims x 64 rows over segments of 128, 512 and 1024 rows
  (the window, the C4 top-k, an HCA-sized segment); reference in float64;
- prefill attention, packed and plain: 128 queries over a window, a gathered segment and a growing prefix;
- the hot-buffer resolve at k=512 with 1024 LRU slots over a registered `HostPool` of 584-byte uint8 rows
  read through its device view (as a decode step reads it), 12 steps whose selections drift, so hits,
  misses and evictions all occur: every output and every piece of state equal to `resolve_ref` after each step;
- the host write of uint8 rows through the pool's device view, equal to `write_rows_ref`.
Each part reports its errors and time per call (CUDA events); `ctx.small` cuts the shapes for a CPU run.
"""

from __future__ import annotations

import traceback
from functools import partial

import torch

from bench.gpu_check_util import Ctx, device_ms, errors, synchronize, timed, within
from cachetier.host_pool import HostPool
from kernels.attention_ref import sparse_attention_ref
from kernels.attention_triton import sparse_attention_triton
from kernels.host_write_ref import write_rows_ref
from kernels.host_write_triton import write_rows_triton
from kernels.kv_format import MainRowReader, pack_fp8_rows
from kernels.prefill_attention_ref import prefill_attention_ref
from kernels.prefill_attention_triton import prefill_attention_triton
from kernels.resolve_ref import HotState, resolve_ref
from kernels.resolve_triton import resolve_triton

REL_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
"""Max |error| over max |reference| (float64 or fp32 reference over the same inputs): fp32 inputs take IEEE fp32
dots; bf16 inputs take bf16 dots, the probabilities and the output rounded to bf16 (a few 1e-3 expected)."""
V4_HEAD_DIM, V4_ROPE_DIM, V4_HEADS = 512, 64, 64


def _geometry(ctx: Ctx) -> dict:
    if ctx.small:
        return {"batch": 2, "heads": 4, "dim": 128, "rope": 16, "lens": (8, 16, 4), "queries": 5, "pool": 40}
    return {"batch": 64, "heads": V4_HEADS, "dim": V4_HEAD_DIM, "rope": V4_ROPE_DIM, "lens": (128, 512, 1024),
            "queries": 128, "pool": 1024}


def _rows(gen: torch.Generator, n: int, dim: int) -> torch.Tensor:
    """n rows of mixed magnitudes (tiny ones become subnormal e4m3 codes), the first all zero."""
    rows = torch.randn(n, dim, generator=gen) * torch.logspace(-3, 1, n)[:, None]
    rows[0] = 0
    return rows


def _picks(gen: torch.Generator, batch: int, n: int, pool: int, holes: float = 0.2) -> torch.Tensor:
    idx = torch.randint(0, pool, (batch, n), generator=gen)
    return torch.where(torch.rand(batch, n, generator=gen) < holes, -1, idx)


def _decode_attention(ctx: Ctx, packed: bool, dtype: torch.dtype, seed: int) -> dict:
    geo, dev = _geometry(ctx), ctx.device
    b, h, d, r = geo["batch"], geo["heads"], geo["dim"], geo["rope"]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, d, generator=gen)
    segments = []
    for n in geo["lens"]:
        pool = _rows(gen, 2 * n + 7, d)
        segments.append((pack_fp8_rows(pool.to(dev), r) if packed else pool.to(dev, dtype), _picks(gen, b, n, pool.shape[0]).to(dev)))
    sinks, scale = torch.randn(h, generator=gen).to(dev), d**-0.5
    reader = MainRowReader(d, r, dtype) if packed else None
    qd = q.to(dev, dtype)
    want = sparse_attention_ref(qd.double(), [(p if packed else p.double(), i) for p, i in segments], sinks.double(), scale,
                                MainRowReader(d, r, torch.float64) if packed else None)
    got = sparse_attention_triton(qd, segments, sinks, scale, packed=reader)
    err = errors(got, want)
    ms = device_ms(lambda: sparse_attention_triton(qd, segments, sinks, scale, packed=reader), dev, iters=3 if ctx.small else 20)
    return {"shape": [b, h, d], "lens": list(geo["lens"]), "packed": packed, "dtype": str(dtype), **err,
            "ms_per_call": ms, "ok": within(err, REL_TOL[dtype])}


def _prefill_attention(ctx: Ctx, packed: bool, dtype: torch.dtype, seed: int) -> dict:
    geo, dev = _geometry(ctx), ctx.device
    nq, h, d, r, n = geo["queries"], geo["heads"], geo["dim"], geo["rope"], geo["pool"]
    window, gathered = geo["lens"][0], geo["lens"][1]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(nq, h, d, generator=gen).to(dev, dtype)
    rows = _rows(gen, n, d).to(dev)
    pool = pack_fp8_rows(rows, r) if packed else rows.to(dtype)
    win = (torch.arange(nq)[:, None] + torch.arange(window)).clamp(max=n - 1)  # [queries, window]
    sel = _picks(gen, nq, gathered, n, holes=0.3)
    counts = torch.linspace(0, n // 4, nq).long()  # query 0 sees no prefix, the last a quarter of the pool
    segments, prefix = [(pool, win.to(dev)), (pool, sel.to(dev))], (pool, counts.to(dev))
    sinks, scale = torch.randn(h, generator=gen).to(dev), d**-0.5
    reader = MainRowReader(d, r, dtype) if packed else None
    want = prefill_attention_ref(q.float(), segments, prefix, sinks, scale, 512, MainRowReader(d, r, torch.float32) if packed else None)
    got = prefill_attention_triton(q, segments, prefix, sinks, scale, packed=reader)
    err = errors(got, want)
    ms = device_ms(lambda: prefill_attention_triton(q, segments, prefix, sinks, scale, packed=reader), dev,
                   iters=3 if ctx.small else 20)
    return {"queries": nq, "heads": h, "dim": d, "segments": [window, gathered], "packed": packed, "dtype": str(dtype),
            **err, "ms_per_call": ms, "ok": within(err, REL_TOL[dtype])}


# --- the tier's kernels over a registered host pool ---------------------------------------------------


def _hot_state(batch: int, lru: int, reserved: int, dim: int, entries: int, device: str) -> dict:
    """Hot buffers of `batch` requests (book b is request b) plus the scratch book, entry map and kv last."""
    slots = lru + reserved
    return {
        "entry_map": torch.full((batch * entries + 1,), -1, dtype=torch.int32, device=device),
        "kv": torch.zeros((batch + 1) * slots * dim, dtype=torch.uint8, device=device),
        "entry_row": torch.full((batch + 1, slots), -1, dtype=torch.long, device=device),
        "stamp": torch.full((batch + 1, lru), -1, dtype=torch.long, device=device),
        "counters": torch.zeros(3, dtype=torch.long, device=device),
    }


def _same_state(ref: dict, dev: dict, scratch_kv: int) -> bool:
    """Equal outside the scratch locations (where the reference's masked lanes write and the kernel does not)."""
    return all((
        torch.equal(ref["entry_map"][:-1], dev["entry_map"][:-1].cpu()),
        torch.equal(ref["entry_row"][:-1], dev["entry_row"][:-1].cpu()),
        torch.equal(ref["stamp"][:-1], dev["stamp"][:-1].cpu()),
        torch.equal(ref["kv"][:scratch_kv], dev["kv"][:scratch_kv].cpu()),
        torch.equal(ref["counters"], dev["counters"].cpu()),
    ))


def _registered_pool(layers: int, rows: int, dim: int, ctx: Ctx, seed: int) -> HostPool:
    entries_per_block = 64
    pool = HostPool(layers, -(-rows // entries_per_block), entries_per_block, dim, torch.uint8, pin=ctx.cuda)
    pool.kv.copy_(torch.randint(0, 256, pool.kv.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return pool


def _resolve(ctx: Ctx) -> dict:
    batch, k, lru, reserved, steps = (2, 16, 32, 4, 4) if ctx.small else (64, 512, 1024, 8, 12)
    dim, drift, window = 584, k // 4, 2 * k  # each step selects k of a window that moves k/4 further on
    entries = steps * drift + window
    pool = _registered_pool(1, batch * entries, dim, ctx, seed=11)
    host_cpu, host_dev = pool.kv[0], pool.on(ctx.device)[0]  # the same memory: the host tensor and its device view
    ref, dev = _hot_state(batch, lru, reserved, dim, entries, "cpu"), _hot_state(batch, lru, reserved, dim, entries, ctx.device)
    books = torch.arange(batch)
    gen = torch.Generator().manual_seed(5)
    _warm_resolve(batch, k, lru, reserved, dim, entries, books, host_dev, ctx.device)
    same, times, misses = True, [], []
    for step in range(1, steps + 1):
        ids = torch.rand(batch, window, generator=gen).argsort(dim=1)[:, :k] + (step - 1) * drift  # [batch, k]
        ids = torch.where(torch.rand(batch, k, generator=gen) < 0.05, -1, ids)
        rows = torch.where(ids >= 0, books[:, None] * entries + ids, -1)
        args = [ids, rows, rows, books, books * (lru + reserved)]
        before = ref["counters"].clone()
        want = resolve_ref(*args, ref["kv"], HotState(ref["entry_map"], ref["entry_row"], ref["stamp"], host_cpu,
                                                      torch.tensor(step), ref["counters"]))
        dargs = [a.to(ctx.device) for a in args]
        call = partial(resolve_triton, *dargs, dev["kv"], HotState(dev["entry_map"], dev["entry_row"], dev["stamp"], host_dev,
                                                                   torch.tensor(step, device=ctx.device), dev["counters"]))
        got, ms = timed(call, ctx.device)
        times.append(round(ms, 4))
        same = same and torch.equal(got.cpu(), want) and _same_state(ref, dev, batch * (lru + reserved) * dim)
        misses.append(round((ref["counters"][1] - before[1]).item() / max(1, (ids >= 0).sum().item()), 3))
    registered = pool.pinned
    pool.close()
    evictions = ref["counters"][2].item()
    return {"batch": batch, "k": k, "lru": lru, "row_bytes": dim, "steps": steps, "equal_every_step": bool(same),
            "counters_hits_misses_evictions": ref["counters"].tolist(), "miss_rate_per_step": misses,
            "ms_per_step": times, "host_pool_registered": registered, "ok": bool(same) and evictions > 0}


def _warm_resolve(batch: int, k: int, lru: int, reserved: int, dim: int, entries: int, books, host, device: str) -> None:
    """One call on a throwaway state of the same shapes, so the timed steps do not include Triton's compile."""
    st = _hot_state(batch, lru, reserved, dim, entries, device)
    ids = torch.arange(k).expand(batch, k).contiguous()
    rows = (books[:, None] * entries + ids).to(device)
    resolve_triton(ids.to(device), rows, rows, books.to(device), (books * (lru + reserved)).to(device), st["kv"],
                   HotState(st["entry_map"], st["entry_row"], st["stamp"], host, torch.tensor(1, device=device), st["counters"]))
    synchronize(device)


def _host_write(ctx: Ctx) -> dict:
    n, rows_total, dim = (4, 64, 584) if ctx.small else (64, 65536, 584)
    pool = _registered_pool(2, rows_total, dim, ctx, seed=12)
    gen = torch.Generator().manual_seed(13)
    rows = torch.randperm(pool.kv.shape[1], generator=gen)[:n]
    values = torch.randint(0, 256, (n, dim), dtype=torch.uint8, generator=gen)
    want = pool.kv.clone()
    write_rows_ref(want, 1, rows, values)
    view, drows, dvalues = pool.on(ctx.device), rows.to(ctx.device), values.to(ctx.device)
    write_rows_triton(view, 1, drows, dvalues)
    synchronize(ctx.device)
    equal = torch.equal(pool.kv, want)  # read back through the host tensor: the write crossed to host memory
    ms = device_ms(lambda: write_rows_triton(view, 1, drows, dvalues), ctx.device, iters=3 if ctx.small else 20)
    pool.close()
    return {"rows": n, "row_bytes": dim, "equal": equal, "ms_per_call": ms, "gb_per_s": round(n * dim / ms / 1e6, 3), "ok": equal}


def kernels(ctx: Ctx) -> dict:
    ok = True
    parts = [(f"attention_{'packed' if p else 'plain'}_{str(dt)[6:]}", lambda p=p, dt=dt, s=s: _decode_attention(ctx, p, dt, s))
             for s, (p, dt) in enumerate(((True, torch.float32), (True, torch.bfloat16), (False, torch.float32), (False, torch.bfloat16)))]
    parts += [(f"prefill_{'packed' if p else 'plain'}_{str(dt)[6:]}", lambda p=p, dt=dt, s=s: _prefill_attention(ctx, p, dt, s))
              for s, (p, dt) in enumerate(((True, torch.float32), (True, torch.bfloat16), (False, torch.float32)), start=10)]
    parts += [("resolve", lambda: _resolve(ctx)), ("host_write", lambda: _host_write(ctx))]
    for name, part in parts:
        try:
            res = part()
        except Exception as exc:  # one part's failure does not hide the others
            res = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
        ctx.record(name, res)
        ok = ok and res["ok"]
        if ctx.cuda:
            torch.cuda.empty_cache()
    return {"ok": ok}
