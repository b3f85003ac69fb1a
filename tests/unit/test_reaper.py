"""The reaper of `cluster.reaper` stops what an owner started once the owner dies, even by SIGKILL, and nothing
else: no Ray here, an owner process that starts the reaper and a few children of its own. (The real instance:
tests/e2e/test_ray_private.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="the reaper finds processes in /proc")

ROOT = Path(__file__).resolve().parents[2]

OWNER = textwrap.dedent("""
    import os, subprocess, sys, time
    from cluster import reaper
    d = sys.argv[1]
    reaper.start_reaper()
    reaper.tell(d)
    hold = "import sys, time; f = open(sys.argv[1], sys.argv[2]); time.sleep(120)"
    env = {k: v for k, v in os.environ.items() if k != reaper.OWNER_ENV}  # as a renamed process shows it
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}  # the test reads the owner's pipes to their end
    kids = [subprocess.Popen([sys.executable, "-c", hold, d + "/inherits.log", "a"], **quiet),  # the environment mark
            subprocess.Popen([sys.executable, "-c", hold, d + "/writes.log", "a"], env=env, **quiet),  # writes in the session
            subprocess.Popen([sys.executable, "-c", hold, d + "/reads.log", "r"], env=env, **quiet)]  # only reads there
    time.sleep(1.0)  # the children have opened their files
    print(" ".join(str(k.pid) for k in kids), flush=True)
    time.sleep(120)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_an_owner_killed_by_sigkill_takes_its_processes_along(tmp_path):
    (tmp_path / "reads.log").write_text("")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("HISPARSE_RAY_OWNER", None)
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path)], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    kids: list[int] = []
    try:
        kids = [int(p) for p in owner.stdout.readline().split()]
        assert len(kids) == 3 and all(_alive(p) for p in kids), owner.stderr.read() if owner.poll() is not None else ""
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + 20
        while (_alive(kids[0]) or _alive(kids[1])) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(kids[0]), "a child carrying the owner's mark outlived it"
        assert not _alive(kids[1]), "a child writing in the owner's session directory outlived it"
        assert _alive(kids[2]), "a process that only reads the session's files is not the owner's"
        assert "stopped 2 of its processes" in owner.stderr.read()
    finally:
        if owner.poll() is None:
            owner.kill()
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
