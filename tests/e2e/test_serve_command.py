"""The README's first command: `hisparse serve` starts embedded Ray + the built-in model and serves HTTP."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest
from serving_helpers import free_port, wait_healthy

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_hisparse_serve_end_to_end(tiny_dir):
    port = free_port()
    env = dict(os.environ, HISPARSE_CACHE=str(tiny_dir.parent.parent))
    proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", "--port", str(port), "--device-budget", "16MiB",
                             "--prefill-num-cpus", "0.5", "--decode-num-cpus", "0.5"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        r = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 5, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "tiny"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert proc.returncode == 0, out[-3000:]
