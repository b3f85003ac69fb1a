"""The gateway as a Ray Serve application, for clusters deployed as a KubeRay RayService.

`app_builder({"argv": [...serve flags...]})` builds the same FastAPI app `hisparse serve` runs, inside
one Serve replica; the replica starts the prefill/decode actors on the cluster it runs in when the
app starts, and stops them when it stops. Serve's HTTP proxy then serves /v1, /health and /metrics.
"""

from __future__ import annotations

from typing import Any


def app_builder(args: dict[str, Any]):
    from ray import serve

    from api.app import build_app
    from cluster.service import Service
    from hisparse.cli import build_parser, serve_config

    argv = [str(a) for a in args.get("argv", [])]
    cfg = serve_config(build_parser().parse_args(["serve", *argv]))
    app = build_app(Service(cfg), cfg.server)

    @serve.deployment(name="hisparse-gateway", num_replicas=1, ray_actor_options={"num_cpus": 0},
                      max_ongoing_requests=cfg.server.max_concurrent_requests)
    @serve.ingress(app)
    class Gateway:
        """One replica: it owns the prefill/decode actors it starts."""

    return Gateway.bind()
