"""`hisparse serve`: the cluster behind the HTTP gateway, under uvicorn (uvloop + httptools).

With `--api-workers N` > 1, this process starts Ray and the actors, then uvicorn runs N gateway
processes on the one port; each attaches to the same actors by name, runs its own frontend (its own
requests, its own output subscriptions) and answers `/metrics` for all of them (Prometheus
multiprocess mode). Capacity is shared through the decode actors, which reserve and report.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import logging
import os
import pickle
import signal
import sys
import tempfile
import threading
import time

import httpx
import uvicorn

from api.app import build_app
from api.http_protocol import HEADER_TIMEOUT_ATTR, HEADER_TIMEOUT_S, protocol_class
from cluster.launch import connect, gcs_address, start_ray, stop_ray
from cluster.service import Service
from core.configs import ServeConfig

log = logging.getLogger(__name__)
_WORKER_ENV = "HISPARSE_GATEWAY_WORKER"


def http_stack() -> tuple[str, str]:
    """The fastest event loop and HTTP parser installed (the README's install brings uvloop and httptools)."""
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    return loop, http


def uvicorn_config(app, host: str, port: int, header_timeout_s: float = HEADER_TIMEOUT_S, http: str | None = None,
                   **kwargs) -> uvicorn.Config:
    """uvicorn's config for the gateway (the serve command, tests and benchmarks): the fastest stack installed
    (or the `http` parser named), with the header-read deadline (`api.http_protocol`)."""
    loop, fastest = http_stack()
    config = uvicorn.Config(app, host=host, port=port, loop=loop, http=protocol_class(http or fastest), **kwargs)
    setattr(config, HEADER_TIMEOUT_ATTR, header_timeout_s)
    return config


def _serve_config(app, config: ServeConfig, **kwargs) -> uvicorn.Config:
    loop, http = http_stack()
    log.info("HTTP: %s event loop, %s parser, %d gateway process(es)", loop, http, config.server.api_workers)
    if (loop, http) != ("uvloop", "httptools"):
        log.warning("uvloop/httptools are not installed: the gateway runs on the slower pure-Python stack "
                    "(pip install 'uvicorn[standard]')")
    return uvicorn_config(app, config.server.host, config.server.port, log_level="info", timeout_graceful_shutdown=30,
                          lifespan="on", **kwargs)


def run_server(config: ServeConfig) -> int:
    """Start Ray (embedded or joined), the actors, and the gateway; serve until interrupted."""
    # Ray first: it installs its own SIGTERM handler on init, and uvicorn's (installed when serving
    # starts) must be the one that runs, so that SIGTERM shuts the server down cleanly.
    start_ray(config.cluster)
    try:
        service = Service(config)
    except ValueError as e:  # the model and the flags disagree (a parallel layout the model cannot take, ...)
        print(f"hisparse serve: {e}", file=sys.stderr)
        return 2
    c = config.cluster
    log.info("hisparse serve: model %s, %d prefill (%s) + %d decode (%s) actors or replicas, offload %s, on http://%s:%d",
             config.model, c.num_prefill, c.prefill_layout, c.num_decode, c.decode_layout,
             "on" if config.tier.offload else "off", config.server.host, config.server.port)
    started = False
    try:
        if config.server.api_workers > 1:
            service.start_actors()
            return _run_workers(config)
        server = uvicorn.Server(_serve_config(build_app(service, config.server), config))
        try:
            server.run()
        except SystemExit as e:
            # uvicorn hands SIGTERM/SIGINT back once it has shut down; Ray's handler turns that into an
            # exit with the signal number. The shutdown was clean, so it is a normal exit.
            if e.code not in (signal.SIGTERM, signal.SIGINT):
                raise
        started = server.started
    finally:
        if config.server.api_workers > 1:
            asyncio.run(service.stop(shutdown_ray=False))
        if config.cluster.address is None:
            stop_ray()
    return 0 if started else 1


def _run_workers(config: ServeConfig) -> int:
    metrics_dir = tempfile.mkdtemp(prefix="hisparse-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # read by prometheus_client when the workers import it
    os.environ[_WORKER_ENV] = base64.b64encode(pickle.dumps((config, gcs_address()))).decode()
    loop, http = http_stack()
    log.info("HTTP: %s event loop, %s parser, %d gateway processes", loop, http, config.server.api_workers)
    try:
        # the workers' protocol reads the header deadline's default (uvicorn.run builds the config itself)
        uvicorn.run("api.server:worker_app", factory=True, workers=config.server.api_workers, host=config.server.host,
                    port=config.server.port, log_level="info", loop=loop, http=protocol_class(http),
                    timeout_graceful_shutdown=30)
    except SystemExit as e:
        if e.code not in (signal.SIGTERM, signal.SIGINT):
            raise
    return 0


def worker_app():
    """The app of one gateway worker process: attaches to the actors the serving process started."""
    from api.metrics import MultiprocessMetrics

    config, address = pickle.loads(base64.b64decode(os.environ[_WORKER_ENV]))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    connect(address)
    return build_app(Service(config, attach=True), config.server, metrics_factory=MultiprocessMetrics)


class BackgroundServer:
    """The gateway under uvicorn on a background thread of this process (tests and benchmarks).

    Ray must already be initialised; the service starts with the app and stops with it. Code that
    calls the service directly must run on the server's event loop, where the frontend lives: `run`.
    """

    def __init__(self, service: Service, config: ServeConfig, port: int) -> None:
        self.service = service
        self.app = build_app(service, config.server)
        self.server = uvicorn.Server(uvicorn_config(self.app, "127.0.0.1", port, log_level="warning", lifespan="on"))
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
