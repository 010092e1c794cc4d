"""The HTTP gateway (FastAPI): the app, its API keys and error handlers, /health, /metrics and
/cluster/*. The protocol routes live in api/ (OpenAI in api/openai.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from omlx_coordinator.api import openai
from omlx_coordinator.cluster import Cluster
from omlx_coordinator.errors import APIError
from omlx_coordinator.generation import GatewaySettings
from omlx_coordinator.metrics import GatewayMetrics

log = logging.getLogger(__name__)


def _split_loc(loc: tuple) -> tuple[str | None, str | None, str]:
    """(field path, pydantic union member tag such as 'list[int]', path inside that member)."""
    field: list[str] = []
    tag, rest = None, []
    for i, p in enumerate(loc):
        if i == 0 and p == "body":
            continue
        if tag is None and isinstance(p, str) and ("[" in p or p in ("str", "int", "float",
                                                                     "bool", "none")):
            tag = p
            continue
        (rest if tag else field).append(str(p))
    return ".".join(field) or None, tag, ".".join(rest)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    e = errors[0]
    if e.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {e.get('ctx', {}).get('error', '')}", None
    msg = e.get("msg", "invalid value")
    field, tag, _ = _split_loc(tuple(e.get("loc", ())))
    if field is None:
        if e.get("type") == "missing":
            return "the request body is empty: send a JSON object", None
        return f"the request body must be a JSON object ({msg})", None
    if tag is None:
        return f"'{field}': {msg}", field
    # A union (e.g. prompt: string or token ids): say what each accepted form objected to.
    parts, seen = [], set()
    for x in errors:
        f, t, rest = _split_loc(tuple(x.get("loc", ())))
        if f == field and t and t not in seen:  # the first complaint of each form
            seen.add(t)
            parts.append(f"as {t}" + (f" (item {rest})" if rest else "") + f": {x.get('msg')}")
    return f"'{field}' has none of its accepted forms: " + "; ".join(parts), field


def create_app(cluster: Cluster, settings: GatewaySettings | None = None,
               start_cluster: bool = True,
               on_start_failure: Callable[[str], None] | None = None) -> FastAPI:
    """The gateway app; its lifespan starts `cluster` and calls `on_start_failure(reason)` if
    the model cannot be served at all."""
    settings = settings or GatewaySettings()
    metrics = GatewayMetrics(cluster.weight_counters)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = None

        def started(t: asyncio.Task) -> None:
            if not t.cancelled() and t.exception() is not None and on_start_failure:
                on_start_failure(cluster.status)

        if start_cluster:
            task = asyncio.create_task(cluster.start())
            task.add_done_callback(started)
        try:
            yield
        finally:
            if task is not None and not task.done():
                task.cancel()
            await cluster.stop()

    app = FastAPI(title="omlx-cluster", version="0.1.0", lifespan=lifespan)
    app.state.cluster, app.state.metrics, app.state.settings = cluster, metrics, settings
    app.state.register_tasks = set()

    # A dependency, not an HTTP middleware: Starlette's BaseHTTPMiddleware hides client
    # disconnects from the endpoint, and a client that goes away must cancel its generation.
    # /health and /metrics stay open (load balancers, Prometheus); /cluster/register too: it
    # only makes the coordinator challenge that address with the cluster secret.
    async def require_api_key(request: Request) -> None:
        if not settings.api_keys:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or key.strip() not in settings.api_keys:
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' "
                                "with a key this server was started with",
                           code="invalid_api_key")

    keyed = [Depends(require_api_key)]

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(APIError(400, message, param=param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no such endpoint: {request.method} {request.url.path} (the API is "
                        "under /v1: /v1/models, /v1/chat/completions, /v1/completions)",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(
            exc.status_code, str(exc.detail))
        return JSONResponse(APIError(exc.status_code, message).body(),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed")
        err = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        return JSONResponse(err.body(), status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        body = {"status": "ok" if cluster.ready else cluster.status, "model": cluster.model_id,
                "nodes": cluster.nodes}
        return JSONResponse(body, status_code=200 if cluster.ready else 503)

    @app.post("/cluster/register")
    async def register(request: Request) -> JSONResponse:
        """A node that cannot use Bonjour (`join --coordinator`) announces its address."""
        try:
            address = str((await request.json())["address"])
            host, _, port = address.rpartition(":")
            if not host or not 0 < int(port) < 65536:
                raise ValueError
        except (ValueError, KeyError, TypeError):
            raise APIError(400, "send {\"address\": \"HOST:PORT\"} of the node agent",
                           param="address")
        if any(n["address"] == address and n["alive"] for n in cluster.nodes):
            return JSONResponse({"status": "member"})
        task = asyncio.create_task(cluster.add_remote(address))
        app.state.register_tasks.add(task)
        task.add_done_callback(app.state.register_tasks.discard)
        return JSONResponse({"status": "admitting"}, status_code=202)

    @app.get("/cluster/status", dependencies=keyed)
    async def status() -> dict:
        plan = cluster.plan
        return {"model": cluster.model_id, "ready": cluster.ready, "status": cluster.status,
                "epoch": cluster.epoch, "capacity_error": cluster.capacity_error or None,
                "plan": plan.to_dict() if plan else None,
                "backend": ({"name": cluster.backend.backend, "reason": cluster.backend.reason}
                            if cluster.backend else None),
                "last_recovery": cluster.last_recovery, "nodes": cluster.nodes}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    openai.add_routes(app, cluster, metrics, settings, keyed)
    return app
