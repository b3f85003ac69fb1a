"""Decode sparse attention at V4's shapes: the planned launch against forced alternatives (one JSON object).

    python -m bench.sparse_attention [--batches 1,8,64] [--iters 20]

64 heads x 512 channels (rope 64), 128 + 512 + 1024 keys a row (the window, the C4 top-k, an HCA-sized
segment, 20% of them holes), q in bf16, over v4 rows (584 B) and plain bf16 rows. Per configuration: its plan,
the median ms per call (CUDA events), the KV bytes a row list names read once over that time (GB/s), the
dots' FLOP/s, and the max error against the float64 reference over max |reference|. Alternatives to the plan:
16 and 64 heads a program (the register budget's neighbours) and, where the plan splits, no split. Without
CUDA it prints the plans a 132-SM device would run, and `"cuda": false`.
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch

from bench.common import emit, environment, progress
from kernels.attention_ref import sparse_attention_ref
from kernels.attention_triton import device_programs, plan_decode, sparse_attention_triton
from kernels.kv_format import MainRowReader, pack_fp8_rows

HEADS, DIM, ROPE, LENS = 64, 512, 64, (128, 512, 1024)
H200_SMS = 132


def _case(batch: int, packed: bool, dev: str, gen: torch.Generator) -> tuple:
    q = torch.randn(batch, HEADS, DIM, generator=gen).to(dev, torch.bfloat16)
    segments = []
    for n in LENS:
        vals = torch.randn(2 * n + 7, DIM, generator=gen)
        rows = torch.randint(0, vals.shape[0], (batch, n), generator=gen)
        rows = torch.where(torch.rand(batch, n, generator=gen) < 0.2, -1, rows)
        pool = pack_fp8_rows(vals, ROPE) if packed else vals.to(torch.bfloat16)
        segments.append((pool.to(dev), rows.to(dev)))
    reader = MainRowReader(DIM, ROPE, torch.bfloat16) if packed else None
    return q, segments, torch.randn(HEADS, generator=gen).to(dev), DIM**-0.5, reader


def _ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _plan_dict(batch: int, programs: int, **force) -> dict:
    p = plan_decode(batch, HEADS, DIM, sum(LENS), True, programs, **force)
    return {"block_h": p.block_h, "block_t": p.block_t, "head_groups": p.head_groups, "splits": p.splits, "num_warps": p.num_warps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    result: dict = {"environment": environment(), "cuda": torch.cuda.is_available(), "heads": HEADS, "dim": DIM,
                    "lens": list(LENS)}
    if not torch.cuda.is_available():
        result["plans_at_132_sms"] = {str(b): _plan_dict(b, H200_SMS) for b in batches}
        emit(result)
        return
    dev = torch.device("cuda")
    programs = device_programs(dev)
    runs = []
    for packed in (True, False):
        for batch in batches:
            gen = torch.Generator().manual_seed(batch)
            q, segments, sinks, scale, reader = _case(batch, packed, "cuda", gen)
            want = sparse_attention_ref(q.double(), [(p if packed else p.double(), r) for p, r in segments], sinks.double(), scale,
                                        MainRowReader(DIM, ROPE, torch.float64) if packed else None)
            planned = plan_decode(batch, HEADS, DIM, sum(LENS), True, programs)
            options = [{}, {"block_h": 16}, {"block_h": 64}] + ([{"splits": 1}] if planned.splits > 1 else [])
            row_bytes = segments[0][0].stride(0) * segments[0][0].element_size()
            kv_bytes = batch * sum(LENS) * row_bytes  # every named row once, holes included
            flop = batch * HEADS * sum(LENS) * DIM * 4
            for force in options:
                progress(f"packed={packed} batch={batch} {force or 'plan'}")

                call = functools.partial(sparse_attention_triton, q, segments, sinks, scale, packed=reader, **force)
                got = call()
                err = ((got.double() - want).abs().max() / want.abs().max()).item()
                ms = _ms(call, args.iters)
                runs.append({"packed": packed, "batch": batch, "force": force, "plan": _plan_dict(batch, programs, **force),
                             "ms": round(ms, 4), "kv_gb_per_s": round(kv_bytes / ms / 1e6, 1),
                             "tflop_per_s": round(flop / ms / 1e9, 1), "rel_err": err})
    result["sms"] = programs
    result["runs"] = runs
    emit(result)


if __name__ == "__main__":
    main()
