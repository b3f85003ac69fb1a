"""A process whose step thread is still stepping when it exits ends cleanly.

The test session itself once ended in an abort after every test had passed: a step thread left running
(daemon) was inside a torch op when the interpreter finalized, and Ray's terminate handler turned its
teardown into SIGABRT. Step threads are stopped and joined at exit (`cluster.steploop._stop_all`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = textwrap.dedent("""
    import threading, time
    import ray  # noqa: F401  (installs the terminate handler)
    import torch
    from cluster.steploop import StepThread

    x = torch.randn(256, 256)
    started = threading.Event()

    def step():
        started.set()
        for _ in range(50):
            x.sum(dim=0)

    thread = StepThread("probe", lambda: True, step)
    started.wait()
    time.sleep(0.2)
    print("leaving with the thread stepping", flush=True)
""")


def test_exit_with_a_step_thread_still_stepping_is_clean():
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    for _ in range(2):  # the abort came every time before the fix; twice keeps a lucky exit from passing
        r = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"exit code {r.returncode}:\n{r.stderr[-2000:]}"
        assert "leaving with the thread stepping" in r.stdout
