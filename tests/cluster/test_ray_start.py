"""The documented multi-node start, on one machine: `ray start --head` with role resources, then
`hisparse serve --address` joins it, places its actors by role and serves HTTP."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import httpx
import pytest
from serving_helpers import free_port, wait_healthy

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_ray_start_then_serve_with_address(tiny_dir, tmp_path):
    ray_bin = shutil.which("ray", path=os.path.dirname(sys.executable))
    if ray_bin is None:
        pytest.skip("the `ray` command is not installed next to this Python")
    env = dict(os.environ, HISPARSE_CACHE=str(tiny_dir.parent.parent))
    gcs = free_port()
    resources = json.dumps({"hisparse_prefill": 1, "hisparse_decode": 1})
    temp_dir = tempfile.mkdtemp(prefix="ray-start-test-")  # names this cluster's processes, so only they are stopped
    head = subprocess.run([ray_bin, "start", "--head", "--port", str(gcs), "--node-ip-address", "127.0.0.1", "--num-cpus", "2",
                           "--resources", resources, "--include-dashboard", "false", "--disable-usage-stats",
                           "--temp-dir", temp_dir], env=env, capture_output=True, text=True, timeout=120)
    assert head.returncode == 0, head.stdout + head.stderr
    port = free_port()
    proc = None
    try:
        proc = subprocess.Popen([sys.executable, "-m", "hisparse.cli", "serve", "--address", f"127.0.0.1:{gcs}", "--port", str(port),
                                 "--placement", "resources", "--device-budget", "16MiB", "--decode-mode", "eager"],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        r = httpx.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0, out[-3000:]
        assert "joined the Ray cluster" in out
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        _stop_cluster(temp_dir)


def _stop_cluster(temp_dir: str) -> None:
    """Kill the processes of the cluster started under `temp_dir` (`ray stop` would stop every Ray
    instance on the machine, a developer's own server included)."""
    me = os.getpid()
    for pid_dir in os.listdir("/proc"):
        if not pid_dir.isdigit() or int(pid_dir) == me:
            continue
        try:
            with open(f"/proc/{pid_dir}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
            if temp_dir in cmdline:
                os.kill(int(pid_dir), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue
    shutil.rmtree(temp_dir, ignore_errors=True)
