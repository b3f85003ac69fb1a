"""A real gateway: uvicorn on 127.0.0.1 (free port) in a background thread, Ray and the actors in this process."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_gateway(cfg, tiny_dir):
    from api.server import BackgroundServer
    from cluster.service import Service

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
                 runtime_env={"env_vars": {"HISPARSE_CACHE": str(tiny_dir.parent.parent)}})
    service = Service(cfg, prefix=f"e2e{cfg.server.port}")
    server = BackgroundServer(service, cfg, cfg.server.port)
    server.start()
    return SimpleNamespace(url=server.url, service=service, server=server, app=server.app)


def stop_gateway(gw) -> None:
    gw.server.stop()
