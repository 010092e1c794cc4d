"""`serve` and `coordinator`: the gateway in front of the models, with its own local nodes or
with the nodes that join over the LAN."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import stat
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from omlx_cluster.api_keys import ApiKeyError, api_keys
from omlx_cluster.flags import cluster_secret, engine_args, rebalance_settings
from omlx_cluster.validators import is_loopback
from omlx_shared.block_hashes import DEFAULT_BLOCK_SIZE

log = logging.getLogger("omlx_cluster")

if TYPE_CHECKING:
    from omlx_coordinator.frontdoor.keys import KeyRing


def _api_keys(args: argparse.Namespace) -> KeyRing | None:
    """The gateway's API keys; None (after printing why) when the address needs one."""
    from omlx_coordinator.frontdoor.keys import KeyRing, KeysFileError

    try:
        keys = KeyRing(api_keys(args), args.keys_file)
    except (ApiKeyError, KeysFileError) as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    except OSError as e:
        print(f"error: --keys-file {args.keys_file}: {e.strerror or e}", file=sys.stderr)
        return None
    if keys.open and not is_loopback(args.host):
        print(f"error: the gateway would listen on {args.host}, reachable from the network, "
              "without an API key: pass --api-key-file FILE (or --api-key KEY, or set "
              "OMLX_CLUSTER_API_KEY), or listen on 127.0.0.1", file=sys.stderr)
        return None
    return keys


def _run_gateway(args: argparse.Namespace, manager, keys: KeyRing) -> int:
    """Serves the gateway in front of `manager`'s models until stopped; 1 if it could not
    start."""
    import uvicorn

    from omlx_coordinator.frontdoor.access_log import redact_access_log
    from omlx_coordinator.http.connections import guarded, raise_open_files
    from omlx_coordinator.http.gateway import create_app
    from omlx_coordinator.request.generation import GatewaySettings

    settings = GatewaySettings(request_timeout=args.request_timeout,
                               keepalive_seconds=args.keepalive,
                               default_max_tokens=args.default_max_tokens, keys=keys,
                               protect_metrics=args.protect_metrics)
    failures: list[str] = []

    def give_up(reason: str) -> None:  # nothing can be served: exit rather than idle at 503
        failures.append(reason)
        server.should_exit = True

    # Bound before anything starts: a port in use fails here, before any node or worker runs.
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        sock.close()
        print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror} (another "
              "server may hold the port: pass --port)", file=sys.stderr)
        return 2
    tls = _gateway_tls(args)
    if tls is False:
        sock.close()
        return 2
    app = create_app(manager, settings, on_start_failure=give_up,
                     rebalance=rebalance_settings(args))
    # uvloop and httptools, named rather than "auto" (which quietly falls back to asyncio's
    # loop and h11): at many streams the gateway's event loop is a bottleneck of its own.
    # An idle client connection is kept 75 s (nginx's default), longer than clients keep theirs
    # (httpx and the OpenAI SDK: 5 s). With uvicorn's 5 s, an agent's next turn ~5 s after its
    # last raced the server closing that connection: "Server disconnected without sending a
    # response". The client must be the one that lets it go.
    # The protocol is httptools', with deadlines for headers and a bound on connections, and
    # it refuses a burst's excess before the app runs.
    raise_open_files(args.max_connections)
    server = uvicorn.Server(uvicorn.Config(
        app, log_level=args.log_level, timeout_graceful_shutdown=5, timeout_keep_alive=75,
        loop="uvloop", http=guarded(args.header_timeout, args.max_connections,
                                    app.state.answer_at_once),
        ssl_certfile=tls.cert if tls else None, ssl_keyfile=tls.key if tls else None))
    redact_access_log()  # a key sent as ?api_key=... never reaches the log
    if args.log_file:
        try:
            _log_to_file(args.log_file)
        except OSError as e:
            sock.close()
            print(f"error: --log-file {args.log_file}: {e.strerror}", file=sys.stderr)
            return 2
    log.info("listening on %s://%s:%d/v1; loading %s (GET /health answers 200 once it "
             "is ready)", "https" if tls else "http", args.host, sock.getsockname()[1],
             ", ".join(m.name for m in manager.models))
    if tls:
        log.info("HTTPS certificate %s, SHA-256 fingerprint %s", tls.cert, tls.fingerprint)
    server.run(sockets=[sock])
    if failures:
        print(f"error: could not serve {manager.models[0].path}: {failures[0]}",
              file=sys.stderr)
        return 1
    return 0


def _gateway_tls(args: argparse.Namespace):
    """The certificate to serve HTTPS with, None for plain HTTP, False after saying why not."""
    from omlx_coordinator.http.gateway_tls import GatewayTLSError, checked, self_signed
    from omlx_shared.model_store import data_home

    if (args.tls_cert is None) != (args.tls_key is None):
        print("error: --tls-cert and --tls-key go together: the certificate and its key",
              file=sys.stderr)
        return False
    if args.tls and args.tls_cert:
        print("error: --tls self-signed makes its own certificate: drop it or --tls-cert",
              file=sys.stderr)
        return False
    try:
        if args.tls_cert:
            return checked(args.tls_cert, args.tls_key)
        return self_signed(data_home(), args.host) if args.tls else None
    except (GatewayTLSError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return False


def _log_to_file(path: Path) -> None:
    """Every log line of this process to `path` too: the root logger's and uvicorn's, which
    do not propagate to it (so this runs after uvicorn.Config has set them up)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)  # as all it writes
    # The log holds what clients ask for: a file that existed keeps its mode through the open.
    mode = os.fstat(fd).st_mode
    if stat.S_ISREG(mode) and mode & 0o077:
        try:
            os.fchmod(fd, 0o600)
        except OSError as e:  # another account's file we may append to
            log.warning("the log file %s stays readable by others: %s", path, e.strerror)
    handler = logging.StreamHandler(os.fdopen(fd, "a", buffering=1))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("", "uvicorn", "uvicorn.access"):
        logging.getLogger(name).addHandler(handler)


def _keys_and_models(args: argparse.Namespace):
    """What every gateway command checks first: the API keys and the served models (every
    folder resolved and checked now, so a config naming a missing one fails at start). None
    (after saying why) to exit with 2."""
    from dataclasses import replace

    from omlx_coordinator.models import model_config as mc
    from omlx_coordinator.models.admission import default_bound
    from omlx_coordinator.models.served_model import ServedModel
    from omlx_shared.model_spec import resolve_model, served_name
    from omlx_shared.model_store import ModelError

    keys = _api_keys(args)
    if keys is None:
        return None
    try:
        if args.models_config is not None:
            given = [f for f, v in (("--model", args.model), ("--model-id", args.model_id),
                                    ("--alias", args.alias), ("--pin", args.pin),
                                    ("--ttl", args.ttl), ("--replicas", args.replicas)) if v]
            if given:
                raise mc.ModelConfigError(f"{given[0]} and --models-config both name models: "
                                          "put everything in the file")
            configs = mc.from_file(args.models_config)
            resolved = [resolve_model(c.spec, progress=True) for c in configs]
        else:
            named = ([mc.parse_model_arg(m) for m in args.model] if args.model
                     else [(None, None)])  # None: the default model
            if args.model_id and len(named) > 1:
                raise mc.ModelConfigError("--model-id names a single model: with several, "
                                          "pass --model NAME=PATH")
            if args.model_id and named[0][0]:
                raise mc.ModelConfigError(f"--model-id {args.model_id} and --model "
                                          f"{named[0][0]}=...: name the model once")
            resolved = [resolve_model(spec, progress=True) for _, spec in named]
            names = [name or args.model_id or served_name(spec, path)
                     for (name, spec), path in zip(named, resolved)]
            configs = mc.from_flags([(n, str(p)) for n, p in zip(names, resolved)],
                                    args.alias, args.pin, args.ttl, args.replicas)
        configs = mc.with_split(configs, getattr(args, "split", None))
        queue = args.max_queue or default_bound(getattr(args, "max_batch", None))
        configs = [c if c.max_queue else replace(c, max_queue=queue) for c in configs]
        batch = getattr(args, "max_batch", None)  # a coordinator's nodes: their default
        configs = [replace(c, batch_share=args.batch_share, slots=batch and batch * (
            c.replicas if isinstance(c.replicas, int) else 1)) for c in configs]
        return keys, [ServedModel(c, path) for c, path in zip(configs, resolved)]
    except (ModelError, mc.ModelConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def _manager(args: argparse.Namespace, models, options):
    from omlx_coordinator.models.lifecycle import ModelManager
    from omlx_coordinator.nodes.cluster import Cluster

    return ModelManager(Cluster(options), models,
                        block_size=getattr(args, "cache_block_size", None) or DEFAULT_BLOCK_SIZE,
                        routing_mode=args.routing)


def serve_command(args: argparse.Namespace) -> int:
    from omlx_coordinator.nodes.cluster import ClusterOptions
    from omlx_coordinator.planning.planner import PlanError
    from omlx_shared.auth import new_secret

    checked = _keys_and_models(args)
    if checked is None:
        return 2
    keys, models = checked
    if args.split and len(args.split) != args.nodes:
        print(f"error: --split has {len(args.split)} entries but --nodes is {args.nodes}",
              file=sys.stderr)
        return 2
    _warn_slow_blas()
    # Its own nodes get a secret made up for this run: nothing else can drive them.
    options = ClusterOptions(nodes=args.nodes,
                             micro_batches=args.micro_batches or 0, backend=args.backend,
                             parallel=args.parallel,
                             node_args=tuple(engine_args(args)),
                             node_metrics_port=args.node_metrics_port,
                             node_memory_bytes=args.node_memory or 0,
                             local_reserve_bytes=args.os_reserve,
                             context_tokens=args.context, max_sequences=args.sequences,
                             worker_cache_bytes=args.hot_cache_max_size,
                             weights_cap_bytes=args.weights_memory,
                             stall_seconds=args.stall_timeout, secret=new_secret())
    manager = _manager(args, models, options)
    try:
        # Refuse a bad split or a main model that fits nowhere up front.
        plan = manager.main.make_plan()
    except (PlanError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.nodes == 1 and (ignored := [f for f, given in (
            (f"--micro-batches {args.micro_batches}", args.micro_batches),
            (f"--backend {args.backend}", args.backend != "auto")) if given]):
        log.warning("%s: no effect on one node (they shape a pipeline of --nodes 2 or more)",
                    ", ".join(ignored))
    if len(plan.stages) == 1:  # one node holds everything: nothing to explain
        log.info("plan: every layer on one node")
    else:
        for line in plan.explanation:
            log.info("plan: %s", line)
    return _run_gateway(args, manager, keys)


def _warn_slow_blas() -> None:
    """Once, at start: serve's nodes log their machine checks to their own files, out of the
    user's sight; `join` runs them in its own process and logs them there."""
    from omlx_shared import checks

    checks.log_problems(checks.local_checks(only={"blas"}), log)


def coordinator_command(args: argparse.Namespace) -> int:
    from omlx_coordinator.nodes.cluster import ClusterOptions
    from omlx_shared.auth import new_secret
    from omlx_shared.discovery import default_interfaces

    secret = cluster_secret(args)  # first: a weak one is refused before any model is fetched
    checked = _keys_and_models(args)
    if checked is None:
        return 2
    keys, models = checked
    if secret is None:
        secret = new_secret()
        print(f"cluster secret (put it in a file for `omlx-cluster join --secret-file`, or "
              f"in $OMLX_CLUSTER_SECRET): {secret}", file=sys.stderr)
    options = ClusterOptions(nodes=0, micro_batches=args.micro_batches or 0, secret=secret,
                             backend=args.backend, parallel=args.parallel,
                             os_reserve_bytes=args.os_reserve,
                             context_tokens=args.context, max_sequences=args.sequences,
                             discovery=not args.no_discovery,
                             link_probe=not args.no_link_probe,
                             link_max_age_s=args.link_max_age,
                             discovery_interfaces=default_interfaces(args.host),
                             stall_seconds=args.stall_timeout)
    return _run_gateway(args, _manager(args, models, options), keys)
