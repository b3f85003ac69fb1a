"""The documented multi-node start, on one machine: `ray start --head` with role resources, then
`hisparse serve --address` joins it, places its actors by role and serves HTTP."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

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
    head = subprocess.run([ray_bin, "start", "--head", "--port", str(gcs), "--node-ip-address", "127.0.0.1", "--num-cpus", "2",
                           "--resources", resources, "--include-dashboard", "false", "--disable-usage-stats"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert head.returncode == 0, head.stdout + head.stderr
    port = free_port()
    proc = None
    try:
        proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", "--address", f"127.0.0.1:{gcs}", "--port", str(port),
                                 "--placement", "resources", "--device-budget", "16MiB"],
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
        subprocess.run([ray_bin, "stop", "--force"], env=env, capture_output=True, timeout=120)
