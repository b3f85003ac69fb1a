"""The RayService entry point: the gateway as a Ray Serve application answers the same API."""

from __future__ import annotations

import httpx
import pytest
import ray
from serving_helpers import free_port, wait_healthy

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_serve_application_answers(tiny_dir):
    serve = pytest.importorskip("ray.serve", reason='Ray Serve is not installed (pip install "ray[serve]")')
    from hisparse.rayserve import app_builder

    port = free_port()
    ray.shutdown()  # an instance of its own, with role resources (see serving_helpers.local_ray)
    ray.init(address="local", num_cpus=3, include_dashboard=False, _node_ip_address="127.0.0.1",
             resources={"hisparse_prefill": 1, "hisparse_decode": 1},
             runtime_env={"env_vars": {"HISPARSE_CACHE": str(tiny_dir.parent.parent)}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(app_builder({"argv": ["--model", "tiny", "--device-budget", "8MiB", "--placement", "resources",
                                        "--prefill-num-cpus", "0.5", "--decode-num-cpus", "0.5", "--decode-mode", "eager"]}),
                  name="hisparse", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url)
        r = httpx.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 0}, timeout=60).status_code == 400
    finally:
        serve.shutdown()
        ray.shutdown()
