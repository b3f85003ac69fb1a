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


def emit(result: dict) -> None:
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    sys.stdout.flush()


def progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)
