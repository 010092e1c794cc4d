"""`join` and `node`: a node agent offered to a cluster or run alone."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading

from omlx_cluster.flags import cluster_secret, engine_config
from omlx_cluster.validators import is_loopback

REGISTER_WARN_SECONDS = 30.0  # join --coordinator: unanswered this long, a warning
REGISTER_BACKOFF_SECONDS = 120.0  # refused, it asks again ever less often, at most this far apart
log = logging.getLogger("omlx_cluster")


def join_command(args: argparse.Namespace) -> int:
    from omlx_node.agent import NodeAgent
    from omlx_shared import __version__
    from omlx_shared.child import write_ready
    from omlx_shared.hardware import chip, machine_memory

    secret = cluster_secret(args)
    if secret is None:
        print("error: joining a cluster needs its secret: --secret-file FILE, --secret S or "
              "$OMLX_CLUSTER_SECRET (the coordinator prints it)", file=sys.stderr)
        return 2
    if args.speed is not None and args.speed <= 0:
        print(f"error: --speed must be positive (GB/s), got {args.speed}", file=sys.stderr)
        return 2
    speed, layer_ms = args.speed, 0.0  # a speed given: nothing is measured
    if speed is None:
        from omlx_node.calibrate import node_calibration
        from omlx_shared.model_store import data_home

        measured = node_calibration(data_home() / "calibration.json",
                                    recalibrate=args.recalibrate)
        speed, layer_ms = measured.speed_gbps, measured.layer_ms
        if speed:
            log.info("this node streams weights at %.1f GB/s, and a layer costs a decode step "
                     "%.2f ms more (the planner's speed and fixed cost for it)", speed, layer_ms)
    disk = 0.0
    if args.weights_memory:  # it may stream layers from its disk: the planner counts the reads
        from omlx_node.disk_speed import node_disk_speed
        from omlx_shared.model_store import data_home, models_dir

        disk = node_disk_speed(data_home() / "disk-speed.json", models_dir(),
                               remeasure=args.recalibrate)
        if disk:
            log.info("its disk reads %.2f GB/s (the planner's cost of streamed layers)", disk)
    from omlx_shared.discovery import announce_address

    try:
        announced = announce_address(args.host)
        agent = NodeAgent(args.host, args.port, args.data_port, args.metrics_port,
                          engine_config(args), secret=secret, node_id=args.name, speed=speed,
                          worker_cache_bytes=args.hot_cache_max_size,
                          weights_cap=args.weights_memory, disk_gbps=disk,
                          orphan_grace=args.orphan_grace, layer_ms=layer_ms)
    except (OSError, ValueError) as e:
        print(f"error: --host {args.host}: {e}" if isinstance(e, ValueError) else f"error: {e}",
              file=sys.stderr)
        return 2
    advertiser = None
    if not args.no_announce:
        from omlx_shared.discovery import Advertiser, NodeAnnouncement, default_interfaces

        advertiser = Advertiser(NodeAnnouncement(
            node_id=agent.node_id, host=announced, port=agent.port,
            version=__version__, memory_bytes=machine_memory(), chip=chip(),
            data_port=agent.data_port), default_interfaces(args.host))
    if args.coordinator:
        register_periodically(args.coordinator, f"{announced}:{agent.port}",
                               agent.node_id, secret)
    if args.ready_file:
        write_ready(args.ready_file, {"port": agent.port, "pid": os.getpid()})
    try:
        agent.serve_forever()
    finally:
        if advertiser is not None:
            advertiser.close()
    return 0


def register_periodically(coordinator: str, address: str, node_id: str, secret: str,
                           every: float = 2.0,
                           longest: float = REGISTER_BACKOFF_SECONDS) -> threading.Event:
    """Tells the coordinator where this node is, again and again: it may restart, and it
    answers 'member' once it has admitted us. Each registration is signed with the secret
    and carries a fresh timestamp and nonce (the coordinator accepts each once). A refusal
    (another secret) is said once with its fix, and asked again ever less often: the secret
    does not change by itself. Returns the event that stops it."""
    import time

    import httpx

    from omlx_shared.auth import registration
    from omlx_shared.outsider_logs import cut

    def loop() -> None:
        url = f"http://{coordinator}/cluster/register"
        # One client for good: each new one builds a TLS context, costly in CPU, which at every
        # registration was most of what an idle `join` spent.
        client = httpx.Client(timeout=5)
        failing_since, warned, refused = None, False, 0
        delay = 0.0  # the first at once
        while not stop.wait(delay):
            delay = every
            try:
                r = client.post(url, json=registration(secret, address, node_id))
                failing_since, warned = None, False
                if r.status_code == 401:
                    refused += 1
                    delay = min(longest, every * 2 ** refused)
                    # Plain HTTP: whoever answers there writes this message.
                    said = cut(r.json()["error"]["message"])
                    if refused == 1:
                        log.warning(
                            "the coordinator %s refused this node's registration: %s. Its "
                            "cluster secret is not this node's: restart join with "
                            "--secret-file FILE holding the coordinator's secret (`omlx-cluster "
                            "up --secret-file FILE` copies it to the Macs). Asking again ever "
                            "less often, every %.0f s at most", coordinator, said, longest)
                    else:
                        log.debug("refused again by %s: %s", coordinator, said)
                elif refused:
                    log.info("the coordinator %s takes this node's registration now",
                             coordinator)
                    refused = 0
            except (httpx.HTTPError, ValueError, KeyError) as e:
                log.debug("registration with %s failed: %s", coordinator, e)
                # A coordinator restarting is gone for seconds; one that never answers is
                # worth a line.
                failing_since = failing_since or time.monotonic()
                if not warned and time.monotonic() - failing_since > REGISTER_WARN_SECONDS:
                    log.warning("cannot reach the coordinator at %s for %.0f s (%s): is it "
                                "running, and is that its HTTP address?", coordinator,
                                REGISTER_WARN_SECONDS, e)
                    warned = True

    stop = threading.Event()
    threading.Thread(target=loop, name="register", daemon=True).start()
    return stop


def node_command(args: argparse.Namespace) -> int:
    from omlx_node.agent import NodeAgent
    from omlx_shared.child import write_ready
    from proto import omlx_pb2 as pb

    secret = cluster_secret(args)
    if secret is None and not is_loopback(args.host):
        print(f"error: the node would listen on {args.host}, reachable from the network, "
              "without a cluster secret (anyone could load models on it and read its data "
              "plane): pass --secret-file FILE (or set OMLX_CLUSTER_SECRET), or listen on "
              "127.0.0.1", file=sys.stderr)
        return 2
    try:
        agent = NodeAgent(args.host, args.port, args.data_port, args.metrics_port,
                          engine_config(args), secret=secret, node_id=args.name,
                          worker_cache_bytes=args.hot_cache_max_size,
                          weights_cap=args.weights_memory)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.model:
        from omlx_shared.child import ChildError
        from omlx_shared.model_spec import resolve_model, served_name
        from omlx_shared.model_store import ModelError

        try:
            path = resolve_model(args.model, progress=False, fetch=False)
            agent.load(pb.LoadShardRequest(model_path=str(path),
                                           model_id=served_name(args.model, path)))
        except (ModelError, ChildError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.ready_file:
        write_ready(args.ready_file, {"port": agent.port, "data_port": agent.data_port,
                                      "pid": os.getpid(), "worker_address":
                                      agent.reply.worker_address if agent.reply else ""})
    agent.serve_forever(watch=args.exit_with_parent)
    return 0
