"""The HTTP gateway (FastAPI): the app, its API keys and error handlers, /health, /metrics and
/cluster/*. The protocol routes live in api/ (OpenAI in api/openai.py)."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, MutableMapping
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from omlx_coordinator.api import (
    anthropic,
    audio,
    embeddings,
    models,
    ollama,
    ollama_embed,
    ollama_models,
    openai,
    responses,
)
from omlx_coordinator.api.anthropic_schema import TAG_PREFIX
from omlx_coordinator.api.console import add_routes as add_console_routes
from omlx_coordinator.errors import APIError
from omlx_coordinator.frontdoor.access import account_of, identify, require_admin
from omlx_coordinator.frontdoor.usage import FILE_NAME as USAGE_FILE
from omlx_coordinator.frontdoor.usage import Usage, parse_since
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
from omlx_coordinator.request.generation import GatewaySettings
from omlx_coordinator.request.internal_error import internal_error
from omlx_coordinator.telemetry.metrics import (
    GatewayMetrics,
    ModelsCollector,
    UsageCollector,
    exposition,
    prometheus_targets,
)
from omlx_coordinator.telemetry.rebalancer import Rebalancer, RebalanceSettings
from omlx_shared import auth
from omlx_shared.model_store import data_home
from omlx_shared.outsider_logs import Refusals, cut

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
    metrics = GatewayMetrics(cluster.weight_counters, main.model.name)
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
        rebalancer.start()
        saving = asyncio.create_task(usage.keep_saved())
        try:
            yield
        finally:
            if task is not None and not task.done():
                task.cancel()
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
    app.state.register_tasks = set()
    refusals = Refusals(log)  # anyone on the LAN may send registrations: a line a minute each

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
        metrics.requests.labels(endpoints[path], "overloaded").inc()
        return overload_answer(path, refusal)

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

    def serving() -> bool:
        """Started, a node to serve on, a model that serves or has served (one unloaded since,
        by its TTL or an operator, loads on demand), and every loaded model with a replica that
        serves (one that recovers pauses its requests)."""
        return (manager.started and bool(cluster.servable())
                and (any(d.ready for d in manager.deployments())
                     or any(m.loads for m in manager.models))
                and all(any(d.ready for d in manager.replicas[m.name])
                        for m in manager.models if m.state == "loaded"))

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
        ok = serving()
        body: dict = {"status": "ok" if ok else "not ready"}
        if has_key(request) and account_of(request.scope).admin:
            body = {"status": "ok" if ok else (main.status if cluster.ready
                                               else cluster.status),
                    "model": main.model.name,
                    "models": [manager.describe(m) for m in manager.models],
                    "nodes": [{**n, **main_worker(n)} for n in cluster.nodes]}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.post("/cluster/register")
    async def register(request: Request) -> JSONResponse:
        """A node that cannot use Bonjour (`join --coordinator`) announces its address and id,
        signed with the cluster secret (omlx_shared/auth.py `registration`): an unsigned,
        forged or replayed one is refused, so nobody else can point the coordinator anywhere."""
        try:
            body = await request.json()
            address = str(body["address"])
            host, _, port = address.rpartition(":")
            if not host or not 0 < int(port) < 65536:
                raise ValueError
        except (ValueError, KeyError, TypeError):
            raise APIError(400, "send {\"address\": \"HOST:PORT\", ...} of the node agent, "
                                "signed as `omlx-cluster join --coordinator` does",
                           param="address")
        try:
            address, node_id = cluster.registrations.verify(body)
        except auth.RegistrationError as e:
            source = request.client.host if request.client else "?"
            refusals.warning(source, "registration", "refused a registration of %s from %s: %s",
                             cut(address), source, cut(e))
            raise APIError(401, f"registration refused: {e}", code="invalid_registration")
        if any(n["id"] == node_id and n["address"] == address and n["alive"]
               for n in cluster.nodes):
            return JSONResponse({"status": "member"})
        task = asyncio.create_task(cluster.add_remote(address, node_id))
        app.state.register_tasks.add(task)
        task.add_done_callback(app.state.register_tasks.discard)
        return JSONResponse({"status": "admitting"}, status_code=202)

    @app.get("/cluster/status", dependencies=admin)
    async def status() -> dict:
        """The main model's plan at the top (what one-model tools read), every model's
        state, replicas, stages and footprints, and the nodes."""
        plan = main.plan
        return {"model": main.model.name, "ready": main.ready, "status": main.status,
                "epoch": main.epoch, "capacity_error": main.capacity_error or None,
                "plan": plan.to_dict() if plan else None,
                **main.layout_status(),
                "backend": ({"name": main.backend.backend, "reason": main.backend.reason}
                            if main.backend else None),
                "last_recovery": main.last_recovery,
                "models": [manager.describe(m) for m in manager.models],
                "unloads": manager.evictions,
                "nodes": [{**n, **rebalancer.measured(n["id"]), **main_worker(n)}
                          for n in cluster.nodes]}

    def main_worker(node: dict) -> dict:
        """The main model's stage on `node`: its layers, worker pid and metrics endpoint."""
        w = next((w for w in node["workers"] if w["model"] == main.model.name), None)
        return {"layers": main.stages_on().get(node["id"]),
                "worker_pid": w["pid"] if w else None, "metrics": w["metrics"] if w else None}

    @app.get("/cluster/rebalance", dependencies=admin)
    async def rebalance_advice() -> dict:
        """The measured speeds, the current and the best split, the predicted gain."""
        return await rebalancer.rebalance_now(dry_run=True)

    @app.post("/cluster/rebalance", dependencies=admin)
    async def rebalance_now() -> dict:
        """Moves to the best split for the measured speeds now (past the threshold, the window
        and the cooldown); the answer says whether it moved."""
        if rebalancer.settings.mode == "off":
            raise APIError(409, "rebalancing is off (--rebalance off)")
        return await rebalancer.rebalance_now(dry_run=False)

    @app.get("/cluster/usage", dependencies=keyed)
    async def usage_report(request: Request, since: str = "", key: str | None = None) -> dict:
        """Usage per key and model, summed over whole UTC days from `since` (YYYY-MM-DD or an
        ISO date-time; default: all kept). A user key sees its own; an admin everyone's, or
        one key's with `key`."""
        try:
            day = parse_since(since) if since else ""
        except ValueError:
            raise APIError(400, f"since={since!r}: give a day (2026-12-01) or an ISO date-time "
                                "(2026-12-01T09:00:00Z)", param="since") from None
        account = account_of(request.scope)
        if not account.admin:
            if key not in (None, account.name):
                raise APIError(403, f"the key {account.name!r} (role 'user') may read only its "
                                    "own usage; an admin key reads others'",
                               type="permission_error", code="admin_required")
            key = account.name
        totals = usage.totals(day, key)
        return {"since": day or None, "keys": [
            {"key": name, "models": [{"model": model, **vars(c)} for model, c in ms.items()]}
            for name, ms in sorted(totals.items())]}

    @app.get("/metrics", response_class=PlainTextResponse,
             dependencies=admin if settings.protect_metrics else [])
    async def prometheus() -> Response:
        return Response(exposition(list(metrics_of.values())), media_type=CONTENT_TYPE_LATEST)

    @app.get("/cluster/prometheus-targets", dependencies=admin)
    async def prometheus_sd() -> list[dict]:
        """Prometheus's HTTP service discovery (`http_sd_configs`, deploy/prometheus): every
        stage's metrics endpoint, so a Mac that joins is scraped without editing prometheus.yml.
        Keyed like /cluster/status: it names every node's address."""
        return prometheus_targets(cluster.nodes, [(d.model.name, d.plan)
                                                  for d in manager.deployments() if d.plan])

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
