"""What probes read: `/` (is the endpoint up) and `/health` (does it serve: open to load
balancers, ready or not; the models and the nodes' addresses, pids and memory only with an
admin key)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from omlx_coordinator.api.cluster import main_worker
from omlx_coordinator.frontdoor.access import account_of, identify
from omlx_coordinator.frontdoor.usage import Usage
from omlx_coordinator.models.lifecycle import ModelManager
from omlx_coordinator.request.generation import GatewaySettings


def serving(manager: ModelManager) -> bool:
    """Started, a node to serve on, a model that serves or has served (one unloaded since,
    by its TTL or an operator, loads on demand), and every loaded model with a replica that
    serves (one that recovers pauses its requests)."""
    return (manager.started and bool(manager.cluster.servable())
            and (any(d.ready for d in manager.deployments())
                 or any(m.loads for m in manager.models))
            and all(any(d.ready for d in manager.replicas[m.name])
                    for m in manager.models if m.state == "loaded"))


def add_routes(app: FastAPI, manager: ModelManager, settings: GatewaySettings,
               usage: Usage) -> None:
    cluster, main = manager.cluster, manager.main

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def root(request: Request) -> Response:
        """What clients probe to see that the endpoint is up (Claude Code sends `HEAD /`;
        Ollama's clients and scripts look for Ollama's words). Asked for JSON, where the APIs
        are."""
        if "application/json" in request.headers.get("accept", ""):
            return JSONResponse({"name": "omlx-cluster", "api": "/v1", "ollama_api": "/api",
                                 "health": "/health", "docs": "/docs"})
        return PlainTextResponse("Ollama is running")

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        """Open to load balancers; the models, the nodes' addresses, pids and memory only
        with a key."""
        ok = serving(manager)
        body: dict = {"status": "ok" if ok else "not ready"}
        if identify(request, settings.keys, usage) is not None and account_of(
                request.scope).admin:
            body = {"status": "ok" if ok else (main.status if cluster.ready
                                               else cluster.status),
                    "model": main.model.name,
                    "models": [manager.describe(m) for m in manager.models],
                    "nodes": [{**n, **main_worker(main, n)} for n in cluster.nodes]}
        return JSONResponse(body, status_code=200 if ok else 503)
