"""`hisparse serve`: the cluster behind the HTTP gateway, under uvicorn."""

from __future__ import annotations

import logging
import signal

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
