"""`omlx-cluster`: serve a model, run a node agent, manage the model store."""

from __future__ import annotations

import argparse
import logging
import math
import os
import socket
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from omlx_cluster.api_keys import ApiKeyError, add_api_key_flags, api_keys
from omlx_shared import __version__
from omlx_shared.block_hashes import DEFAULT_BLOCK_SIZE
from omlx_shared.speculative_modes import MODES

REGISTER_WARN_SECONDS = 30.0  # join --coordinator: unanswered this long, a warning
REGISTER_BACKOFF_SECONDS = 120.0  # refused, it asks again ever less often, at most this far apart
log = logging.getLogger("omlx_cluster")

if TYPE_CHECKING:
    from omlx_coordinator.keys import KeyRing


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _host_port(value: str) -> str:
    """HOST:PORT ([v6]:PORT); an http:// in front is dropped (a gateway's URL, pasted)."""
    text = value.strip().removeprefix("http://").rstrip("/")
    host, sep, port = text.rpartition(":")
    if "://" in text or not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT (e.g. 192.168.1.20:8000), got "
                                         f"{value!r}")
    return text


def _port(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a port is a number, got {value!r}") from None
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, got {n}")
    return n


def _add_gateway_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", action="append", default=None, metavar="[NAME=]PATH_OR_NAME",
                   help="an mlx-lm model folder (config.json, safetensors, tokenizer; "
                        "quantized folders too), the name of a model in the store "
                        "(`omlx-cluster models list`) or a Hugging Face id ORG/NAME (from "
                        "the Hugging Face cache, else downloaded into the store; a GGUF "
                        "repository imports one file, or ORG/NAME/FILE.gguf), optionally "
                        "NAME= the name clients "
                        "send; repeat it to serve several models (the first is the main "
                        "model: loaded first, rebalanced); default: the embedded SmolLM2")
    p.add_argument("--model-id", help="the name clients send for a single --model without "
                                      "NAME= (default: the folder name)")
    p.add_argument("--models-config", type=Path, metavar="FILE",
                   help="the models as a TOML file of [[model]] tables (name, path, aliases, "
                        "pin, ttl, replicas, max_queue, speculative), instead of --model "
                        "flags")
    p.add_argument("--alias", action="append", default=[], metavar="ALIAS=NAME",
                   help="another name clients may send for model NAME (repeatable; default: "
                        "none)")
    p.add_argument("--pin", action="append", default=[], metavar="NAME",
                   help="never unload model NAME to make room or for idling (repeatable; "
                        "default: none)")
    p.add_argument("--ttl", action="append", default=[], metavar="[NAME=]SECONDS",
                   help="unload a model idle for this long (for NAME, or for every model; "
                        "default: never); it loads again on the next request")
    p.add_argument("--replicas", action="append", default=[], metavar="[NAME=]N|auto",
                   help="run a model as N independent replicas (each one node or one "
                        "pipeline, requests routed to the replica holding their prompt's "
                        "prefix), or auto: replicas when the planner predicts they serve "
                        "more than one pipeline (default: 1)")
    p.add_argument("--routing", choices=["prefix", "round-robin"], default="prefix",
                   help="how requests pick one of a model's replicas: prefix (the replica "
                        "whose cache holds the longest prefix of the prompt, else the least "
                        "loaded) or round-robin (default: prefix)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address the gateway listens on (default: 127.0.0.1, this machine "
                        "only; 0.0.0.0 exposes it to the network and then needs --api-key)")
    p.add_argument("--port", type=_port, default=8000, help="gateway port (default: 8000)")
    add_api_key_flags(p, "a key clients must send as 'Authorization: Bearer KEY' or "
                         "'x-api-key: KEY' (repeatable; none: open, only allowed on a "
                         "loopback address); these are admin keys")
    p.add_argument("--batch-share", type=_share_or_all, default=0.5, metavar="SHARE",
                   help="of a model's running slots (--max-batch a replica), the share requests "
                        "of keys with priority = \"batch\" (--keys-file) may run in; the rest "
                        "stay free for interactive ones, which never wait behind them; a batch "
                        "request waits 30 s at most (default: 0.5)")
    p.add_argument("--tls", choices=["self-signed"], default=None,
                   help="serve HTTPS with a certificate made here once and kept in "
                        "$OMLX_CLUSTER_HOME/gateway-tls/ (its SHA-256 fingerprint is printed at "
                        "start, for clients to pin); or give your own with --tls-cert/--tls-key")
    p.add_argument("--tls-cert", type=Path, metavar="FILE",
                   help="serve HTTPS with this PEM certificate (chain), with --tls-key")
    p.add_argument("--tls-key", type=Path, metavar="FILE", help="the PEM key of --tls-cert")
    p.add_argument("--header-timeout", type=_positive_seconds, default=20.0, metavar="SECONDS",
                   help="close a connection that has not sent a whole request header this long "
                        "after it opened or its request began (slow or idle sockets; "
                        "default: 20)")
    p.add_argument("--max-connections", type=_positive, default=2048, metavar="N",
                   help="open connections at most; past it a new one closes the one idle "
                        "longest, so idle sockets cannot lock clients out (default: 2048)")
    p.add_argument("--protect-metrics", action="store_true",
                   help="/metrics needs an admin key too (Prometheus: the bearer credentials "
                        "in deploy/prometheus/prometheus.yml)")
    p.add_argument("--keys-file", type=Path, metavar="FILE",
                   help="named keys with roles (user: generate only; admin: also load, unload, "
                        "pin, rebalance, /cluster/*), allowed models, priority and quotas, as "
                        "TOML [[key]] tables (docs/security.md); read again when it changes, "
                        "no restart; usage per key is at /cluster/usage")
    p.add_argument("--max-queue", type=_positive, default=None, metavar="N",
                   help="the most requests of one model the gateway holds at once, decoding "
                        "or waiting (a request with n choices counts n); past it a request is "
                        "refused at once with 429 (Anthropic: 529) and a Retry-After from the "
                        "rate requests finished lately, rather than wait in memory for minutes; "
                        "a model's max_queue in --models-config wins (default: 4 x --max-batch: "
                        "one batch decoding and three waiting keep the batch full as sequences "
                        "end, while the last in line waits about three batches; `coordinator` "
                        "assumes the nodes' default --max-batch 64, so 256)")
    p.add_argument("--request-timeout", type=_positive_seconds, default=900.0,
                   metavar="SECONDS",
                   help="longest a request may run before it fails with 504 (default: 900)")
    p.add_argument("--keepalive", type=_positive_seconds, default=5.0, metavar="SECONDS",
                   help="a stream that wrote nothing for this long (a prompt being prefilled, "
                        "a tool call held back until it is whole, a model loading) sends an "
                        "SSE keep-alive comment (Anthropic: a ping event) (default: 5)")
    p.add_argument("--default-max-tokens", type=_positive, default=4096, metavar="N",
                   help="completion limit when a request sets none, capped by the context "
                        "(default: 4096)")
    p.add_argument("--log-file", type=Path, metavar="FILE",
                   help="also append the gateway's log (the access log included, GET /health "
                        "left out) to FILE, mode 0600 (default: the terminal only; node and "
                        "worker logs are in $OMLX_CLUSTER_HOME/logs/)")


def _is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _split(value: str) -> list[int]:
    try:
        parts = [int(p) for p in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer counts like 1,6,2, got {value!r}")
    if any(p < 1 for p in parts):
        raise argparse.ArgumentTypeError(f"every stage needs at least one layer: {value!r}")
    return parts


def _size(value: str) -> int:
    from omlx_coordinator.planner import parse_size

    if value.strip() in ("0", "0B"):
        return 0
    try:
        return parse_size(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))


def _milliseconds(value: str) -> float:
    x = float(value)
    if not 0 <= x <= 1000:
        raise argparse.ArgumentTypeError(f"must be 0 to 1000 milliseconds, got {value}")
    return x


def _positive_size(value: str) -> int:
    n = _size(value)
    if n == 0:
        raise argparse.ArgumentTypeError("must be more than 0 bytes")
    return n


def _size_or_auto(value: str) -> int | None:
    return None if value.strip().lower() == "auto" else _size(value)


def _add_kv_reserve_flags(p: argparse.ArgumentParser) -> None:
    """The KV memory a plan sets aside on each stage beside its weights."""
    p.add_argument("--context", type=_positive, default=4096, metavar="TOKENS",
                   help="KV reserved per sequence when planning (default: 4096)")
    p.add_argument("--sequences", type=_positive, default=8, metavar="N",
                   help="concurrent sequences the KV reserve covers (default: 8)")


def _add_hot_cache_flag(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--hot-cache-max-size", type=_size, default="1GiB", metavar="SIZE",
                   help=f"{help} (default: 1GiB)")


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill-chunk", type=_positive, default=None, metavar="TOKENS",
                   help="prompt tokens computed per engine step; a long prompt delays running "
                        "streams by at most one chunk (default: 2048 on a GPU, 512 on a CPU)")
    p.add_argument("--max-batch", type=_positive, default=64, metavar="N",
                   help="most sequences decoding at once on a node; more wait in a queue "
                        "(default: 64)")
    p.add_argument("--speculative", choices=MODES, default="auto",
                   help="speculative decoding on a single-node model: ngram drafts a "
                        "sequence's next tokens from its own prompt and output (prompt lookup) "
                        "and verifies them in one step, auto is ngram today, off decodes one "
                        "token a step; a request's OpenAI `prediction` drafts whatever this "
                        "says; a model's speculative in --models-config wins; pipelines of "
                        "several stages never speculate (default: auto)")
    p.add_argument("--stream-interval", type=_milliseconds, default=20.0, metavar="MS",
                   help="where a node decodes faster than this, the tokens of one interval go "
                        "to the gateway as one message (a third less gateway CPU a token at "
                        "batch 1 on a GPU); a stream's first token and its end are never held; "
                        "0 sends every step's tokens at once (default: 20)")
    _add_hot_cache_flag(p, "RAM for the prefix KV cache of each stage, e.g. 4GiB; 0 turns the "
                           "prefix cache off; plans count it beside the stage's weights and KV")
    p.add_argument("--device-cache-max-size", type=_size_or_auto, default=None, metavar="SIZE",
                   help="device memory for the latest prompts' prefix KV blocks, restored without "
                        "a copy from RAM; pays off where the device has memory of its own (a "
                        "CUDA GPU), where a RAM hit costs more than prefilling again; 0 turns it "
                        "off (default: auto, 1/16 of a CUDA device's memory up to 8GiB, 0 where "
                        "device and host share memory: Apple silicon, a CPU)")
    p.add_argument("--paged-ssd-cache-dir", type=Path, metavar="DIR",
                   help="where each stage keeps prefix KV blocks on disk, surviving restarts "
                        "(default: $OMLX_CLUSTER_HOME/kv-cache)")
    p.add_argument("--paged-ssd-cache-max-size", type=_size, default="16GiB", metavar="SIZE",
                   help="disk for each stage's prefix KV blocks, and as much again for "
                        "those no running stage uses (layer ranges a re-plan left, models not "
                        "loaded, older weights), least recently used pruned first; 0 keeps the "
                        "cache in RAM only (default: 16GiB)")
    p.add_argument("--cache-block-size", type=_positive, default=DEFAULT_BLOCK_SIZE,
                   metavar="TOKENS",
                   help=f"tokens per prefix-cache block (default: {DEFAULT_BLOCK_SIZE})")


def _add_pipeline_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--micro-batches", type=_positive, default=None, metavar="K",
                   help="decode micro-batches kept in flight in a pipeline, always K (default: "
                        "up to one per stage, as many as pay off on the head's device, measured "
                        "at start; 1 is the lockstep pipeline)")
    p.add_argument("--backend", choices=["auto", "ring", "jaccl"], default="auto",
                   help="the data plane between pipeline stages. auto: jaccl (RDMA over "
                        "Thunderbolt 5) when every pair of neighbouring stages (and the last "
                        "and the first) is joined by a Thunderbolt cable between Macs with "
                        "RDMA enabled (macOS 26.2+, `rdma_ctl enable` in macOS Recovery), "
                        "otherwise ring (TCP); a jaccl group that fails to form is loaded "
                        "again over ring. ring: always TCP. jaccl: RDMA or refuse to serve, "
                        "naming the missing cables. GET /cluster/status shows the choice and "
                        "why (default: auto)")


def _share(value: str) -> float:
    x = float(value)
    if not 0 < x < 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1 (0.15 is 15%), got {x}")
    return x


def _share_or_all(value: str) -> float:
    x = float(value)
    if not 0 < x <= 1:
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most 1 (0.5 is half), "
                                         f"got {x}")
    return x


def _seconds(value: str) -> float:
    x = float(value)
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {value!r}")
    if x < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {x}")
    return x


def _gateway_url(value: str) -> str:
    """A gateway's address: HOST:PORT is taken as http://HOST:PORT, and the base URL the SDK
    examples use (ending in /v1) as the gateway's own (the cluster routes are beside /v1)."""
    url = (value if "://" in value else "http://" + value).rstrip("/")
    return url.removesuffix("/v1")


def _add_url_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", type=_gateway_url, default="http://127.0.0.1:8000",
                   help="the gateway's address, or the base URL clients use (ending in /v1) "
                        "(default: http://127.0.0.1:8000)")


def _unload_wait(value: str) -> float:
    x = _seconds(value)
    if x > 3600:  # the gateway's own limit (api/models.py)
        raise argparse.ArgumentTypeError(f"must be at most 3600 seconds, got {x:g}")
    return x


def _positive_seconds(value: str) -> float:
    x = _seconds(value)
    if x == 0:
        raise argparse.ArgumentTypeError("must be more than 0 seconds")
    return x


def _add_rebalance_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rebalance", choices=["auto", "advise", "off"], default="auto",
                   help="move layers between nodes from their measured speeds and memory "
                        "pressure while serving. auto: move; advise: only log and show "
                        "(`omlx-cluster rebalance`) what it would do; off: measure nothing "
                        "(default: auto)")
    p.add_argument("--rebalance-threshold", type=_share, default=0.15, metavar="SHARE",
                   help="move only when the best split's predicted bottleneck beats the "
                        "current one by more than this share (default: 0.15)")
    p.add_argument("--rebalance-window", type=_positive_seconds, default=60.0, metavar="SECONDS",
                   help="... in each third of a window of this many seconds (default: 60)")
    p.add_argument("--rebalance-cooldown", type=_seconds, default=300.0, metavar="SECONDS",
                   help="and at least this long after the last move (default: 300)")
    p.add_argument("--prometheus-url", metavar="URL",
                   help="read the stages' metrics from this Prometheus (its /api/v1/query) "
                        "instead of scraping every stage (default: scrape)")


def _rebalance_settings(args: argparse.Namespace):
    from omlx_coordinator.rebalancer import Policy, RebalanceSettings

    # The memory pressure window follows a short --rebalance-window down, never above 10 s.
    policy = Policy(threshold=args.rebalance_threshold, window=args.rebalance_window,
                    cooldown=args.rebalance_cooldown,
                    pressure_window=min(Policy.pressure_window, args.rebalance_window))
    return RebalanceSettings(args.rebalance, policy, args.prometheus_url)


def _add_secret_file_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--secret-file", type=Path, metavar="FILE",
                   help="read the cluster secret from FILE (mode 0600; other users must not "
                        "read it), so it never shows in `ps`")


def _secret(args: argparse.Namespace) -> str | None:
    """The secret from --secret, --secret-file or the environment; exits 2 on a bad file."""
    from omlx_shared.auth import SecretError, secret_from

    try:
        return secret_from(args.secret, args.secret_file)
    except SecretError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _engine_args(args: argparse.Namespace) -> list[str]:
    """The engine flags as given, to pass on to the process that runs the engine."""
    out = ["--max-batch", str(args.max_batch),
           "--hot-cache-max-size", f"{args.hot_cache_max_size}B",
           "--paged-ssd-cache-max-size", f"{args.paged_ssd_cache_max_size}B",
           "--cache-block-size", str(args.cache_block_size), "--log-level", args.log_level,
           "--stream-interval", str(args.stream_interval), "--speculative", args.speculative]
    if args.prefill_chunk:  # else the worker sizes it for its own device
        out += ["--prefill-chunk", str(args.prefill_chunk)]
    if args.paged_ssd_cache_dir:
        if not args.paged_ssd_cache_max_size:
            log.warning("--paged-ssd-cache-dir has no effect: --paged-ssd-cache-max-size 0 "
                        "keeps the prefix cache in RAM only")
        out += ["--paged-ssd-cache-dir", str(args.paged_ssd_cache_dir)]
    if args.device_cache_max_size is not None:
        out += ["--device-cache-max-size", f"{args.device_cache_max_size}B"]
    return out


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omlx-cluster",
        description="Turn the Macs of an office (or one Mac) into one OpenAI-compatible LLM "
                    "endpoint. Data lives under $OMLX_CLUSTER_HOME (default ~/.omlx-cluster).",
    )
    parser.add_argument("--version", action="version", version=f"omlx-cluster {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"], help="(default: info)")
    # The same flag after a nested action (`models list --log-level debug`); suppressed when
    # absent, so that it does not undo one given before the action.
    nested = argparse.ArgumentParser(add_help=False)
    nested.add_argument("--log-level", default=argparse.SUPPRESS,
                        choices=["debug", "info", "warning", "error"], help="(default: info)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser(
        "serve", parents=[common], help="serve a model on this machine (gateway + one local node)",
        description="Start the OpenAI-compatible gateway and one local node holding every layer "
                    "(single-Mac mode). Without --model it serves the embedded default model, "
                    "SmolLM2-135M-Instruct, imported on first run. GET /health answers 200 once "
                    "the model is ready.",
    )
    _add_gateway_flags(serve)
    serve.add_argument("--node-metrics-port", type=_port, default=0, metavar="PORT",
                       help="each local node's shard worker exports Prometheus /metrics on its "
                            "own port: PORT, PORT+1, ... (0: any free port; GET "
                            "/cluster/status and /cluster/prometheus-targets show them; "
                            "default: 0)")
    serve.add_argument("--nodes", type=_positive, default=1, metavar="N",
                       help="run the model as a pipeline of N local node processes joined by "
                            "mx.distributed (default: 1, single-Mac mode)")
    serve.add_argument("--split", type=_split, metavar="A,B,...",
                       help="the main model's layers per node, e.g. 1,6,2 (must sum to its "
                            "layers, no stage empty; default: the planner's split)")
    serve.add_argument("--node-memory", type=_positive_size, default=None, metavar="SIZE",
                       help="memory each local node may hold for models (default: this "
                            "machine's memory less --os-reserve, shared by the nodes); models "
                            "past it evict the least recently used idle ones")
    serve.add_argument("--os-reserve", type=_size, default="4GiB", metavar="SIZE",
                       help="memory this machine keeps for its OS and apps; the local nodes "
                            "share the rest (default: 4GiB; ignored with --node-memory)")
    _add_kv_reserve_flags(serve)
    _add_pipeline_flags(serve)
    _add_rebalance_flags(serve)
    _add_engine_flags(serve)

    node = sub.add_parser(
        "node", parents=[common], help="run a node agent (gRPC server that runs model shards)",
        description="Run a node agent: the gRPC server (proto/omlx.proto, NodeAgent) that starts "
                    "a shard worker for each plan it is given. `serve` starts its own.",
    )
    node.add_argument("--host", default="127.0.0.1",
                      help="address for gRPC and the data plane (default: 127.0.0.1)")
    node.add_argument("--port", type=_port, default=50051, help="gRPC port, 0 for any (default: 50051)")
    node.add_argument("--data-port", type=_port, default=0,
                      help="mx.distributed (ring) port of this node's workers (default: any free)")
    node.add_argument("--ready-file", type=Path,
                      help="write {port, data_port, pid, worker_address} as JSON here once "
                           "listening")
    node.add_argument("--metrics-port", type=_port, default=0, metavar="PORT",
                      help="the shard worker exports Prometheus /metrics on this port "
                           "(default: 0, any free port)")
    node.add_argument("--model", metavar="PATH_OR_NAME",
                      help="load this whole model at start instead of waiting for LoadShard")
    node.add_argument("--exit-with-parent", action="store_true",
                      help="exit when the process that started this node exits")
    node.add_argument("--secret", help="the cluster secret a coordinator must prove it holds "
                                       "(default: --secret-file, then $OMLX_CLUSTER_SECRET; "
                                       "none: any coordinator, allowed on a loopback address "
                                       "only)")
    _add_secret_file_flag(node)
    node.add_argument("--name", default="",
                      help="this node's id (default: the host name plus a key kept in "
                           "$OMLX_CLUSTER_HOME/node-key: unique and stable)")
    _add_engine_flags(node)

    worker = sub.add_parser(
        "worker", parents=[common], help="(internal) a shard worker, started by a node agent",
        description="A shard worker: joins the plan's mx.distributed group, loads its layers and "
                    "runs them. Node agents start these; you should not need to.",
    )
    worker.add_argument("--model", type=Path, help="mlx-lm model folder (required)")
    worker.add_argument("--model-id", help="the name clients use (required)")
    worker.add_argument("--layers", metavar="START:END",
                        help="layer range [START, END); END may be empty for the last layer "
                             "(required)")
    worker.add_argument("--standby", action="store_true",
                        help="import everything, then wait for the rest of the arguments as "
                             "one JSON line {argv, env} on stdin (how an agent keeps a worker "
                             "ready for its next plan)")
    worker.add_argument("--rank", type=int, default=0, help="this stage's rank (default: 0)")
    worker.add_argument("--peers", default="",
                        help="comma-separated data-plane host:port of every rank, in rank "
                             "order (default: none, a single-stage plan)")
    worker.add_argument("--backend", default="ring", choices=["ring", "jaccl"],
                        help="mx.distributed backend: ring (TCP between the peers' addresses) "
                             "or jaccl (RDMA over Thunderbolt 5, with --rdma-devices; rank 0's "
                             "peer address is its side channel) (default: ring)")
    worker.add_argument("--rdma-devices", default="", metavar="JSON",
                        help="for jaccl: MLX's MLX_IBV_DEVICES matrix, one row per rank with "
                             "each rank's RDMA device (null: no cable) (default: none)")
    worker.add_argument("--plan-hash", default="", help="the plan every stage must agree on (default: none)")
    worker.add_argument("--micro-batches", type=int, default=0,
                        help="decode micro-batches in flight on the head, always K (default 0: "
                             "up to one per stage, as many as pay off on this device)")
    worker.add_argument("--host", default="127.0.0.1", help="gRPC address of the head worker (default: 127.0.0.1)")
    worker.add_argument("--metrics-port", type=_port, default=0,
                        help="export Prometheus /metrics on this port (default: 0, any free "
                             "port)")
    worker.add_argument("--node-id", default="",
                        help="the node's id, a label on every metric (default: none)")
    worker.add_argument("--init-timeout", type=float, default=60.0, metavar="SECONDS",
                        help="give up if the group has not formed by then (default: 60)")
    worker.add_argument("--ready-file", type=Path, help="write readiness JSON here")
    _add_engine_flags(worker)

    coordinator = sub.add_parser(
        "coordinator", parents=[common], help="run the gateway for nodes that join over the LAN",
        description="Run the OpenAI-compatible gateway and cluster control without a local "
                    "node. Nodes (`omlx-cluster join` on each Mac) are found over Bonjour or "
                    "register themselves, and are admitted only after proving they hold the "
                    "cluster secret. The model is planned over the nodes as they come and go.",
    )
    _add_gateway_flags(coordinator)
    coordinator.add_argument("--secret", help="the cluster secret; `ps` shows it, so prefer "
                                              "--secret-file (default: --secret-file, then "
                                              "$OMLX_CLUSTER_SECRET; none: one is made up and "
                                              "printed)")
    _add_secret_file_flag(coordinator)
    coordinator.add_argument("--os-reserve", type=_size, default="8GiB", metavar="SIZE",
                             help="memory every node keeps for its OS (default: 8GiB)")
    _add_kv_reserve_flags(coordinator)
    coordinator.add_argument("--no-discovery", action="store_true",
                             help="do not browse Bonjour; only `join --coordinator` nodes join")
    _add_pipeline_flags(coordinator)
    _add_rebalance_flags(coordinator)

    join = sub.add_parser(
        "join", parents=[common], help="offer this Mac to a cluster (a node agent)",
        description="Run a node agent that announces itself over Bonjour "
                    "(_omlx-node._tcp.local.) and serves the coordinator that proves it holds "
                    "the cluster secret. --coordinator registers directly where multicast is "
                    "blocked.",
    )
    join.add_argument("--secret", help="the cluster secret; `ps` shows it, so prefer "
                                       "--secret-file (default: --secret-file, then "
                                       "$OMLX_CLUSTER_SECRET; one is required)")
    _add_secret_file_flag(join)
    join.add_argument("--host", default="127.0.0.1",
                      help="address for gRPC and the data plane (default: 127.0.0.1; use this "
                           "Mac's LAN address, or 0.0.0.0, to join other Macs)")
    join.add_argument("--port", type=_port, default=50051, help="gRPC port (default: 50051)")
    join.add_argument("--data-port", type=_port, default=0,
                      help="mx.distributed (ring) port (default: any free)")
    join.add_argument("--name", default="",
                      help="this node's id (default: the host name plus a key kept in "
                           "$OMLX_CLUSTER_HOME/node-key: unique and stable)")
    join.add_argument("--coordinator", type=_host_port, metavar="HOST:PORT",
                      help="also register with the coordinator's HTTP address directly, every "
                           "few seconds (default: Bonjour only)")
    join.add_argument("--metrics-port", type=_port, default=0, metavar="PORT",
                      help="the shard worker exports Prometheus /metrics here; the coordinator's "
                           "/cluster/prometheus-targets tells Prometheus (default: 0, any free "
                           "port)")
    join.add_argument("--no-announce", action="store_true",
                      help="do not announce over Bonjour (use with --coordinator)")
    join.add_argument("--speed", type=float, default=None, metavar="GBPS",
                      help="this Mac's weight-streaming speed in GB/s for the planner (default: "
                           "measured once, about 2 s, and kept in "
                           "$OMLX_CLUSTER_HOME/calibration.json)")
    join.add_argument("--recalibrate", action="store_true",
                      help="measure the speed again instead of using the saved measurement")
    join.add_argument("--ready-file", type=Path,
                      help="write {port, pid} as JSON here once listening")
    join.add_argument("--orphan-grace", type=_seconds, default=600.0, metavar="SECONDS",
                      help="unload this Mac's models once no coordinator has called for this "
                           "long (0: never), so a cluster that is gone holds no memory here; "
                           "the node keeps running and loads again when a coordinator returns "
                           "(default: 600)")
    _add_engine_flags(join)

    plan = sub.add_parser(
        "plan", parents=[common], help="show how a model would be split over nodes",
        description="Plan contiguous, uneven layer ranges of a model over nodes: the split that "
                    "minimises the slowest stage's time within every node's memory, and why. "
                    "Reads only the model's safetensors headers.",
    )
    plan.add_argument("--model", metavar="PATH_OR_NAME",
                      help="model folder or stored name (default: the embedded SmolLM2)")
    plan.add_argument("--node", action="append", required=True, metavar="NAME=MEM[,speed=X][,link_ms=Y]",
                      help="a node, in pipeline order: NAME=MEM with a unit (e.g. mac1=64GiB), "
                           "optional speed=GB/s of weights it streams and link_ms=one-way "
                           "latency to the next node; repeat for each node")
    plan.add_argument("--split", type=_split, metavar="A,B,...",
                      help="check and explain this split instead of optimising")
    plan.add_argument("--os-reserve", type=_size, default="8GiB", metavar="SIZE",
                      help="memory kept free on every node (default: 8GiB, a joined Mac's; "
                           "serve's own local nodes share the machine less 4 GiB)")
    _add_kv_reserve_flags(plan)
    _add_hot_cache_flag(plan, "RAM each node's shard worker keeps for its prefix KV cache, as "
                              "`join --hot-cache-max-size` sets it")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")

    status = sub.add_parser(
        "status", parents=[common], help="show the nodes of a running cluster",
        description="Ask a running coordinator (`serve`) for its nodes: id, address, health, "
                    "layer range, agent and shard worker pids, metrics address, and the "
                    "active plan.")
    _add_url_flag(status)
    status.add_argument("--json", action="store_true", help="print the raw JSON")
    add_api_key_flags(status, "a key the gateway takes (the first is sent)")

    rebalance = sub.add_parser(
        "rebalance", parents=[common], help="show or apply the best split for measured speeds",
        description="Ask a running coordinator for each node's measured speed, the current and "
                    "the best split for those speeds and the predicted gain, and move to it "
                    "now (past the threshold, window and cooldown), unless --dry-run.")
    rebalance.add_argument("--dry-run", action="store_true", help="show, do not move")
    _add_url_flag(rebalance)
    add_api_key_flags(rebalance, "a key the gateway takes (the first is sent)")
    rebalance.add_argument("--json", action="store_true", help="print the raw JSON")

    models = sub.add_parser("models", parents=[common],
                            help="manage the local model store, or a running gateway's models",
                            description="Manage the model store under "
                                        "$OMLX_CLUSTER_HOME/models (list, pull, import-gguf, "
                                        "pull-default), or the models a running gateway "
                                        "serves (load, unload, pin, unpin).")
    msub = models.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    msub.add_parser("list", parents=[nested], help="list the models in the store")
    for action, what in (("load", "load a model now (evicting idle ones if memory is short)"),
                         ("unload", "unload a model (refused while it has requests in flight, "
                                    "unless --wait)"),
                         ("pin", "never unload a model to make room or for idling"),
                         ("unpin", "let a model be unloaded again")):
        a = msub.add_parser(action, parents=[nested], help=what,
                            description=what[0].upper() + what[1:] + ".")
        a.add_argument("name", help="the model's name (as GET /v1/models lists it)")
        _add_url_flag(a)
        add_api_key_flags(a, "a key the gateway takes (the first is sent)")
        if action == "unload":
            a.add_argument("--wait", type=_unload_wait, default=0.0, metavar="SECONDS",
                           help="wait this long for its requests in flight to end, at most "
                                "3600 (default: 0, refuse at once)")
    imp = msub.add_parser("import-gguf", parents=[nested], help="import a GGUF file (F32/F16/BF16/Q8_0/Q4_0/Q4_1)",
                          description="Convert a GGUF file (llama, qwen2, qwen3, qwen3moe, "
                                      "gemma3 or phi3 family) into an MLX "
                                      "model folder in the store. Q8_0/Q4_0/Q4_1 stay quantized "
                                      "(exactly, as MLX affine quantization).")
    imp.add_argument("file", type=Path, help="the .gguf file")
    imp.add_argument("--dest", type=Path, help="output folder (default: the store, named after "
                                               "the model)")
    msub.add_parser("pull-default", parents=[nested], help="fetch and import the embedded default model now")
    pull = msub.add_parser(
        "pull", parents=[nested], help="fetch a model by its Hugging Face id now",
        description="Make a model named by its Hugging Face id ready to serve: found in the "
                    "Hugging Face cache (HF_HUB_CACHE, else HF_HOME/hub, else "
                    "~/.cache/huggingface/hub; where `hf download` and mlx-lm put models), "
                    "else downloaded into the store (resumed if interrupted; HF_ENDPOINT, "
                    "HF_TOKEN and HF_HUB_OFFLINE apply). A repository of GGUF files imports "
                    "one of them as import-gguf does (Q8_0 first, then Q4_1, Q4_0, BF16, F16, "
                    "F32), or the one named as ORG/NAME/FILE.gguf.")
    pull.add_argument("repo_id", metavar="ORG/NAME",
                      help="e.g. mlx-community/Qwen3-4B-4bit, then `serve --model ORG/NAME`")
    secret = sub.add_parser("secret", parents=[common], help="make a cluster secret",
                            description="The cluster secret is the root of trust of a "
                                        "cluster (docs/security.md): `coordinator`, `join` and "
                                        "`node` refuse one under 20 characters or easy to "
                                        "guess. `secret new` makes a random one (256 bits).")
    ssub = secret.add_subparsers(dest="secret_command", required=True, metavar="ACTION")
    secret_new = ssub.add_parser("new", parents=[nested],
                                 help="print a new random secret, or write it to a file",
                          description="Print a new random cluster secret, or write it to "
                                      "--file with mode 0600 (pass that file as --secret-file, "
                                      "and `up --secret-file` copies it to the Macs).")
    secret_new.add_argument("--file", type=Path, metavar="PATH",
                            help="write the secret to PATH (mode 0600) instead of printing it")
    secret_new.add_argument("--force", action="store_true",
                            help="replace PATH if it exists (nodes holding the old secret are "
                                 "no longer admitted)")
    _add_office_commands(sub, common)
    return parser


def _add_ssh_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("hosts", nargs="*", metavar="HOST",
                   help="[user@]host[:port] or a Host of your SSH config, in ring order")
    p.add_argument("--hosts-file", type=Path, metavar="FILE",
                   help="more hosts, one per line (# comments)")
    p.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS",
                   help="to connect and log in over SSH (default: 10)")
    p.add_argument("--ssh-config", type=Path, metavar="FILE",
                   help="an OpenSSH client config to read instead of ~/.ssh/config (keys, "
                        "users, ports, known_hosts; the SSH agent is used either way)")


def _add_remote_command_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--remote-command", default="omlx-cluster", metavar="CMD",
                   help="how to run omlx-cluster on the hosts (default: omlx-cluster on the "
                        "PATH of an SSH session, which is short on a Mac: give the full path "
                        "of a virtualenv's, e.g. ~/omlx/.venv/bin/omlx-cluster)")


def _add_node_port_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--node-port", type=_port, metavar="PORT", default=50051,
                   help="join's gRPC port on the hosts (default: 50051)")
    p.add_argument("--metrics-port", type=_port, metavar="PORT", default=9101,
                   help="join's metrics port on the hosts (default: 9101)")


def _add_office_commands(sub, common: argparse.ArgumentParser) -> None:
    """`doctor`, `up`, `down` and `link-probe`: running an office cluster over SSH."""
    from omlx_shared.checks import CHECK_NAMES

    doctor = sub.add_parser(
        "doctor", parents=[common], help="check the Macs of a cluster (or this machine)",
        description="Check every Mac over SSH, all at once, and print one table of what passes, "
                    "what to fix and how: macOS, chip and memory, versions, disk, Thunderbolt, "
                    "RDMA, the GPU wired-memory limit, sleep, firewall, the secret file, clock "
                    "skew, the ports, Bonjour, and the data plane's bandwidth and latency "
                    "between ring neighbours. With no host, checks this machine. "
                    "hardware_checklist.md says why each matters. Exits 1 when a check fails.")
    _add_ssh_flags(doctor)
    _add_remote_command_flag(doctor)
    doctor.add_argument("--json", action="store_true", help="print the results as JSON")
    doctor.add_argument("--check", action="append", metavar="NAME",
                        choices=CHECK_NAMES,
                        help="run only this check (repeatable): %(choices)s")
    doctor.add_argument("--secret-file", type=Path, metavar="FILE",
                        help="the cluster secret: every host's secret file must hold it (and "
                             "without a host, this file is checked)")
    doctor.add_argument("--model", metavar="PATH_OR_NAME",
                        help="plan this model over the hosts, so that the disk and GPU "
                             "wired-memory checks judge each host's planned shard")
    _add_node_port_flags(doctor)
    doctor.add_argument("--probe-port", type=_port, metavar="PORT", default=31070,
                        help="rank 0 of a link probe listens on it, rank 1 on the next one "
                             "(default: 31070, below Linux's and macOS's ephemeral ranges, so "
                             "no outgoing connection of a host holds it)")

    up = sub.add_parser(
        "up", parents=[common], help="start join on Macs over SSH (a launchd job)",
        description="On every host over SSH: check the versions, copy the secret file (0600), "
                    "install and load the launchd job of deploy/launchd for `join` (on Linux, "
                    "where there is no launchd: join under nohup with a pid file), then wait "
                    "until the coordinator has admitted the node. Each step is reported; a "
                    "second run changes nothing.")
    _add_ssh_flags(up)
    _add_remote_command_flag(up)
    up.add_argument("--secret-file", type=Path, metavar="FILE",
                    help="the cluster secret (mode 0600), copied to each host (default: "
                         "$OMLX_CLUSTER_HOME/secret, made with a new random secret if missing: "
                         "start the coordinator with --secret-file pointing at it)")
    up.add_argument("--coordinator", type=_host_port, metavar="HOST:PORT",
                    help="the coordinator's HTTP address: join registers with it, and up waits "
                         "for the admission there (default: Bonjour only, no wait)")
    add_api_key_flags(up, "the coordinator's API key, to read /cluster/status (the first is "
                          "sent)")
    _add_node_port_flags(up)
    up.add_argument("--wait", type=_seconds, default=120.0, metavar="SECONDS",
                    help="for the admission, with --coordinator (default: 120; 0: do not "
                         "wait)")

    down = sub.add_parser(
        "down", parents=[common], help="stop join on Macs over SSH",
        description="On every host over SSH: unload and remove the launchd job `up` installed "
                    "(on Linux: stop the join it started). Its layers are re-planned over the "
                    "other nodes.")
    _add_ssh_flags(down)

    probe = sub.add_parser(
        "link-probe", parents=[common], help="measure the data plane between two machines",
        description="One rank of a two-rank mx.distributed (ring) probe: run rank 0 on one "
                    "machine and rank 1 on the other at once, with the same --peers; rank 0 "
                    "prints the bandwidth and latency (doctor runs both over SSH).")
    probe.add_argument("--rank", type=int, choices=[0, 1], required=True,
                       help="this machine's rank: 0 measures, 1 answers")
    probe.add_argument("--peers", required=True, metavar="HOST:PORT,HOST:PORT",
                       help="the address rank 0 listens on, then rank 1's")
    probe.add_argument("--bytes", type=_positive, default=8 << 20,
                       help="size of the large message (default: 8 MiB)")
    probe.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS",
                       help="give up when the other rank has not answered by then (default: 30)")
    probe.add_argument("--json", action="store_true", help="print the measurement as JSON")


def _api_keys(args: argparse.Namespace) -> KeyRing | None:
    """The gateway's API keys; None (after printing why) when the address needs one."""
    from omlx_coordinator.keys import KeyRing, KeysFileError

    try:
        keys = KeyRing(api_keys(args), args.keys_file)
    except (ApiKeyError, KeysFileError) as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    except OSError as e:
        print(f"error: --keys-file {args.keys_file}: {e.strerror or e}", file=sys.stderr)
        return None
    if keys.open and not _is_loopback(args.host):
        print(f"error: the gateway would listen on {args.host}, reachable from the network, "
              "without an API key: pass --api-key-file FILE (or --api-key KEY, or set "
              "OMLX_CLUSTER_API_KEY), or listen on 127.0.0.1", file=sys.stderr)
        return None
    return keys


def _run_gateway(args: argparse.Namespace, manager, keys: KeyRing) -> int:
    """Serves the gateway in front of `manager`'s models until stopped; 1 if it could not
    start."""
    import uvicorn

    from omlx_coordinator.access_log import redact_access_log
    from omlx_coordinator.connections import guarded, raise_open_files
    from omlx_coordinator.gateway import create_app
    from omlx_coordinator.generation import GatewaySettings

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
                     rebalance=_rebalance_settings(args))
    # uvloop and httptools, named rather than "auto" (which quietly falls back to asyncio's
    # loop and h11): at many streams the gateway's event loop is a bottleneck of its own.
    # An idle client connection is kept 75 s (nginx's default), longer than clients keep theirs
    # (httpx and the OpenAI SDK: 5 s). With uvicorn's 5 s, an agent's next turn ~5 s after its
    # last raced the server closing that connection: "Server disconnected without sending a
    # response". The client must be the one that lets it go.
    # The protocol is httptools', with deadlines for headers and a bound on connections.
    raise_open_files(args.max_connections)
    server = uvicorn.Server(uvicorn.Config(
        app, log_level=args.log_level, timeout_graceful_shutdown=5, timeout_keep_alive=75,
        loop="uvloop", http=guarded(args.header_timeout, args.max_connections),
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
    from omlx_coordinator.gateway_tls import GatewayTLSError, checked, self_signed
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
    handler = logging.StreamHandler(os.fdopen(fd, "a", buffering=1))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("", "uvicorn", "uvicorn.access"):
        logging.getLogger(name).addHandler(handler)


def _keys_and_models(args: argparse.Namespace):
    """What every gateway command checks first: the API keys and the served models (every
    folder resolved and checked now, so a config naming a missing one fails at start). None
    (after saying why) to exit with 2."""
    from dataclasses import replace

    from omlx_coordinator import model_config as mc
    from omlx_coordinator.admission import default_bound
    from omlx_coordinator.served_model import ServedModel
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
    from omlx_coordinator.cluster import Cluster
    from omlx_coordinator.lifecycle import ModelManager

    return ModelManager(Cluster(options), models,
                        block_size=getattr(args, "cache_block_size", None) or DEFAULT_BLOCK_SIZE,
                        routing_mode=args.routing)


def _serve(args: argparse.Namespace) -> int:
    from omlx_coordinator.cluster import ClusterOptions
    from omlx_coordinator.planner import PlanError
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
                             node_args=tuple(_engine_args(args)),
                             node_metrics_port=args.node_metrics_port,
                             node_memory_bytes=args.node_memory or 0,
                             local_reserve_bytes=args.os_reserve,
                             context_tokens=args.context, max_sequences=args.sequences,
                             worker_cache_bytes=args.hot_cache_max_size,
                             secret=new_secret())
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


def _coordinator(args: argparse.Namespace) -> int:
    from omlx_coordinator.cluster import ClusterOptions
    from omlx_shared.auth import new_secret
    from omlx_shared.discovery import default_interfaces

    secret = _secret(args)  # first: a weak one is refused before any model is fetched
    checked = _keys_and_models(args)
    if checked is None:
        return 2
    keys, models = checked
    if secret is None:
        secret = new_secret()
        print(f"cluster secret (put it in a file for `omlx-cluster join --secret-file`, or "
              f"in $OMLX_CLUSTER_SECRET): {secret}", file=sys.stderr)
    options = ClusterOptions(nodes=0, micro_batches=args.micro_batches or 0, secret=secret,
                             backend=args.backend,
                             os_reserve_bytes=args.os_reserve,
                             context_tokens=args.context, max_sequences=args.sequences,
                             discovery=not args.no_discovery,
                             discovery_interfaces=default_interfaces(args.host))
    return _run_gateway(args, _manager(args, models, options), keys)


def _join(args: argparse.Namespace) -> int:
    from omlx_node.agent import NodeAgent
    from omlx_shared import __version__
    from omlx_shared.child import write_ready
    from omlx_shared.hardware import chip, machine_memory

    secret = _secret(args)
    if secret is None:
        print("error: joining a cluster needs its secret: --secret-file FILE, --secret S or "
              "$OMLX_CLUSTER_SECRET (the coordinator prints it)", file=sys.stderr)
        return 2
    if args.speed is not None and args.speed <= 0:
        print(f"error: --speed must be positive (GB/s), got {args.speed}", file=sys.stderr)
        return 2
    speed = args.speed
    if speed is None:
        from omlx_node.calibrate import node_speed
        from omlx_shared.model_store import data_home

        speed = node_speed(data_home() / "calibration.json", recalibrate=args.recalibrate)
        if speed:
            log.info("this node streams weights at %.1f GB/s (the planner's speed for it)", speed)
    from omlx_shared.discovery import announce_address

    try:
        announced = announce_address(args.host)
        agent = NodeAgent(args.host, args.port, args.data_port, args.metrics_port,
                          _engine_args(args), secret=secret, node_id=args.name, speed=speed,
                          worker_cache_bytes=args.hot_cache_max_size,
                          orphan_grace=args.orphan_grace)
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
        _register_periodically(args.coordinator, f"{announced}:{agent.port}",
                               agent.node_id, secret)
    if args.ready_file:
        write_ready(args.ready_file, {"port": agent.port, "pid": os.getpid()})
    try:
        agent.serve_forever()
    finally:
        if advertiser is not None:
            advertiser.close()
    return 0


def _register_periodically(coordinator: str, address: str, node_id: str, secret: str,
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
        # One client for good: each new one builds a TLS context (~20 ms of CPU here), which
        # every 2 s was most of what an idle `join` spent.
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


def _node(args: argparse.Namespace) -> int:
    from omlx_node.agent import NodeAgent
    from omlx_shared.child import write_ready
    from proto import omlx_pb2 as pb

    secret = _secret(args)
    if secret is None and not _is_loopback(args.host):
        print(f"error: the node would listen on {args.host}, reachable from the network, "
              "without a cluster secret (anyone could load models on it and read its data "
              "plane): pass --secret-file FILE (or set OMLX_CLUSTER_SECRET), or listen on "
              "127.0.0.1", file=sys.stderr)
        return 2
    try:
        agent = NodeAgent(args.host, args.port, args.data_port, args.metrics_port,
                          _engine_args(args), secret=secret, node_id=args.name,
                          worker_cache_bytes=args.hot_cache_max_size)
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


def _worker(args: argparse.Namespace) -> int:
    import json

    from omlx_node.worker import WorkerConfig, run_worker
    from omlx_shared.child import watch_parent
    from omlx_shared.model_store import data_home

    # A worker is only ever its agent's: when the agent goes, so does it.
    watch_parent(lambda: os._exit(0))
    if args.standby:
        job = json.loads(sys.stdin.readline() or "null")
        if job is None:  # the agent went away without a plan for us
            return 0
        os.environ.update(job["env"])
        given = sys.argv[sys.argv.index("worker") + 1:]
        args = _build_parser().parse_args(
            ["worker", *(a for a in given if a != "--standby"), *job["argv"]])
    missing = [f for f in ("model", "model_id", "layers") if getattr(args, f) is None]
    if missing:
        print(f"error: worker needs --{', --'.join(m.replace('_', '-') for m in missing)}",
              file=sys.stderr)
        return 2
    start, _, end = args.layers.partition(":")
    config = WorkerConfig(
        model_path=args.model, model_id=args.model_id, layer_start=int(start),
        layer_end=int(end) if end else None, rank=args.rank,
        peers=tuple(p for p in args.peers.split(",") if p), backend=args.backend,
        rdma_devices=args.rdma_devices, plan_hash=args.plan_hash,
        micro_batches=args.micro_batches, host=args.host, node_id=args.node_id,
        prefill_chunk=args.prefill_chunk, max_batch=args.max_batch,
        speculative=args.speculative, stream_interval=args.stream_interval / 1000,
        metrics_port=args.metrics_port,
        init_timeout=args.init_timeout,
        cache_block_size=args.cache_block_size, hot_cache_bytes=args.hot_cache_max_size,
        ssd_cache_dir=(None if args.paged_ssd_cache_max_size == 0 else
                       args.paged_ssd_cache_dir or data_home() / "kv-cache"),
        ssd_cache_bytes=args.paged_ssd_cache_max_size,
        device_cache_bytes=args.device_cache_max_size)
    return run_worker(config, args.ready_file)


def _plan(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from omlx_coordinator.model_layout import read_layout
    from omlx_coordinator.planner import (
        PlanError,
        format_plan,
        make_plan,
        parse_node_arg,
    )
    from omlx_shared.model_spec import resolve_model
    from omlx_shared.model_store import ModelError

    try:
        path = resolve_model(args.model, progress=True)
        nodes = [replace(parse_node_arg(n), cache_bytes=args.hot_cache_max_size)
                 for n in args.node]
        plan = make_plan(read_layout(path), nodes, os_reserve_bytes=args.os_reserve,
                         context_tokens=args.context, max_sequences=args.sequences,
                         split=args.split)
    except (ModelError, PlanError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(plan.to_json() if args.json else format_plan(plan))
    return 0


def _client_api_key(args: argparse.Namespace) -> str | None:
    """The key to send to a gateway: the first given (api_keys.py); exits 2 on a bad one."""
    try:
        return next(iter(api_keys(args)), None)
    except ApiKeyError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _status(args: argparse.Namespace) -> int:
    import json

    from rich.console import Console
    from rich.table import Column, Table

    body = _ask_gateway(args, "GET", "/cluster/status", "the status", timeout=10)
    if body is None:
        return 2
    if args.json:
        print(json.dumps(body, indent=2))
        return 0
    console = Console()
    console.print(f"{body['model']}: {body['status']} (plan epoch {body['epoch']})")
    if body.get("backend"):
        console.print(f"data plane: {body['backend']['name']} ({body['backend']['reason']})",
                      markup=False)
    # Addresses fold rather than end in "…" on a narrow terminal: they are what one copies.
    table = Table("id", Column("address", overflow="fold"), "health", "layers", "speed",
                  "agent pid", "worker pid", Column("metrics", overflow="fold"), "checks")
    for n in body["nodes"]:
        health = "ok" if n["healthy"] else ("lost" if not n["alive"] else "unhealthy")
        layers = _layers_on(n["id"], body.get("models") or []) or (
            f"[{n['layers'][0]}, {n['layers'][1]})" if n["layers"] else "-")
        table.add_row(n["id"], n["address"], health, layers,
                      _speed(n.get("measured_speed_gbps"), n.get("ms_per_layer")),
                      str(n["agent_pid"] or "-"), str(n["worker_pid"] or "-"),
                      n.get("metrics") or "-", _checks_summary(n.get("checks") or []))
    console.print(table)
    if len(body.get("models") or []) > 1 or any(len(m["replicas"]) > 1
                                                 for m in body.get("models") or []):
        console.print(_models_table(body["models"]))
    # What each node's own checks found wrong with its machine, and the fix.
    for n in body["nodes"]:
        for c in n.get("checks") or []:
            if c["status"] in ("warn", "fail"):
                console.print(f"{n['id']}: {c['name']} {c['status']}: {c['detail']}"
                              + (f" (fix: {c['fix']})" if c["fix"] else ""), markup=False)
    return 0


def _layers_on(node: str, models: list[dict]) -> str:
    """The layers every model's stages hold on `node`: "[0, 4)", or with several models
    "a [0, 4), b#1 [2, 6)" (b's second replica); "" when none."""
    held = [(m["id"] + (f"#{r['replica']}" if r["replica"] else ""), s["layers"])
            for m in models for r in m["replicas"] for s in r["stages"] if s["node"] == node]
    if len(models) == 1 and len(held) == 1:  # what one model on one replica always showed
        return "[{}, {})".format(*held[0][1])
    return ", ".join(f"{name} [{a}, {b})" for name, (a, b) in held)


def _models_table(models: list[dict]):
    """Every model: its state, leases, and where each replica's stages run with their real
    memory."""
    from rich.table import Table

    table = Table("model", "state", "requests", "replica", "stages (node [layers] footprint)")
    for m in models:
        name = m["id"] + (f" ({', '.join(m['aliases'])})" if m["aliases"] else "")
        for i, r in enumerate(m["replicas"]):
            stages = ", ".join(
                f"{s['node']} [{s['layers'][0]}, {s['layers'][1]})"
                + (f" {s['footprint_bytes'] / 2**20:.0f} MiB" if s.get("footprint_bytes")
                   else "") for s in r["stages"]) or "-"
            table.add_row(name if i == 0 else "", m["state"] if i == 0 else "",
                          str(m["leases"]) if i == 0 else "", str(r["replica"]), stages)
    return table


def _ask_gateway(args: argparse.Namespace, method: str, path: str, what: str,
                 timeout: float) -> dict | None:
    """The gateway's JSON answer at `path` (with --api-key); None after saying why not."""
    import httpx

    key = _client_api_key(args)
    headers = {"authorization": f"Bearer {key}"} if key else {}
    try:
        r = httpx.request(method, args.url.rstrip("/") + path, timeout=timeout, headers=headers)
        if r.status_code == 401:
            print(f"error: {args.url} refused the API key sent: pass one the gateway was "
                  "started with (--api-key-file FILE, --api-key KEY or OMLX_CLUSTER_API_KEY)"
                  if key else f"error: {args.url} wants an API key: pass --api-key-file FILE "
                  "or set OMLX_CLUSTER_API_KEY", file=sys.stderr)
            return None
        if r.status_code >= 400 and _error_message(r):
            print(f"error: {_error_message(r)}", file=sys.stderr)
            return None
        r.raise_for_status()
    except httpx.HTTPError as e:
        print(f"error: cannot get {what} from {args.url}: {e}", file=sys.stderr)
        return None
    try:
        body = r.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        print(f"error: {args.url} answered {path} with something other than an omlx-cluster "
              f"gateway's JSON (is it the gateway's address, not a node's metrics?)",
              file=sys.stderr)
        return None
    return body


def _error_message(r) -> str:
    """The message of the gateway's error object ("" when the body is not one)."""
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return ""


def _speed(gbps: float | None, ms_per_layer: float | None) -> str:
    """A node's measured speed for the status and rebalance tables ("-": not measured)."""
    if gbps is None:
        return "-"
    return f"{gbps:.3g} GB/s" + (f", {ms_per_layer:.3g} ms/layer" if ms_per_layer else "")


def _rebalance(args: argparse.Namespace) -> int:
    import json

    from rich.console import Console
    from rich.table import Table

    body = _ask_gateway(args, "GET" if args.dry_run else "POST", "/cluster/rebalance",
                        "the rebalance proposal", timeout=600)  # a move loads a plan
    if body is None:
        return 2
    if args.json:
        print(json.dumps(body, indent=2))
        return 0
    console = Console()
    d = body["decision"]
    console.print(f"rebalance {body['mode']} (reading {body['source']})", markup=False)

    def split(ranges: list | None) -> str:
        return " ".join(f"{n}[{a}, {b})" for n, a, b in ranges) if ranges else "-"

    table = Table("node", "layers now", "proposed", "speed", "")
    now = {n: (a, b) for n, a, b in d["current"] or []}
    proposed = {n: (a, b) for n, a, b in d["proposed"] or []}
    for node, gbps in d["speeds_gbps"].items():
        table.add_row(node, "[{}, {})".format(*now[node]) if node in now else "-",
                      "[{}, {})".format(*proposed[node]) if node in proposed else "-",
                      _speed(gbps, d["ms_per_layer"].get(node)),
                      "measured" if node in d["measured"] else "carried over")
    console.print(table)
    console.print(f"current split: {split(d['current'])}", markup=False)
    console.print(f"proposed split: {split(d['proposed'])}", markup=False)
    if d["gain"] is not None:
        console.print(f"bottleneck: {d['current_bottleneck_seconds'] * 1e3:.3f} ms now, "
                      f"{d['best_bottleneck_seconds'] * 1e3:.3f} ms proposed: predicted gain "
                      f"{d['gain']:+.1%}")
    console.print(f"{'would move' if d['move'] else 'holds'}: {d['why']}", markup=False)
    if body["moved"] is not None:
        console.print("moved to the proposed split" if body["moved"]
                      else "not moved: the proposal is the current split, or the plan changed",
                      markup=False)
    return 0


def _checks_summary(checks: list[dict]) -> str:
    """"ok", "1 fail, 2 warn", or "-" before the node's checks have run."""
    counts = {s: sum(c["status"] == s for c in checks) for s in ("fail", "warn")}
    return ("-" if not checks else ", ".join(f"{k} {s}" for s, k in counts.items() if k)
            or "ok")


def _models(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from omlx_shared import model_store
    from omlx_shared.default_model import import_dest, pull_default
    from omlx_shared.gguf_import import import_gguf

    console = Console()
    if args.models_command in ("load", "unload", "pin", "unpin"):
        return _model_action(args, console)
    try:
        if args.models_command == "list":
            rows = model_store.list_models()
            if not rows:
                console.print(f"no models in {model_store.models_dir()}; `omlx-cluster "
                              "models pull ORG/NAME`, `models pull-default` or `models "
                              "import-gguf FILE` adds one")
                return 0
            table = Table("family", "layers", "size", "quantization")
            # The name is what --model takes: never cut it; the path folds instead.
            table.add_column("name", no_wrap=True)
            table.add_column("path", overflow="fold")
            for m in rows:
                # A node's shard folder: the layers it received from its coordinator.
                layers = f"shard: {m.shard}" if m.shard else str(m.num_layers)
                table.add_row(m.model_type, layers, f"{m.size_bytes / 2**20:.0f} MiB",
                              m.quantization, m.name, str(m.path))
            console.print(table)
        elif args.models_command == "pull":
            console.print(f"{args.repo_id} ready at {_pull(args.repo_id)}", markup=False,
                          soft_wrap=True)
        elif args.models_command == "import-gguf":
            dest = args.dest or (import_dest(args.file) if args.file.is_file() else None)
            path = import_gguf(args.file, dest, progress=True)
            console.print(f"imported into {path}")
        else:
            console.print(f"default model ready at {pull_default(progress=True)}")
    except (model_store.ModelError, FileNotFoundError) as e:
        Console(stderr=True, soft_wrap=True).print(f"[red]error:[/red] {e}")
        return 2
    return 0


def _pull(repo_id: str) -> Path:
    from omlx_shared.hub import is_hub_id, resolve_hub_model
    from omlx_shared.model_store import ModelError

    if not is_hub_id(repo_id):
        raise ModelError(f"{repo_id!r} is not a Hugging Face id: pull takes ORG/NAME (e.g. "
                         "mlx-community/Qwen3-4B-4bit); a local folder needs no pull, pass it "
                         "as --model PATH")
    return resolve_hub_model(repo_id)


def _model_action(args: argparse.Namespace, console) -> int:
    """`models load|unload|pin|unpin NAME` against a running gateway."""
    from urllib.parse import quote

    action = args.models_command
    query = f"?wait={args.wait}" if action == "unload" and args.wait else ""
    done = threading.Event()
    if action == "load":  # seconds to minutes: its stages shown meanwhile
        from omlx_cluster.load_progress import watch_load

        key = _client_api_key(args)
        watcher = threading.Thread(target=watch_load, daemon=True, args=(
            args.url, {"authorization": f"Bearer {key}"} if key else {}, args.name, done,
            console))
        watcher.start()
    try:
        # A load waits for the model to serve; an unload for its requests and its workers.
        body = _ask_gateway(args, "POST", f"/cluster/models/{quote(args.name, safe='')}/"
                            f"{action}{query}", f"the model {action}",
                            timeout=1800 + args.__dict__.get("wait", 0))
    finally:
        done.set()
        if action == "load":
            watcher.join()
    if body is None:
        return 2
    # A loaded model's state reads "pinned" when it is: said once, after "loaded".
    state = "loaded" if body["loaded"] else body["state"]
    console.print(f"{body['id']}: {state}" + (" (pinned)" if body["pinned"] else ""),
                  markup=False)
    return 0


def _hosts(args: argparse.Namespace) -> list[str]:
    from omlx_cluster.doctor import read_hosts_file

    try:
        listed = read_hosts_file(args.hosts_file) if args.hosts_file else []
    except OSError as e:
        print(f"error: cannot read the hosts file {args.hosts_file}: {e.strerror}",
              file=sys.stderr)
        raise SystemExit(2) from None
    return list(dict.fromkeys([*args.hosts, *listed]))  # once each, in the order given


def _doctor(args: argparse.Namespace) -> int:
    import asyncio
    import json

    from rich.console import Console

    from omlx_cluster import doctor
    from omlx_shared.auth import SecretError, secret_from
    from omlx_shared.checks import REMOTE_ONLY
    from omlx_shared.model_spec import resolve_model
    from omlx_shared.model_store import ModelError

    try:
        secret = secret_from(None, args.secret_file) if args.secret_file else None
        model = resolve_model(args.model, progress=True) if args.model else None
    except (SecretError, ModelError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    options = doctor.DoctorOptions(
        timeout=args.timeout, ssh_config=args.ssh_config, remote_command=args.remote_command,
        secret=secret, secret_file=args.secret_file, model=model,
        only=set(args.check) if args.check else None, grpc_port=args.node_port,
        metrics_port=args.metrics_port, probe_port=args.probe_port)
    hosts = _hosts(args)
    if not hosts and (remote := [c for c in args.check or [] if c in REMOTE_ONLY]):
        print(f"error: --check {', '.join(remote)} compare Macs or look at them from another "
              "machine: name the hosts (doctor HOST ... or --hosts-file FILE)", file=sys.stderr)
        return 2
    diagnosis = (asyncio.run(doctor.diagnose(hosts, options)) if hosts
                 else doctor.check_here(options))
    if args.json:
        print(json.dumps(diagnosis.to_dict(), indent=2))
    else:
        doctor.render(diagnosis, Console())
    return 1 if diagnosis.failed else 0


def _step_printer():
    """Prints each step of `up` / `down` as it ends: host, step, outcome, detail."""
    from rich.console import Console
    from rich.text import Text

    console = Console()
    styles = {"done": "green", "unchanged": "dim", "failed": "bold red", "skipped": "yellow"}

    def report(host: str, step: str, outcome: str, detail: str) -> None:
        console.print(Text.assemble(f"{host}  {step:<9}", (f"{outcome:<10}", styles[outcome]),
                                    detail), soft_wrap=True)

    return report


def _up(args: argparse.Namespace) -> int:
    import asyncio

    from omlx_cluster import provision
    from omlx_shared.auth import SecretError

    hosts = _hosts(args)
    if not hosts:
        print("error: name the hosts to bring up (HOST ... or --hosts-file)", file=sys.stderr)
        return 2
    if not provision.TEMPLATE.exists():
        print(f"error: the launchd job's template {provision.TEMPLATE} is missing: run up from "
              "a checkout of omlx-cluster (pip install -e)", file=sys.stderr)
        return 2
    try:
        secret = _up_secret(args.secret_file)
    except SecretError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    key = _client_api_key(args)
    options = provision.UpOptions(
        secret=secret, coordinator=args.coordinator, api_key=key,
        remote_command=args.remote_command, node_port=args.node_port,
        metrics_port=args.metrics_port, wait=args.wait, timeout=args.timeout,
        ssh_config=args.ssh_config)
    return 0 if asyncio.run(provision.up(hosts, options, _step_printer())) else 1


def _up_secret(path: Path | None) -> str:
    """--secret-file's secret; without one, the secret in $OMLX_CLUSTER_HOME/secret, made there
    the first time (so a second `up` finds the same one and changes nothing)."""
    from omlx_shared.auth import new_secret, secret_from, write_secret
    from omlx_shared.model_store import data_home

    if path is None and not (path := data_home() / "secret").exists():
        write_secret(path, new_secret())
        print(f"made a new cluster secret in {path} (mode 0600): start the coordinator with "
              f"--secret-file {path}", file=sys.stderr)
    return secret_from(None, path)


def _secret_command(args: argparse.Namespace) -> int:
    from omlx_shared.auth import SecretError, new_secret, write_secret

    secret = new_secret()
    if args.file is None:
        print(secret)
        return 0
    try:
        write_secret(args.file, secret, overwrite=args.force)
    except SecretError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote a new cluster secret to {args.file} (mode 0600): pass --secret-file "
          f"{args.file}", file=sys.stderr)
    return 0


def _down(args: argparse.Namespace) -> int:
    import asyncio

    from omlx_cluster import provision

    hosts = _hosts(args)
    if not hosts:
        print("error: name the hosts to take down (HOST ... or --hosts-file)", file=sys.stderr)
        return 2
    done = asyncio.run(provision.down(hosts, args.timeout, args.ssh_config, _step_printer()))
    return 0 if done else 1


def _link_probe(args: argparse.Namespace) -> int:
    import json

    from omlx_shared.link_probe import ProbeError, run_rank

    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    if len(peers) != 2:
        print(f"error: --peers takes two HOST:PORT, got {args.peers!r}", file=sys.stderr)
        return 2
    try:
        measured = run_rank(args.rank, peers, nbytes=args.bytes, timeout=args.timeout)
    except ProbeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(measured.to_dict() if measured else {}))
    elif measured:
        print(f"{measured.gb_per_s:.2f} GB/s, {measured.latency_us:.0f} µs one way "
              f"({measured.nbytes >> 20} MiB messages between {peers[0]} and {peers[1]})")
    else:
        print(f"rank 1 done (rank 0 on {peers[0]} prints the measurement)")
    return 0


def more_open_files(want: int = 65536) -> int:
    """Raises this process's soft limit of open files (its children inherit it) towards
    `want`, within the hard limit: macOS starts a shell at 256, which some hundred streams
    and their node connections use up, and then every client gets refused. Returns it."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for target in (want, 10240):  # macOS refuses more than its OPEN_MAX (10240) per process
        target = target if hard == resource.RLIM_INFINITY else min(target, hard)
        if target <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
        except (ValueError, OSError):
            continue
    return soft


def main(argv: list[str] | None = None) -> int:
    # transformers warns at every import that PyTorch is missing: the tokenizer needs none.
    # Set before any import of it, and inherited by the node and worker processes.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    args = _build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request is noise here
    from omlx_shared.model_store import data_home
    from omlx_shared.private_files import keep_private

    # What any command writes (KV blocks hold prompts; weights, keys) only this account reads;
    # the long-running ones also fix the modes older versions left in their folders.
    long_running = args.command in ("serve", "coordinator", "join", "node")
    keep_private(*((data_home(), getattr(args, "paged_ssd_cache_dir", None))
                   if long_running else ()))
    if long_running:
        more_open_files()
    handler = {"serve": _serve, "coordinator": _coordinator, "join": _join, "node": _node,
               "worker": _worker, "plan": _plan, "status": _status, "rebalance": _rebalance,
               "models": _models, "doctor": _doctor, "up": _up, "down": _down,
               "secret": _secret_command,
               "link-probe": _link_probe}[args.command]
    try:
        return handler(args)
    except KeyboardInterrupt:  # Ctrl-C: the processes it started stop with it; no traceback
        print("stopped", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `plan ... | head`: the reader left; nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141

