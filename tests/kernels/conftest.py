"""Kernel tests: the Triton side runs in a child process under `TRITON_INTERPRET=1`.

Triton 3.x reads `TRITON_INTERPRET` when a `@triton.jit` function is defined, i.e. when a kernel
module is imported, not when it is launched. A kernel module imported here would keep that mode
(and `sys.modules` would keep the module) for every later test of this pytest process. So each test
file doubles as a script: run as `python <file> <out.pt>` it builds its cases, runs the Triton
kernels and saves their outputs; the tests in this process compute the torch references from the
same deterministic cases and compare.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
# The child exits with this when triton cannot be imported, so the parent can skip rather than fail.
NO_TRITON_EXIT = 77


def kernel_or_exit(module: str, name: str):
    """In a child run: import a Triton kernel, or exit with NO_TRITON_EXIT when triton is missing."""
    import importlib

    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as exc:
        if (exc.name or "").startswith("triton"):
            print(exc, file=sys.stderr)
            sys.exit(NO_TRITON_EXIT)
        raise


def _child_env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


@pytest.fixture(scope="session")
def child_env():
    """Build the environment of a child Python that imports the project from this checkout."""
    return _child_env


@pytest.fixture(scope="session")
def run_interpreted(tmp_path_factory):
    """Run a test file as a script under the Triton interpreter; return what it saved (a dict)."""

    def run(script: str, timeout_s: float = 300) -> dict:
        if importlib.util.find_spec("triton") is None:
            pytest.skip("triton is not installed, so the Triton kernels cannot be run under the interpreter")
        out = tmp_path_factory.mktemp("triton") / "results.pt"
        proc = subprocess.run(
            [sys.executable, script, str(out)],
            env=_child_env(TRITON_INTERPRET="1", HISPARSE_DEVICE="cpu"),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if proc.returncode == NO_TRITON_EXIT:
            pytest.skip(f"triton is not importable: {proc.stderr.strip()[-500:]}")
        assert proc.returncode == 0, f"interpreted run of {script} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
        return torch.load(out)

    return run


@pytest.fixture(scope="module")
def triton_outputs(request, run_interpreted):
    """What the requesting test module saved when run as a script under the Triton interpreter."""
    return run_interpreted(str(request.path))
