"""Synthetic checks for the runner's own tests (hidden from `bench.gpu_check`'s default run): one for each way a
check can end, and one that imports every real check's module."""

from __future__ import annotations

import importlib
import os
import time

from bench.gpu_check_util import Ctx


def passes(ctx: Ctx) -> dict:
    return {"ok": True, "device": ctx.device}


def fails(ctx: Ctx) -> dict:
    return {"ok": False, "why": "a figure out of bounds"}


def raises(ctx: Ctx) -> dict:
    ctx.record("before", 1)
    raise ValueError("synthetic failure inside a check")


def hangs(ctx: Ctx) -> dict:
    ctx.record("started", True)  # what a killed check still reports
    while True:
        time.sleep(1)


def crashes(ctx: Ctx) -> dict:
    ctx.record("before", 1)
    os._exit(3)  # the process dies without a word, as a broken CUDA context can make it


SERVING_ONLY = ("ray", "fastapi", "uvicorn", "starlette", "orjson", "prometheus_client", "pydantic")
"""Packages the serving stack uses and a lent GPU machine may not have: no check may need them."""


def imports(ctx: Ctx) -> dict:
    """Import the module of every real check, then report which of `SERVING_ONLY` got imported on the way."""
    import sys

    from bench.gpu_check import CHECKS

    modules = sorted({c.target.partition(":")[0] for c in CHECKS if not c.hidden})
    for m in modules:
        importlib.import_module(m)
    pulled = sorted(n for n in SERVING_ONLY if n in sys.modules)
    return {"ok": not pulled, "modules": modules, "serving_packages_imported": pulled}
