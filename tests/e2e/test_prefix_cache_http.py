"""`hisparse serve --prefix-cache on` through HTTP: a prompt that resumes from the cache gives the tokens it gave
cold, requests sharing a prefix follow it to one of two prefill actors, and after a restart the cache comes back
from its directory (disk reads on /metrics, same tokens)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest
from serving_helpers import free_port, stop_server, wait_healthy

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _serve(tiny_dir, directory, port):
    env = dict(os.environ, HISPARSE_CACHE=str(tiny_dir.parent.parent))
    return subprocess.Popen([sys.executable, "-m", "hisparse.cli", "serve", "--port", str(port), "--device-budget", "16MiB",
                             "--prefill-num-cpus", "0.5", "--decode-num-cpus", "0.5", "--num-prefill", "2",
                             "--prefix-cache", "on", "--prefix-cache-page-tokens", "64", "--prefix-cache-disk-bytes",
                             "64MiB", "--prefix-cache-dir", str(directory), "--decode-mode", "eager"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _stop(proc) -> str:
    out = stop_server(proc)
    assert proc.returncode == 0, out[-3000:]
    return out


def _complete(url: str, prompt: list[int]) -> list[str]:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 6, "ignore_eos": True,
                                                 "temperature": 0, "logprobs": 0}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _settled(url: str, name: str, at_least: float) -> str:
    """/metrics once the actors' counter `name` reached `at_least` (their reports arrive once a second)."""
    for _ in range(20):
        text = httpx.get(url + "/metrics").text
        if _metric(text, name) >= at_least:
            return text
        time.sleep(0.5)
    return text


def test_prefix_cache_through_http_and_a_restart(tiny_dir, tmp_path):
    system = [(37 * i) % 3000 + 6 for i in range(200)]
    prompts = [system + [7 + i, 8 + i, 9 + i] * 5 for i in range(3)]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(tiny_dir, tmp_path, port)
    try:
        wait_healthy(url, proc)
        cold = _complete(url, prompts[0])
        assert _complete(url, prompts[0]) == cold  # resumed at token 192 (3 pages), same tokens
        for p in prompts[1:]:
            _complete(url, p)
        text = _settled(url, "hisparse_prefix_cache_hit_tokens_total", 3 * 192)
        assert _metric(text, "hisparse_prefix_cache_hit_tokens_total") >= 3 * 192
        assert _metric(text, 'hisparse_prefix_routing_total{decision="affinity"') == 3  # all followed the first
        assert _metric(text, 'hisparse_prefix_cache_disk_ops_total{model="tiny",op="write"}') > 0
        assert 0 < _metric(text, "hisparse_prefix_cache_hit_rate") < 1
    finally:
        _stop(proc)

    # the same directory: each actor rebuilds its index from its files and reports its pages to the router
    proc = _serve(tiny_dir, tmp_path, port)
    try:
        wait_healthy(url, proc)
        assert _complete(url, prompts[0]) == cold
        text = _settled(url, 'hisparse_prefix_cache_disk_ops_total{model="tiny",op="read"}', 1)
        assert _metric(text, 'hisparse_prefix_cache_disk_ops_total{model="tiny",op="read"}') >= 4  # 3 pages + a state
        assert _metric(text, "hisparse_prefix_cache_hit_tokens_total") == 192
        assert _metric(text, 'hisparse_prefix_routing_total{decision="affinity"') == 1  # seeded from the actors
    finally:
        _stop(proc)
