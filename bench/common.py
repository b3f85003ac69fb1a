"""Helpers shared by the benchmarks: timing, environment facts, one JSON object on stdout."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Callable


def environment() -> dict:
    import torch

    return {
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }


def time_per_call(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Median seconds per call over `repeats` runs after `warmup`."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def time_by_turns(calls: dict[str, Callable[[], object]], repeats: int, sync: Callable[[], object] = lambda: None,
                  label: str = "") -> dict[str, list[float]]:
    """Seconds per call of each of `calls`, run by turns (one of each per repeat, so they share whatever else the
    machine does), each call followed by `sync` (the device's, where it runs asynchronously), after one warm-up
    call of each; a progress line per repeat."""
    for fn in calls.values():
        fn()
        sync()
    times: dict[str, list[float]] = {k: [] for k in calls}
    for r in range(repeats):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
        progress(f"{label} repeat {r + 1}/{repeats}: " + ", ".join(f"{k} {v[-1] * 1e3:.1f} ms" for k, v in times.items()))
    return times


def open_rank(layout_text: str, rank: int, port: int, device_kind: str, timeout_s: float = 600):
    """One rank of a replica started by `torch.multiprocessing` on this machine: (its ParallelLayout, its device,
    its Comm over 127.0.0.1:`port`). On CUDA rank r takes GPU r."""
    import torch

    from core.parallel import ParallelLayout
    from model.parallel import Comm

    layout = ParallelLayout.parse(layout_text)
    device = torch.device(f"cuda:{rank}" if device_kind == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return layout, device, Comm.open(layout, rank, f"tcp://127.0.0.1:{port}", device=device, timeout_s=timeout_s)


def logits_bench_args(doc: str, argv: list[str] | None):
    """The command line of the benches over one batch of logits (`bench.sampling`, `bench.sampling_surface`):
    --rows, --vocab (V4's by default), --repeats, --threads (set here)."""
    import argparse

    import torch

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def emit(result: dict) -> None:
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    sys.stdout.flush()


def progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)
