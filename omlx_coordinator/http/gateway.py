"""The HTTP gateway (FastAPI): the app, its API keys, overload refusals and error handlers, and
the wiring of every route, which live in api/ (OpenAI in api/openai.py, /health in
api/health.py, /cluster/* in api/cluster.py, /metrics in api/prometheus.py)."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, MutableMapping
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from omlx_coordinator.api import (
    anthropic,
    audio,
    embeddings,
    health,
    models,
    ollama,
    ollama_embed,
    ollama_models,
    openai,
    prometheus,
    responses,
)
from omlx_coordinator.api import cluster as cluster_routes
from omlx_coordinator.api.anthropic_schema import TAG_PREFIX
from omlx_coordinator.api.console import add_routes as add_console_routes
from omlx_coordinator.errors import APIError
from omlx_coordinator.frontdoor.access import identify, require_admin
from omlx_coordinator.frontdoor.usage import FILE_NAME as USAGE_FILE
from omlx_coordinator.frontdoor.usage import Usage
from omlx_coordinator.http.docs import add_docs_routes
from omlx_coordinator.http.request_body import BodyRefused, JSONBodyRequest
from omlx_coordinator.models.admission import (
    Arrivals,
    Overloaded,
    Refusal,
    ReleaseWhenDone,
    all_full,
    overloaded,
    refuse_all_full,
)
from omlx_coordinator.models.lifecycle import ModelManager
from omlx_coordinator.nodes.membership import Registrar
from omlx_coordinator.request.generation import GatewaySettings
from omlx_coordinator.request.internal_error import internal_error
from omlx_coordinator.telemetry.metrics import (
    GatewayMetrics,
    ModelsCollector,
    UsageCollector,
)
from omlx_coordinator.telemetry.rebalancer import Rebalancer, RebalanceSettings
from omlx_shared.model_store import data_home

log = logging.getLogger(__name__)


def _split_loc(loc: tuple) -> tuple[str | None, str | None, str]:
    """(field path, pydantic union member tag such as 'list[int]', path inside that member)."""
    field: list[str] = []
    tag, rest = None, []
    for i, p in enumerate(loc):
        if (i == 0 and p == "body") or (isinstance(p, str) and p.startswith(TAG_PREFIX)):
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
    msg = e.get("msg", "invalid value").removeprefix("Value error, ")
    if e.get("type") == "extra_forbidden":
        msg = "this field is not supported here"
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


def _keyless() -> APIError:
    return APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' or "
                         "'x-api-key: <key>' with a key this server was started with",
                    code="invalid_api_key")


class _Route(APIRoute):
    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            request.__class__ = JSONBodyRequest  # nothing has read the body yet
            # The key before the body: FastAPI reads and parses a body before it runs a route's
            # dependencies, so anyone could make the gateway read and parse 32 MiB.
            state = request.app.state
            if any(d.dependency is state.require_api_key for d in self.dependencies) and (
                    refused := state.refuse_keyless(request)) is not None:
                return refused
            if (refused := state.refuse_overloaded(request)) is not None:
                return refused
            return await handler(request)

        return route


def create_app(manager: ModelManager, settings: GatewaySettings | None = None,
               start_cluster: bool = True,
               on_start_failure: Callable[[str], None] | None = None,
               rebalance: RebalanceSettings | None = None,
               usage: Usage | None = None) -> FastAPI:
    """The gateway app; its lifespan starts `manager`'s cluster and models (and the
    rebalancer, `rebalance`: off by default) and calls `on_start_failure(reason)` if the main
    model cannot be served at all. `usage`: the ledger (default: $OMLX_CLUSTER_HOME's)."""
    settings = settings or GatewaySettings()
    usage = usage if usage is not None else Usage(data_home() / USAGE_FILE)
    cluster, main = manager.cluster, manager.main
    # Each model's series carry its name; the main model's also the cluster's own.
    metrics = GatewayMetrics(manager.weight_counters, main.model.name)
    metrics.register(ModelsCollector(manager))
    metrics.register(UsageCollector(usage))
    metrics_of = {m.name: metrics if m is main.model else GatewayMetrics(model=m.name)
                  for m in manager.models}
    rebalancer = Rebalancer(manager, metrics, rebalance or RebalanceSettings(mode="off"))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = None

        def started(t: asyncio.Task) -> None:
            if not t.cancelled() and t.exception() is not None and on_start_failure:
                on_start_failure(main.status if cluster.ready else cluster.status)

        if start_cluster:
            task = asyncio.create_task(manager.start())
            task.add_done_callback(started)
        # Not before it listens, nor before a model serves: ModelManager.load_tokenizers.
        tokenizers = asyncio.create_task(manager.load_tokenizers())
        rebalancer.start()
        saving = asyncio.create_task(usage.keep_saved())
        try:
            yield
        finally:
            if task is not None and not task.done():
                task.cancel()
            tokenizers.cancel()
            saving.cancel()
            await rebalancer.stop()
            await manager.stop()

    # The docs pages are docs.py's: their assets served here, behind the key.
    app = FastAPI(title="omlx-cluster", version="0.1.0", lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.router.route_class = _Route
    app.add_middleware(ReleaseWhenDone)  # pure ASGI: a client's disconnect still reaches routes
    app.state.cluster, app.state.metrics, app.state.settings = cluster, metrics, settings
    app.state.manager, app.state.usage = manager, usage
    registrar = Registrar(cluster.options.secret, cluster.add_remote)
    app.state.registrar = registrar

    # A dependency, not an HTTP middleware: Starlette's BaseHTTPMiddleware hides client
    # disconnects from the endpoint, and a client that goes away must cancel its generation.
    # /health (ready or not, details only with a key) and /metrics stay open (load balancers,
    # Prometheus); /cluster/register is signed with the cluster secret instead.
    def has_key(request: Request) -> bool:
        return identify(request, settings.keys, usage) is not None

    async def require_api_key(request: Request) -> None:
        if not has_key(request):
            raise _keyless()

    def refuse_keyless(request: Request) -> Response | None:
        """The 401 of a keyed route's request without a valid key, answered before its body is
        read; the connection closes after it, so the rest of the body is never read."""
        if has_key(request):
            return None
        return error(request, _keyless(), headers={"connection": "close"})

    def refuse_overloaded(request: Request, undecided: int = 0) -> Response | None:
        """A generation request's 429 while every model is at its bound (`undecided` requests
        counted as held in each), answered before its body is read or parsed: the excess of a
        burst then costs the gateway the least it can. (Otherwise the route refuses it once it
        knows the model.)"""
        path = request.scope["path"]
        if path not in endpoints or (refusal := refuse_all_full(
                [m.admission for m in manager.models], undecided)) is None:
            return None
        refusals(path).inc()
        return overload_answer(path, refusal)

    @functools.cache
    def refusals(path: str):
        """The refusals' counter of `path`, looked up once: a burst's thousands count on it
        (py-spy: its labels() lookup and inc() took about as long as deciding the refusal)."""
        return metrics.requests.labels(endpoints[path], "overloaded")

    @functools.lru_cache(maxsize=256)
    def overload_answer(path: str, refusal: Refusal) -> JSONResponse:
        """The answer of `refusal` on `path`, made once: a burst's refusals say the same."""
        return rendered(path, overloaded(refusal, {"connection": "close"}))

    arrivals = Arrivals()

    def answer_at_once(scope: MutableMapping) -> Response | None:
        """For the HTTP protocol (connections.py), which asks before the app runs: a generation
        request's refusal while every model is at its bound counting the generation requests
        still undecided (its 401 without a valid key, as the route would answer first), None
        to run it (counted among the undecided until it is admitted or ends)."""
        if scope["path"] not in endpoints:
            return None
        if not all_full([m.admission for m in manager.models], arrivals.undecided):
            arrivals.arrived(scope)
            return None
        request = Request(scope)
        return refuse_keyless(request) or refuse_overloaded(request, arrivals.undecided)

    keyed = [Depends(require_api_key)]
    admin = [*keyed, Depends(require_admin)]  # a user key there: a 403 naming the role
    app.state.require_api_key, app.state.refuse_keyless = require_api_key, refuse_keyless
    app.state.refuse_overloaded, app.state.answer_at_once = refuse_overloaded, answer_at_once
    add_docs_routes(app, keyed)
    add_console_routes(app)  # the page without a key: its data calls carry one

    # The generation routes, as `omlx_requests_total{endpoint}` names them.
    endpoints = {"/v1/chat/completions": "chat", "/v1/completions": "completions",
                 anthropic.PATH: anthropic.ENDPOINT, responses.PATH: responses.ENDPOINT,
                 "/v1/embeddings": "embeddings", "/v1/rerank": "rerank",
                 "/v1/audio/transcriptions": "transcriptions",
                 "/api/embed": "ollama_embed", "/api/embeddings": "ollama_embed",
                 **ollama.ENDPOINTS}

    def error(request: Request, exc: APIError, headers: dict | None = None) -> JSONResponse:
        """The error in the shape of the API the path belongs to; a generation request's
        counted by outcome (rejected: the client's fault; error: ours). (The scope's path, not
        request.url's: building a URL costs more than the rest of a refusal.)"""
        path = request.scope["path"]
        if (endpoint := endpoints.get(path)) is not None:
            # A model name no one serves is not a reject of the model that is.
            outcome = ("unknown_model" if exc.code == "model_not_found"
                       else "overloaded" if isinstance(exc, Overloaded)
                       else "rejected" if exc.status < 500 else "error")
            metrics.requests.labels(endpoint, outcome).inc()
        return rendered(path, exc, headers)

    def rendered(path: str, exc: APIError, headers: dict | None = None) -> JSONResponse:
        """`exc` in the shape of the API that `path` belongs to."""
        status, body = exc.status, exc.body()
        if anthropic.owns(path):
            status = anthropic.error_status(exc)
            body = anthropic.error_body(status, exc.message)
        elif ollama.owns(path):
            body = ollama.error_body(exc.message)
        return JSONResponse(body, status_code=status, headers=headers or exc.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        kind = request.headers.get("content-type", "")
        if param is None and "json" not in kind and not ollama.owns(request.url.path):
            # FastAPI reads a body as JSON only when its content type says so (curl -d sends
            # form data): the content is fine, the header is what to fix. (Ollama's routes
            # read JSON whatever the header: its clients and examples leave it out.)
            message = (f"the request body must be sent as JSON, with the header "
                       f"Content-Type: application/json (this one came as "
                       f"{kind.split(';')[0] or 'no content type'})")
        return error(request, APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc, BodyRefused):
            return error(request, exc.error)
        message = {404: f"no such endpoint: {request.method} {request.url.path} (the API is "
                        "under /v1: /v1/models, /v1/chat/completions, /v1/completions, "
                        "/v1/responses, /v1/messages; Ollama's under /api: /api/chat, /api/generate, "
                        "/api/tags)",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(
            exc.status_code, str(exc.detail))
        return error(request, APIError(exc.status_code, message),
                     headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return error(request, internal_error(log, "internal error", exc))

    health.add_routes(app, manager, settings, usage)
    cluster_routes.add_routes(app, manager, rebalancer, registrar, usage, keyed, admin)
    prometheus.add_routes(app, manager, metrics_of, settings, admin)
    openai.add_routes(app, manager, metrics_of, settings, keyed)
    anthropic.add_routes(app, manager, metrics_of, settings, keyed)
    responses.add_routes(app, manager, metrics_of, settings, keyed)
    models.add_routes(app, manager, admin)
    embeddings.add_routes(app, manager, settings, keyed)
    audio.add_routes(app, manager, settings, keyed)
    ollama.add_routes(app, manager, metrics_of, settings, keyed)
    ollama_models.add_routes(app, manager, keyed)
    ollama_embed.add_routes(app, manager, settings, keyed)
    app.openapi = lambda: _openapi(app, keyed)
    return app


# What the error handlers above really answer, for the OpenAPI schema (FastAPI's default
# documents a 422 that this gateway never sends).
_ERRORS = {"400": "the request is invalid: the error object says what and names the field",
           "404": "no such model (the error lists the served ones) or endpoint",
           "409": "the model has requests in flight (unload) or the action conflicts",
           "503": "the model cannot be served now (loading, or no node can hold it)"}


def _openapi(app: FastAPI, keyed: list) -> dict:
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        keyed_paths = {r.path for r in app.routes
                       if any(d.dependency is keyed[0].dependency
                              for d in getattr(r, "dependencies", []))}
        for path, ops in schema.get("paths", {}).items():
            for op in ops.values():
                responses = op.setdefault("responses", {})
                if responses.pop("422", None) is not None:
                    responses.update({k: {"description": v} for k, v in _ERRORS.items()})
                if path in keyed_paths:
                    responses["401"] = {"description": "missing or wrong API key"}
        schema.get("components", {}).get("schemas", {}).pop("HTTPValidationError", None)
        schema.get("components", {}).get("schemas", {}).pop("ValidationError", None)
        app.openapi_schema = schema
    return app.openapi_schema
