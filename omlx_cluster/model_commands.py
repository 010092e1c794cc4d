"""`models`: the local model store (list, pull, import-gguf, pull-default); the actions on a
running gateway's models go to the client."""

from __future__ import annotations

import argparse
from pathlib import Path

from omlx_cluster.client import model_action


def models_command(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from omlx_shared import model_store
    from omlx_shared.default_model import import_dest, pull_default
    from omlx_shared.gguf_import import import_gguf

    console = Console()
    if args.models_command in ("load", "unload", "pin", "unpin"):
        return model_action(args, console)
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
