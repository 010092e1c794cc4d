"""The command line's tree: every command, its flags and its help."""

from __future__ import annotations

import argparse
from pathlib import Path

from omlx_cluster import validators
from omlx_cluster.api_keys import add_api_key_flags
from omlx_cluster.flags import (
    PARALLEL_HELP,
    add_engine_flags,
    add_gateway_flags,
    add_hot_cache_flag,
    add_kv_reserve_flags,
    add_node_port_flags,
    add_pipeline_flags,
    add_rebalance_flags,
    add_remote_command_flag,
    add_secret_file_flag,
    add_ssh_flags,
    add_url_flag,
)
from omlx_coordinator.nodes.link_freshness import DEFAULT_MAX_AGE_SECONDS
from omlx_shared import __version__
from omlx_shared.parallel_modes import PARALLEL


def build_parser() -> argparse.ArgumentParser:
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
    add_gateway_flags(serve)
    serve.add_argument("--node-metrics-port", type=validators.port, default=0, metavar="PORT",
                       help="each local node's shard worker exports Prometheus /metrics on its "
                            "own port: PORT, PORT+1, ... (0: any free port; GET "
                            "/cluster/status and /cluster/prometheus-targets show them; "
                            "default: 0)")
    serve.add_argument("--nodes", type=validators.positive, default=1, metavar="N",
                       help="run the model as a pipeline of N local node processes joined by "
                            "mx.distributed (default: 1, single-Mac mode)")
    serve.add_argument("--split", type=validators.layer_counts, metavar="A,B,...",
                       help="the main model's layers per node, e.g. 1,6,2 (must sum to its "
                            "layers, no stage empty; default: the planner's split)")
    serve.add_argument("--node-memory", type=validators.positive_size, default=None, metavar="SIZE",
                       help="memory each local node may hold for models (default: this "
                            "machine's memory less --os-reserve, shared by the nodes); models "
                            "past it evict the least recently used idle ones")
    serve.add_argument("--os-reserve", type=validators.size, default="4GiB", metavar="SIZE",
                       help="memory this machine keeps for its OS and apps; the local nodes "
                            "share the rest (default: 4GiB; ignored with --node-memory)")
    add_kv_reserve_flags(serve)
    add_pipeline_flags(serve)
    add_rebalance_flags(serve)
    add_engine_flags(serve)

    node = sub.add_parser(
        "node", parents=[common], help="run a node agent (gRPC server that runs model shards)",
        description="Run a node agent: the gRPC server (proto/omlx.proto, NodeAgent) that starts "
                    "a shard worker for each plan it is given. `serve` starts its own.",
    )
    node.add_argument("--host", default="127.0.0.1",
                      help="address for gRPC and the data plane (default: 127.0.0.1)")
    node.add_argument("--port", type=validators.port,
                      default=50051, help="gRPC port, 0 for any (default: 50051)")
    node.add_argument("--data-port", type=validators.port, default=0,
                      help="mx.distributed (ring) port of this node's workers (default: any free)")
    node.add_argument("--ready-file", type=Path,
                      help="write {port, data_port, pid, worker_address} as JSON here once "
                           "listening")
    node.add_argument("--metrics-port", type=validators.port, default=0, metavar="PORT",
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
    add_secret_file_flag(node)
    node.add_argument("--name", default="",
                      help="this node's id (default: the host name plus a key kept in "
                           "$OMLX_CLUSTER_HOME/node-key: unique and stable)")
    add_engine_flags(node)

    coordinator = sub.add_parser(
        "coordinator", parents=[common], help="run the gateway for nodes that join over the LAN",
        description="Run the OpenAI-compatible gateway and cluster control without a local "
                    "node. Nodes (`omlx-cluster join` on each Mac) are found over Bonjour or "
                    "register themselves, and are admitted only after proving they hold the "
                    "cluster secret. The model is planned over the nodes as they come and go.",
    )
    add_gateway_flags(coordinator)
    coordinator.add_argument("--secret", help="the cluster secret; `ps` shows it, so prefer "
                                              "--secret-file (default: --secret-file, then "
                                              "$OMLX_CLUSTER_SECRET; none: one is made up and "
                                              "printed)")
    add_secret_file_flag(coordinator)
    coordinator.add_argument("--os-reserve", type=validators.size, default="8GiB", metavar="SIZE",
                             help="memory every node keeps for its OS (default: 8GiB)")
    add_kv_reserve_flags(coordinator)
    coordinator.add_argument("--no-discovery", action="store_true",
                             help="do not browse Bonjour; only `join --coordinator` nodes join")
    coordinator.add_argument("--no-link-probe", action="store_true",
                             help="do not measure a joining node's links to the others (the "
                                  "planner then counts every link as free)")
    coordinator.add_argument("--link-max-age", type=validators.seconds,
                             default=DEFAULT_MAX_AGE_SECONDS, metavar="SECONDS",
                             help="measure a link again once its reading is this old, while "
                                  "no request or load has run for a while (default: "
                                  f"{DEFAULT_MAX_AGE_SECONDS:g}; 0: only when a node joins)")
    add_pipeline_flags(coordinator)
    add_rebalance_flags(coordinator)

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
    add_secret_file_flag(join)
    join.add_argument("--host", default="127.0.0.1",
                      help="address for gRPC and the data plane (default: 127.0.0.1; use this "
                           "Mac's LAN address, or 0.0.0.0, to join other Macs)")
    join.add_argument("--port", type=validators.port,
                      default=50051, help="gRPC port (default: 50051)")
    join.add_argument("--data-port", type=validators.port, default=0,
                      help="mx.distributed (ring) port (default: any free)")
    join.add_argument("--name", default="",
                      help="this node's id (default: the host name plus a key kept in "
                           "$OMLX_CLUSTER_HOME/node-key: unique and stable)")
    join.add_argument("--coordinator", type=validators.host_port, metavar="HOST:PORT",
                      help="also register with the coordinator's HTTP address directly, every "
                           "few seconds (default: Bonjour only)")
    join.add_argument("--metrics-port", type=validators.port, default=0, metavar="PORT",
                      help="the shard worker exports Prometheus /metrics here; the coordinator's "
                           "/cluster/prometheus-targets tells Prometheus (default: 0, any free "
                           "port)")
    join.add_argument("--no-announce", action="store_true",
                      help="do not announce over Bonjour (use with --coordinator)")
    join.add_argument("--speed", type=float, default=None, metavar="GBPS",
                      help="this Mac's weight-streaming speed in GB/s for the planner (default: "
                           "measured once, at the first join, and kept in "
                           "$OMLX_CLUSTER_HOME/calibration.json)")
    join.add_argument("--recalibrate", action="store_true",
                      help="measure the speed again instead of using the saved measurement")
    join.add_argument("--ready-file", type=Path,
                      help="write {port, pid} as JSON here once listening")
    join.add_argument("--orphan-grace", type=validators.seconds, default=600.0, metavar="SECONDS",
                      help="unload this Mac's models once no coordinator has called for this "
                           "long (0: never), so a cluster that is gone holds no memory here; "
                           "the node keeps running and loads again when a coordinator returns "
                           "(default: 600)")
    add_engine_flags(join)

    plan = sub.add_parser(
        "plan", parents=[common], help="show how a model would be split over nodes",
        description="Plan contiguous, uneven layer ranges of a model over nodes: the split that "
                    "minimises the slowest stage's time within every node's memory, and why. "
                    "Reads only the model's safetensors headers.",
    )
    plan.add_argument("--model", metavar="PATH_OR_NAME",
                      help="model folder or stored name (default: the embedded SmolLM2)")
    plan.add_argument("--node", action="append", required=True, metavar="NAME=MEM[,speed=X][,link_ms=Y][,link_gbps=Z]",
                      help="a node, in pipeline order: NAME=MEM with a unit (e.g. mac1=64GiB), "
                           "optional speed=GB/s of weights it streams, link_ms=one-way "
                           "latency to the next node, link_gbps=that link's GB/s and "
                           "layer_ms=a layer's fixed cost a decode step (ms; `join` measures "
                           "it beside the speed); repeat for each node")
    plan.add_argument("--split", type=validators.layer_counts, metavar="A,B,...",
                      help="check and explain this split instead of optimising")
    plan.add_argument("--parallel", choices=PARALLEL, default="pipeline",
                      help=PARALLEL_HELP + " (default: pipeline)")
    plan.add_argument("--os-reserve", type=validators.size, default="8GiB", metavar="SIZE",
                      help="memory kept free on every node (default: 8GiB, a joined Mac's; "
                           "serve's own local nodes share the machine less 4 GiB)")
    add_kv_reserve_flags(plan)
    add_hot_cache_flag(plan, "RAM each node's shard worker keeps for its prefix KV cache, as "
                              "`join --hot-cache-max-size` sets it")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")

    status = sub.add_parser(
        "status", parents=[common], help="show the nodes of a running cluster",
        description="Ask a running coordinator (`serve`) for its nodes: id, address, health, "
                    "layer range, agent and shard worker pids, metrics address, and the "
                    "active plan.")
    add_url_flag(status)
    status.add_argument("--json", action="store_true", help="print the raw JSON")
    add_api_key_flags(status, "a key the gateway takes (the first is sent)")

    rebalance = sub.add_parser(
        "rebalance", parents=[common], help="show or apply the best split for measured speeds",
        description="Ask a running coordinator for each node's measured speed, the current and "
                    "the best split for those speeds and the predicted gain, and move to it "
                    "now (past the threshold, window and cooldown), unless --dry-run.")
    rebalance.add_argument("--dry-run", action="store_true", help="show, do not move")
    add_url_flag(rebalance)
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
        add_url_flag(a)
        add_api_key_flags(a, "a key the gateway takes (the first is sent)")
        if action == "unload":
            a.add_argument("--wait", type=validators.unload_wait, default=0.0, metavar="SECONDS",
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
    add_ssh_flags(doctor)
    add_remote_command_flag(doctor)
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
    add_node_port_flags(doctor)
    doctor.add_argument("--probe-port", type=validators.port, metavar="PORT", default=31070,
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
    add_ssh_flags(up)
    add_remote_command_flag(up)
    up.add_argument("--secret-file", type=Path, metavar="FILE",
                    help="the cluster secret (mode 0600), copied to each host (default: "
                         "$OMLX_CLUSTER_HOME/secret, made with a new random secret if missing: "
                         "start the coordinator with --secret-file pointing at it)")
    up.add_argument("--coordinator", type=validators.host_port, metavar="HOST:PORT",
                    help="the coordinator's HTTP address: join registers with it, and up waits "
                         "for the admission there (default: Bonjour only, no wait)")
    add_api_key_flags(up, "the coordinator's API key, to read /cluster/status (the first is "
                          "sent)")
    add_node_port_flags(up)
    up.add_argument("--wait", type=validators.seconds, default=120.0, metavar="SECONDS",
                    help="for the admission, with --coordinator (default: 120; 0: do not "
                         "wait)")

    down = sub.add_parser(
        "down", parents=[common], help="stop join on Macs over SSH",
        description="On every host over SSH: unload and remove the launchd job `up` installed "
                    "(on Linux: stop the join it started). Its layers are re-planned over the "
                    "other nodes.")
    add_ssh_flags(down)

    probe = sub.add_parser(
        "link-probe", parents=[common], help="measure the data plane between two machines",
        description="One rank of a two-rank mx.distributed (ring) probe: run rank 0 on one "
                    "machine and rank 1 on the other at once, with the same --peers; rank 0 "
                    "prints the bandwidth and latency (doctor runs both over SSH).")
    probe.add_argument("--rank", type=int, choices=[0, 1], required=True,
                       help="this machine's rank: 0 measures, 1 answers")
    probe.add_argument("--peers", required=True, metavar="HOST:PORT,HOST:PORT",
                       help="the address rank 0 listens on, then rank 1's")
    probe.add_argument("--bytes", type=validators.positive, default=8 << 20,
                       help="size of the large message (default: 8 MiB)")
    probe.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS",
                       help="give up when the other rank has not answered by then (default: 30)")
    probe.add_argument("--json", action="store_true", help="print the measurement as JSON")
