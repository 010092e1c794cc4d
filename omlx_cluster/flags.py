"""The flag groups several commands share, and reading them back: the gateway's, the engine's
(passed on to the process that runs it), the KV reserve, the pipeline, rebalancing, the cluster
secret, a gateway's URL, and SSH's for the office commands."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from omlx_cluster import validators
from omlx_cluster.api_keys import add_api_key_flags
from omlx_shared.block_hashes import DEFAULT_BLOCK_SIZE
from omlx_shared.parallel_modes import PARALLEL
from omlx_shared.speculative_modes import check_mode, draft_path

log = logging.getLogger("omlx_cluster")


def add_gateway_flags(p: argparse.ArgumentParser) -> None:
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
                        "pin, ttl, replicas, max_queue, speculative, parallel), instead of "
                        "--model "
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
    p.add_argument("--port", type=validators.port,
                   default=8000, help="gateway port (default: 8000)")
    add_api_key_flags(p, "a key clients must send as 'Authorization: Bearer KEY' or "
                         "'x-api-key: KEY' (repeatable; none: open, only allowed on a "
                         "loopback address); these are admin keys")
    p.add_argument("--batch-share", type=validators.share_or_all, default=0.5, metavar="SHARE",
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
    p.add_argument("--header-timeout", type=validators.positive_seconds,
                   default=20.0, metavar="SECONDS",
                   help="close a connection that has not sent a whole request header this long "
                        "after it opened or its request began (slow or idle sockets; "
                        "default: 20)")
    p.add_argument("--max-connections", type=validators.positive, default=2048, metavar="N",
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
    p.add_argument("--max-queue", type=validators.positive, default=None, metavar="N",
                   help="the most requests of one model the gateway holds at once, decoding "
                        "or waiting (a request with n choices counts n); past it a request is "
                        "refused at once with 429 (Anthropic: 529) and a Retry-After from the "
                        "rate requests finished lately, rather than wait in memory for minutes; "
                        "a model's max_queue in --models-config wins (default: 4 x --max-batch: "
                        "one batch decoding and three waiting keep the batch full as sequences "
                        "end, while the last in line waits about three batches; `coordinator` "
                        "assumes the nodes' default --max-batch 64, so 256)")
    p.add_argument("--request-timeout", type=validators.positive_seconds, default=900.0,
                   metavar="SECONDS",
                   help="longest a request may run before it fails with 504 (default: 900)")
    p.add_argument("--stall-timeout", type=validators.positive_seconds, default=600.0,
                   metavar="SECONDS",
                   help="a model's plan whose head worker sent nothing for this long while it "
                        "had requests (a pipeline wedged: the link between two stages cut) is "
                        "re-planned, its requests resumed; a prefill whose steps advance is "
                        "not silent (the worker reports each second of progress), so keep it "
                        "above the longest single step only (default: 600)")
    p.add_argument("--keepalive", type=validators.positive_seconds, default=5.0, metavar="SECONDS",
                   help="a stream that wrote nothing for this long (a prompt being prefilled, "
                        "a tool call held back until it is whole, a model loading) sends an "
                        "SSE keep-alive comment (Anthropic: a ping event) (default: 5)")
    p.add_argument("--default-max-tokens", type=validators.positive, default=4096, metavar="N",
                   help="completion limit when a request sets none, capped by the context "
                        "(default: 4096)")
    p.add_argument("--log-file", type=Path, metavar="FILE",
                   help="also append the gateway's log (the access log included, GET /health "
                        "left out) to FILE, mode 0600 (default: the terminal only; node and "
                        "worker logs are in $OMLX_CLUSTER_HOME/logs/)")


def add_kv_reserve_flags(p: argparse.ArgumentParser) -> None:
    """The KV memory a plan sets aside on each stage beside its weights."""
    p.add_argument("--context", type=validators.positive, default=4096, metavar="TOKENS",
                   help="KV reserved per sequence when planning (default: 4096)")
    p.add_argument("--sequences", type=validators.positive, default=8, metavar="N",
                   help="concurrent sequences the KV reserve covers (default: 8)")


def add_hot_cache_flag(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--hot-cache-max-size", type=validators.size, default="1GiB", metavar="SIZE",
                   help=f"{help} (default: 1GiB)")


def _speculative_mode(value: str) -> str:
    """A speculation mode, a draft model's folder made absolute (the worker runs elsewhere)."""
    try:
        mode = check_mode(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    if folder := draft_path(mode):
        return f"draft={Path(folder).expanduser().resolve()}"
    return mode


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights-memory", type=validators.size, default=0, metavar="SIZE",
                   help="most memory a node's shard workers keep for weights, e.g. 24GiB; a "
                        "stage with more keeps its last layers on the SSD and reads each just "
                        "ahead of its turn, so a model larger than the memory still runs, slower "
                        "(`plan` shows the cost) (default: no cap: a model must fit in memory)")
    p.add_argument("--prefill-chunk", type=validators.positive, default=None, metavar="TOKENS",
                   help="prompt tokens computed per engine step; a long prompt delays running "
                        "streams by at most one chunk (default: 2048 on a GPU, 512 on a CPU)")
    p.add_argument("--max-batch", type=validators.positive, default=64, metavar="N",
                   help="most sequences decoding at once on a node; more wait in a queue "
                        "(default: 64)")
    p.add_argument("--speculative", type=_speculative_mode, default="auto",
                   metavar="off|ngram|auto|draft=PATH",
                   help="speculative decoding on a single-node model: ngram drafts a "
                        "sequence's next tokens from its own prompt and output (prompt lookup) "
                        "and verifies them in one step, auto is ngram where the node measures "
                        "that a wider step is cheap, draft=PATH drafts with the small model in "
                        "folder PATH (same tokenizer; loaded beside the model on the node that "
                        "runs it), off decodes one token a step; a request's OpenAI "
                        "`prediction` drafts unless off; a model's speculative in "
                        "--models-config wins; in a pipeline the first stage drafts and the "
                        "last verifies; on a tensor-parallel stage rank 0 drafts (default: auto)")
    p.add_argument("--speculative-rows", type=validators.positive, default=None, metavar="N",
                   help="most rows a decode step may hold and still draft (default: measured "
                        "at start-up, where a wider step stops being cheaper than the steps "
                        "its drafts save)")
    p.add_argument("--stream-interval", type=validators.milliseconds, default=20.0, metavar="MS",
                   help="where a node decodes faster than this, the tokens of one interval go "
                        "to the gateway as one message (less gateway CPU a token); a stream's "
                        "first token and its end are never held; "
                        "0 sends every step's tokens at once (default: 20)")
    add_hot_cache_flag(p, "RAM for the prefix KV cache of each stage, e.g. 4GiB; 0 turns the "
                           "prefix cache off; plans count it beside the stage's weights and KV")
    p.add_argument("--device-cache-max-size", type=validators.size_or_auto,
                   default=None, metavar="SIZE",
                   help="device memory for the latest prompts' prefix KV blocks, restored without "
                        "a copy from RAM; pays off where the device has memory of its own (a "
                        "CUDA GPU), where a RAM hit costs more than prefilling again; 0 turns it "
                        "off (default: auto, 1/16 of a CUDA device's memory up to 8GiB, 0 where "
                        "device and host share memory: Apple silicon, a CPU)")
    p.add_argument("--paged-ssd-cache-dir", type=Path, metavar="DIR",
                   help="where each stage keeps prefix KV blocks on disk, surviving restarts "
                        "(default: $OMLX_CLUSTER_HOME/kv-cache)")
    p.add_argument("--paged-ssd-cache-max-size", type=validators.size,
                   default="16GiB", metavar="SIZE",
                   help="disk for each stage's prefix KV blocks, and as much again for "
                        "those no running stage uses (layer ranges a re-plan left, models not "
                        "loaded, older weights), least recently used pruned first; 0 keeps the "
                        "cache in RAM only (default: 16GiB)")
    p.add_argument("--cache-block-size", type=validators.positive, default=DEFAULT_BLOCK_SIZE,
                   metavar="TOKENS",
                   help=f"tokens per prefix-cache block (default: {DEFAULT_BLOCK_SIZE})")


PARALLEL_HELP = ("how a model is laid out over several nodes. pipeline: each node a range of "
                 "layers (a second Mac makes the model bigger, not faster); tensor: every node "
                 "holds a slice of every layer, all-reducing twice a layer (faster at batch 1 "
                 "over a fast link; refused for a family without mlx-lm's shard() or heads "
                 "that do not divide); tensor-pipeline: runs of neighbouring nodes (in "
                 "order), each a tensor-parallel stage, chained as a pipeline (Thunderbolt "
                 "islands over Ethernet; 3 nodes or more); auto: the one predicted fastest at "
                 "batch 1 from the nodes' speeds and links, one node included (`plan "
                 "--parallel auto` shows each prediction)")


def add_pipeline_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parallel", choices=PARALLEL, default="pipeline",
                   help=PARALLEL_HELP + "; a model's parallel in --models-config wins "
                        "(default: pipeline)")
    p.add_argument("--micro-batches", type=validators.positive, default=None, metavar="K",
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


def add_url_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", type=validators.gateway_url, default="http://127.0.0.1:8000",
                   help="the gateway's address, or the base URL clients use (ending in /v1) "
                        "(default: http://127.0.0.1:8000)")


def add_rebalance_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rebalance", choices=["auto", "advise", "off"], default="auto",
                   help="move layers between nodes from their measured speeds and memory "
                        "pressure while serving. auto: move; advise: only log and show "
                        "(`omlx-cluster rebalance`) what it would do; off: measure nothing "
                        "(default: auto)")
    p.add_argument("--rebalance-threshold", type=validators.share, default=0.15, metavar="SHARE",
                   help="move only when the best split's predicted bottleneck beats the "
                        "current one by more than this share (default: 0.15)")
    p.add_argument("--rebalance-window", type=validators.positive_seconds,
                   default=60.0, metavar="SECONDS",
                   help="... in each third of a window of this many seconds (default: 60)")
    p.add_argument("--rebalance-cooldown", type=validators.seconds,
                   default=300.0, metavar="SECONDS",
                   help="and at least this long after the last move (default: 300)")
    p.add_argument("--prometheus-url", metavar="URL",
                   help="read the stages' metrics from this Prometheus (its /api/v1/query) "
                        "instead of scraping every stage (default: scrape)")


def rebalance_settings(args: argparse.Namespace):
    from omlx_coordinator.planning.rebalance_policy import Policy
    from omlx_coordinator.telemetry.rebalancer import RebalanceSettings

    # The memory pressure window follows a short --rebalance-window down, never above 10 s.
    policy = Policy(threshold=args.rebalance_threshold, window=args.rebalance_window,
                    cooldown=args.rebalance_cooldown,
                    pressure_window=min(Policy.pressure_window, args.rebalance_window))
    return RebalanceSettings(args.rebalance, policy, args.prometheus_url)


def add_secret_file_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--secret-file", type=Path, metavar="FILE",
                   help="read the cluster secret from FILE (mode 0600; other users must not "
                        "read it), so it never shows in `ps`")


def cluster_secret(args: argparse.Namespace) -> str | None:
    """The secret from --secret, --secret-file or the environment; exits 2 on a bad file."""
    from omlx_shared.auth import SecretError, secret_from

    try:
        return secret_from(args.secret, args.secret_file)
    except SecretError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def engine_args(args: argparse.Namespace) -> list[str]:
    """The engine flags as given, for the `node` processes `serve` starts (their own CLI)."""
    out = ["--max-batch", str(args.max_batch),
           "--hot-cache-max-size", f"{args.hot_cache_max_size}B",
           "--paged-ssd-cache-max-size", f"{args.paged_ssd_cache_max_size}B",
           "--cache-block-size", str(args.cache_block_size), "--log-level", args.log_level,
           "--stream-interval", str(args.stream_interval), "--speculative", args.speculative]
    if args.speculative_rows:
        out += ["--speculative-rows", str(args.speculative_rows)]
    if args.weights_memory:
        out += ["--weights-memory", f"{args.weights_memory}B"]
    if args.prefill_chunk:  # else the worker sizes it for its own device
        out += ["--prefill-chunk", str(args.prefill_chunk)]
    if args.paged_ssd_cache_dir:
        _warn_unused_ssd_dir(args)
        out += ["--paged-ssd-cache-dir", str(args.paged_ssd_cache_dir)]
    if args.device_cache_max_size is not None:
        out += ["--device-cache-max-size", f"{args.device_cache_max_size}B"]
    return out


def engine_config(args: argparse.Namespace):
    """The engine flags, typed, for a node agent to give each of its workers."""
    from omlx_shared.engine_config import EngineConfig
    from omlx_shared.model_store import data_home

    if args.paged_ssd_cache_dir:
        _warn_unused_ssd_dir(args)
    ssd_dir = (None if args.paged_ssd_cache_max_size == 0 else
               str(args.paged_ssd_cache_dir or data_home() / "kv-cache"))
    return EngineConfig(
        prefill_chunk=args.prefill_chunk, max_batch=args.max_batch,
        speculative=args.speculative, speculative_rows=args.speculative_rows,
        stream_interval=args.stream_interval / 1000,
        cache_block_size=args.cache_block_size, hot_cache_bytes=args.hot_cache_max_size,
        ssd_cache_dir=ssd_dir, ssd_cache_bytes=args.paged_ssd_cache_max_size,
        device_cache_bytes=args.device_cache_max_size, log_level=args.log_level)


def _warn_unused_ssd_dir(args: argparse.Namespace) -> None:
    if not args.paged_ssd_cache_max_size:
        log.warning("--paged-ssd-cache-dir has no effect: --paged-ssd-cache-max-size 0 "
                    "keeps the prefix cache in RAM only")


def add_ssh_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("hosts", nargs="*", metavar="HOST",
                   help="[user@]host[:port] or a Host of your SSH config, in ring order")
    p.add_argument("--hosts-file", type=Path, metavar="FILE",
                   help="more hosts, one per line (# comments)")
    p.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS",
                   help="to connect and log in over SSH (default: 10)")
    p.add_argument("--ssh-config", type=Path, metavar="FILE",
                   help="an OpenSSH client config to read instead of ~/.ssh/config (keys, "
                        "users, ports, known_hosts; the SSH agent is used either way)")


def add_remote_command_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--remote-command", default="omlx-cluster", metavar="CMD",
                   help="how to run omlx-cluster on the hosts (default: omlx-cluster on the "
                        "PATH of an SSH session, which is short on a Mac: give the full path "
                        "of a virtualenv's, e.g. ~/omlx/.venv/bin/omlx-cluster)")


def add_node_port_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--node-port", type=validators.port, metavar="PORT", default=50051,
                   help="join's gRPC port on the hosts (default: 50051)")
    p.add_argument("--metrics-port", type=validators.port, metavar="PORT", default=9101,
                   help="join's metrics port on the hosts (default: 9101)")
