"""The README's first command: `hisparse serve` starts embedded Ray + the built-in model and serves HTTP."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import httpx
import pytest
from serving_helpers import free_port, stop_server, wait_healthy

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_hisparse_serve_end_to_end(tiny_dir):
    port = free_port()
    env = dict(os.environ, HISPARSE_CACHE=str(tiny_dir.parent.parent))
    env.pop("RAY_AUTH_MODE", None)  # what a user's shell has: the command decides the mode itself
    proc = subprocess.Popen([sys.executable, "-m", "hisparse.cli", "serve", "--port", str(port), "--device-budget", "16MiB",
                             "--prefill-num-cpus", "0.5", "--decode-num-cpus", "0.5"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout_s=1200)  # the defaults compile the decode step first: minutes with a cold cache
        r = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 5, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "tiny"
    finally:
        out = stop_server(proc)
    assert proc.returncode == 0, out[-3000:]
    # nothing a user must act on or wonder about: Ray's auth mode is decided (and said), the fast HTTP stack runs
    assert "Token authentication is enabled" not in out and "token authentication on" in out
    assert "uvloop event loop, httptools parser" in out
    assert "Traceback" not in out


def test_two_gateway_processes_behind_an_api_key(tiny_dir):
    """`--api-workers 2`: two gateway processes on one port share the actors; the key guards /v1 only and is
    never printed; /metrics counts the requests of both processes."""
    port = free_port()
    env = dict(os.environ, HISPARSE_CACHE=str(tiny_dir.parent.parent), HISPARSE_API_KEY="k-9f2e1d")
    proc = subprocess.Popen([sys.executable, "-m", "hisparse.cli", "serve", "--port", str(port), "--device-budget", "16MiB",
                             "--prefill-num-cpus", "0.5", "--decode-num-cpus", "0.5", "--api-workers", "2",
                             "--decode-mode", "eager"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    auth = {"Authorization": "Bearer k-9f2e1d"}
    try:
        wait_healthy(url, proc)
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/v1/models", headers=auth).status_code == 200

        async def many():
            async with httpx.AsyncClient(timeout=120, headers=auth) as client:
                rs = await asyncio.gather(*(client.post(url + "/v1/completions", json={"prompt": [6 + i, 7, 8], "max_tokens": 4,
                                                                                    "ignore_eos": True}) for i in range(12)))
            return [r.status_code for r in rs]

        assert asyncio.run(many()) == [200] * 12
        pids = {httpx.get(url + "/health").json()["gateway_process"] for _ in range(40)}
        assert len(pids) == 2  # both processes answer on the one port
        tokens = max(_counter(httpx.get(url + "/metrics").text, "hisparse_generation_tokens_total") for _ in range(6))
        assert tokens >= 12 * 4  # every process's tokens, whichever process answers the scrape
    finally:
        out = stop_server(proc)
    assert proc.returncode == 0, out[-3000:]
    assert "k-9f2e1d" not in out


def _counter(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))
