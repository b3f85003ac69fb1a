"""`hisparse serve`: the cluster behind the HTTP gateway, under uvicorn."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time

import httpx
import uvicorn

from api.app import build_app
from cluster.launch import start_ray, stop_ray
from cluster.service import Service
from core.roles import ServeConfig

log = logging.getLogger(__name__)


def run_server(config: ServeConfig) -> int:
    """Start Ray (embedded or joined), the actors, and the gateway; serve until interrupted."""
    # Ray first: it installs its own SIGTERM handler on init, and uvicorn's (installed when serving
    # starts) must be the one that runs, so that SIGTERM shuts the server down cleanly.
    start_ray(config.cluster)
    service = Service(config)
    app = build_app(service, config.server)
    server = uvicorn.Server(uvicorn.Config(app, host=config.server.host, port=config.server.port, log_level="info",
                                           timeout_graceful_shutdown=30, lifespan="on"))
    log.info("hisparse serve: model %s, %d prefill + %d decode actors, offload %s, on http://%s:%d",
             config.model, config.cluster.num_prefill, config.cluster.num_decode, "on" if config.tier.offload else "off",
             config.server.host, config.server.port)
    try:
        server.run()
    except SystemExit as e:
        # uvicorn hands SIGTERM/SIGINT back once it has shut down; Ray's handler turns that into an
        # exit with the signal number. The shutdown was clean, so it is a normal exit.
        if e.code not in (signal.SIGTERM, signal.SIGINT):
            raise
    finally:
        if config.cluster.address is None:
            stop_ray()
    return 0 if server.started else 1


class BackgroundServer:
    """The gateway under uvicorn on a background thread of this process (tests and benchmarks).

    Ray must already be initialised; the service starts with the app and stops with it. Code that
    calls the service directly must run on the server's event loop, where the router lives: `run`.
    """

    def __init__(self, service: Service, config: ServeConfig, port: int) -> None:
        self.service = service
        self.app = build_app(service, config.server)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
        self.url = f"http://127.0.0.1:{port}"
        self.thread = threading.Thread(target=self.server.run, name="gateway", daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None

    def start(self, timeout_s: float = 180.0) -> str:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.thread.is_alive():
                raise RuntimeError("the gateway thread died during start-up")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.loop = self.server.servers[0].get_loop()
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"the gateway at {self.url} did not become healthy within {timeout_s:.0f} s")

    def run(self, coro, timeout_s: float | None = None):
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
