"""What Prometheus reads: the gateway's /metrics (every model's series, the main model's with
the cluster's own), and every stage's metrics endpoint for its service discovery."""

from __future__ import annotations

from fastapi import Depends, FastAPI
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from omlx_coordinator.models.lifecycle import ModelManager
from omlx_coordinator.request.generation import GatewaySettings
from omlx_coordinator.telemetry.metrics import (
    GatewayMetrics,
    exposition,
    prometheus_targets,
)


def add_routes(app: FastAPI, manager: ModelManager, metrics_of: dict[str, GatewayMetrics],
               settings: GatewaySettings, admin: list[Depends]) -> None:
    @app.get("/metrics", response_class=PlainTextResponse,
             dependencies=admin if settings.protect_metrics else [])
    async def prometheus() -> Response:
        return Response(exposition(list(metrics_of.values())), media_type=CONTENT_TYPE_LATEST)

    @app.get("/cluster/prometheus-targets", dependencies=admin)
    async def prometheus_sd() -> list[dict]:
        """Prometheus's HTTP service discovery (`http_sd_configs`, deploy/prometheus): every
        stage's metrics endpoint, so a Mac that joins is scraped without editing prometheus.yml.
        Keyed like /cluster/status: it names every node's address."""
        return prometheus_targets(manager.cluster.nodes, [(d.model.name, d.plan)
                                                          for d in manager.deployments()
                                                          if d.plan])
