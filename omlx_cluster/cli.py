"""`omlx-cluster`: serve a model, run a node agent, manage the model store. The commands live in
their own modules; this one parses, sets up the process and dispatches."""

from __future__ import annotations

import logging
import os
import sys

from omlx_cluster.client import rebalance_command, status_command
from omlx_cluster.model_commands import models_command
from omlx_cluster.node_commands import join_command, node_command
from omlx_cluster.office import (
    doctor_command,
    down_command,
    link_probe_command,
    secret_command,
    up_command,
)
from omlx_cluster.parser import build_parser
from omlx_cluster.plan import plan_command
from omlx_cluster.serve import coordinator_command, serve_command


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
    args = build_parser().parse_args(argv)
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
    handler = {"serve": serve_command, "coordinator": coordinator_command,
               "join": join_command, "node": node_command,
               "plan": plan_command, "status": status_command,
               "rebalance": rebalance_command, "models": models_command,
               "doctor": doctor_command, "up": up_command, "down": down_command,
               "secret": secret_command, "link-probe": link_probe_command}[args.command]
    try:
        return handler(args)
    except KeyboardInterrupt:  # Ctrl-C: the processes it started stop with it; no traceback
        print("stopped", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `plan ... | head`: the reader left; nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
