"""A real gateway: uvicorn on 127.0.0.1 (free port) in a background thread, Ray and the actors in this process."""

from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

ray = pytest.importorskip("ray")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_gateway(cfg, tiny_dir):
    import uvicorn

    from api.app import build_app
    from cluster.service import Service

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
                 runtime_env={"env_vars": {"HISPARSE_CACHE": str(tiny_dir.parent.parent)}})
    service = Service(cfg, prefix=f"e2e{cfg.server.port}")
    app = build_app(service, cfg.server)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=cfg.server.port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{cfg.server.port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if not thread.is_alive():
            raise RuntimeError("the gateway thread died during start-up")
        time.sleep(0.3)
    else:
        raise TimeoutError("the gateway did not become healthy")
    return SimpleNamespace(url=url, service=service, server=server, thread=thread, app=app)


def stop_gateway(gw) -> None:
    gw.server.should_exit = True
    gw.thread.join(timeout=60)
