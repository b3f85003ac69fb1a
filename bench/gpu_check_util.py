"""What every `bench.gpu_check` check is handed, and the measurements they share.

A check is a function `fn(ctx: Ctx) -> dict` run in a child process of its own. `ctx.record` saves a figure
the moment it is known (the child rewrites its result file each time), so a check that the runner kills at
its timeout still reports every part it finished. No torch at import: the runner's synthetic checks start
in a fraction of a second.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path


def jsonable(value):
    """JSON for what checks put in their results (dtypes, devices, numpy and torch scalars become text or numbers)."""
    if hasattr(value, "item") and callable(value.item):
        try:
            return value.item()
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(value)


def dumps(obj) -> str:
    return json.dumps(obj, default=jsonable, skipkeys=True)  # a key that is not text is left out, not fatal


class Ctx:
    """Where a check runs (`device`: `cuda` on the GPU, `cpu` for a debug run of its setup) and where its figures go."""

    def __init__(self, device: str, result_path: Path | None = None) -> None:
        self.device = device
        self.result_path = result_path
        self.results: dict = {}

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def small(self) -> bool:
        """A CPU debug run: shapes are cut so the Triton interpreter and the CPU finish in seconds."""
        return not self.cuda

    def record(self, key: str, value) -> None:
        """Keep one part's figures now (they survive a later timeout or crash of the same check)."""
        self.results[key] = value
        self.flush()

    def flush(self, final: dict | None = None) -> None:
        if self.result_path is None:
            return
        body = dumps({**self.results, **(final or {})})
        tmp = self.result_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(body)
        os.replace(tmp, self.result_path)  # the runner never reads half a file


def runner_state(runner) -> dict:
    """A decode worker's step runner as figures: read from its attributes, which outlive its `stats()` format."""
    return {"mode": runner.mode, "graphs": len(runner.graphs), "capture_s": round(runner.capture_s, 3),
            "uncaptured_steps": runner.eager_steps, "pending_captures": len(runner.pending_captures),
            "compiles": runner.compiles}


def synchronize(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: str) -> tuple[object, float]:
    """One call: (its result, milliseconds), with CUDA events around it on the GPU, the wall clock on the CPU."""
    if device != "cuda":
        t0 = time.perf_counter()
        out = fn()
        return out, (time.perf_counter() - t0) * 1e3
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    return out, start.elapsed_time(end)


def device_ms(fn: Callable[[], object], device: str, iters: int = 20, warmup: int = 3) -> float:
    """Median milliseconds per call over `iters` calls after `warmup` (see `timed`)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    return round(statistics.median(timed(fn, device)[1] for _ in range(iters)), 4)


def errors(got, want) -> dict:
    """Max abs error and the relative error (max abs error over max |want|), computed in float64; NaN never passes."""
    g, w = got.double(), want.double()
    diff = (g - w).abs().max().item() if g.numel() else 0.0
    scale = w.abs().max().item() if w.numel() else 0.0
    finite = bool(g.isfinite().all().item())
    return {"max_abs_err": diff, "rel_err": diff / max(scale, 1e-30), "finite": finite}


def within(err: dict, rel_tol: float) -> bool:
    return err["finite"] and err["rel_err"] <= rel_tol
