"""`omlx-cluster`: serve a model, run a node agent, manage the model store."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from omlx_cluster import __version__

log = logging.getLogger("omlx_cluster")


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill-chunk", type=_positive, default=512, metavar="TOKENS",
                   help="prompt tokens computed per engine step; a long prompt delays running "
                        "streams by at most one chunk (default: 512)")
    p.add_argument("--max-batch", type=_positive, default=64, metavar="N",
                   help="most sequences decoding at once on a node; more wait in a queue "
                        "(default: 64)")


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
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser(
        "serve", parents=[common], help="serve a model on this machine (gateway + one local node)",
        description="Start the OpenAI-compatible gateway and one local node holding every layer "
                    "(single-Mac mode). Without --model it serves the embedded default model, "
                    "SmolLM2-135M-Instruct, imported on first run. GET /health answers 200 once "
                    "the model is ready.",
    )
    serve.add_argument("--model", metavar="PATH_OR_NAME",
                       help="an mlx-lm model folder (config.json, safetensors, tokenizer; "
                            "quantized folders too) or the name of a model in the store "
                            "(`omlx-cluster models list`); default: the embedded SmolLM2")
    serve.add_argument("--model-id", help="the model name clients send (default: folder name)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address the gateway listens on (default: 127.0.0.1, this machine "
                            "only; 0.0.0.0 exposes it to the network)")
    serve.add_argument("--port", type=int, default=8000, help="gateway port (default: 8000)")
    serve.add_argument("--request-timeout", type=float, default=900.0, metavar="SECONDS",
                       help="longest a request may run before it fails with 504 (default: 900)")
    serve.add_argument("--keepalive", type=float, default=5.0, metavar="SECONDS",
                       help="SSE keep-alive comment interval while a stream waits for its first "
                            "token (default: 5)")
    serve.add_argument("--default-max-tokens", type=_positive, default=4096, metavar="N",
                       help="completion limit when a request sets none, capped by the context "
                            "(default: 4096)")
    serve.add_argument("--node-metrics-port", type=int, default=None, metavar="PORT",
                       help="also export the local node's Prometheus /metrics on this port "
                            "(0 picks a free one; default: off)")
    _add_engine_flags(serve)

    node = sub.add_parser(
        "node", parents=[common], help="run a node agent (gRPC server that runs model shards)",
        description="Run a node agent: the gRPC server (proto/omlx.proto) that loads a shard on "
                    "request and runs it with its continuous batcher. `serve` starts one itself.",
    )
    node.add_argument("--host", default="127.0.0.1", help="gRPC listen address (default: 127.0.0.1)")
    node.add_argument("--port", type=int, default=50051, help="gRPC port, 0 for any (default: 50051)")
    node.add_argument("--port-file", type=Path, help="write the bound gRPC port here once listening")
    node.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                      help="export Prometheus /metrics on this port (0 for any; default: off)")
    node.add_argument("--model", metavar="PATH_OR_NAME",
                      help="load this model at start instead of waiting for LoadShard")
    node.add_argument("--exit-with-parent", action="store_true",
                      help="exit when the process that started this node exits")
    _add_engine_flags(node)

    models = sub.add_parser("models", parents=[common], help="manage the local model store",
                            description="Manage the model store under $OMLX_CLUSTER_HOME/models.")
    msub = models.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    msub.add_parser("list", help="list the models in the store")
    imp = msub.add_parser("import-gguf", help="import a GGUF file (F32/F16/BF16/Q8_0/Q4_0/Q4_1)",
                          description="Convert a GGUF file (llama or qwen2 family) into an MLX "
                                      "model folder in the store. Q8_0/Q4_0/Q4_1 stay quantized "
                                      "(exactly, as MLX affine quantization).")
    imp.add_argument("file", type=Path, help="the .gguf file")
    imp.add_argument("--dest", type=Path, help="output folder (default: the store, named after "
                                               "the model)")
    msub.add_parser("pull-default", help="fetch and import the embedded default model now")
    return parser


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from omlx_cluster.model_store import ModelError, resolve_model
    from omlx_coordinator.cluster import Cluster
    from omlx_coordinator.gateway import GatewaySettings, create_app

    try:
        model_path = resolve_model(args.model, progress=True)
    except ModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    node_args = ["--prefill-chunk", str(args.prefill_chunk), "--max-batch", str(args.max_batch),
                 "--log-level", args.log_level]
    if args.node_metrics_port is not None:
        node_args += ["--metrics-port", str(args.node_metrics_port)]
    cluster = Cluster(model_path, args.model_id or model_path.name, node_args=node_args)
    settings = GatewaySettings(request_timeout=args.request_timeout,
                               keepalive_seconds=args.keepalive,
                               default_max_tokens=args.default_max_tokens)
    failures: list[str] = []

    def give_up(reason: str) -> None:  # nothing can be served: exit rather than idle at 503
        failures.append(reason)
        server.should_exit = True

    app = create_app(cluster, settings, on_start_failure=give_up)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level=args.log_level,
                                           timeout_graceful_shutdown=5))
    log.info("serving %s at http://%s:%d/v1", cluster.model_id, args.host, args.port)
    server.run()
    if failures:
        print(f"error: could not serve {model_path}: {failures[0]}", file=sys.stderr)
        return 1
    return 0


def _node(args: argparse.Namespace) -> int:
    from omlx_node.agent import NodeAgent
    from proto import omlx_pb2 as pb

    agent = NodeAgent(args.host, args.port, args.metrics_port, args.prefill_chunk, args.max_batch)
    if args.model:
        from omlx_cluster.model_store import resolve_model

        path = resolve_model(args.model, progress=False)
        agent.load(pb.LoadShardRequest(model_path=str(path), model_id=path.name))
    if args.port_file:
        tmp = args.port_file.with_suffix(".tmp")
        tmp.write_text(str(agent.port))
        os.replace(tmp, args.port_file)  # readers never see a half-written port
    agent.serve_forever(watch_parent=args.exit_with_parent)
    return 0


def _models(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from omlx_cluster import model_store
    from omlx_cluster.default_model import pull_default
    from omlx_cluster.gguf_import import import_gguf

    console = Console()
    try:
        if args.models_command == "list":
            rows = model_store.list_models()
            if not rows:
                console.print(f"no models in {model_store.models_dir()}; `omlx-cluster "
                              "models pull-default` or `models import-gguf FILE` adds one")
                return 0
            table = Table("name", "family", "layers", "size", "quantization", "path")
            for m in rows:
                table.add_row(m.name, m.model_type, str(m.num_layers),
                              f"{m.size_bytes / 2**20:.0f} MiB", m.quantization, str(m.path))
            console.print(table)
        elif args.models_command == "import-gguf":
            path = import_gguf(args.file, args.dest, progress=True)
            console.print(f"imported into {path}")
        else:
            console.print(f"default model ready at {pull_default(progress=True)}")
    except (model_store.ModelError, FileNotFoundError) as e:
        console.print(f"[red]error:[/red] {e}")
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler = {"serve": _serve, "node": _node, "models": _models}[args.command]
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
