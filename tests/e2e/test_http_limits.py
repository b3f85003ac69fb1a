"""Overload and outage: 429 past the in-flight limit, 503 with Retry-After when no decode actor is left."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import ray
from serving_helpers import EAGER, free_port, start_gateway, stop_gateway

from core.configs import ClusterConfig, DeadlineConfig, ServeConfig, ServerConfig, TierConfig

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def gw(tiny_dir):
    cfg = ServeConfig(
        step=EAGER,
        model="tiny", tier=TierConfig(device_budget_bytes=8 * 2**20, host_pool_bytes=32 * 2**20),
        cluster=ClusterConfig(placement="any", max_restarts=0, prefill_num_cpus=0.5, decode_num_cpus=0.5),
        server=ServerConfig(port=free_port(), max_concurrent_requests=2),
        deadlines=DeadlineConfig(queue_timeout_s=2.0),
    )
    g = start_gateway(cfg, tiny_dir)
    yield g
    stop_gateway(g)


def test_over_the_inflight_limit_is_429(gw):
    started = threading.Barrier(3)
    results = []

    def slow():
        with httpx.stream("POST", gw.url + "/v1/completions", timeout=120,
                          json={"prompt": [9] * 50, "max_tokens": 400, "stream": True, "ignore_eos": True}) as r:
            started.wait()
            for _ in r.iter_lines():
                pass
            results.append(r.status_code)

    threads = [threading.Thread(target=slow) for _ in range(2)]
    for t in threads:
        t.start()
    started.wait()
    time.sleep(0.3)
    r = httpx.post(gw.url + "/v1/completions", json={"prompt": [5], "max_tokens": 2}, timeout=60)
    assert r.status_code == 429
    assert r.json()["error"]["type"] == "rate_limit_error" and int(r.headers["retry-after"]) >= 1
    for t in threads:
        t.join()
    assert results == [200, 200]
    assert httpx.post(gw.url + "/v1/completions", json={"prompt": [5], "max_tokens": 2}, timeout=60).status_code == 200


def test_no_decode_actor_is_503_with_retry_after(gw):
    ray.kill(gw.service.actors.decode[0], no_restart=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and httpx.get(gw.url + "/health").status_code == 200:
        time.sleep(0.3)
    assert httpx.get(gw.url + "/health").status_code == 503
    r = httpx.post(gw.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 3}, timeout=60)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "unavailable" and int(r.headers["retry-after"]) >= 1
    assert httpx.get(gw.url + "/v1/models").status_code == 200  # the gateway itself keeps serving
