"""A shard worker started ahead of its plan, a node agent's standby (omlx_node/agent.py):
`python -m omlx_node.standby`, which is `python -m omlx_node.worker` with the worker's modules
imported at a background load's priority.

The agent starts its standby right after each load, while the model just loaded starts serving
beside the others; the imports (MLX, mlx-lm, transformers' tokenizers, grpc: about 1.2 s of a
core here) took that core from them at nice 0. Here they run on a thread of their own at
BACKGROUND_LOAD_NICE (a load nobody waits for yet) and take what the serving workers leave,
while the main thread, which serves once a job comes, keeps its priority. No thread outlives
the imports to carry their nice value on: MLX starts its stream threads at the first
evaluation, and OpenBLAS its pool when the process starts, both from the main thread.

Once imported, a standby leaves IMPORTED beside its ready file: a load that requests wait for
takes a standby only then (`imported`), and starts a fresh worker rather than wait for one
still importing behind busy workers.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

from omlx_node.load_priority import load_nice, on_niced_thread, thread_nice
from omlx_shared.child import write_ready
from proto import omlx_pb2 as pb

IMPORTED = "imported.json"


def import_nice() -> int:
    """The nice value a standby imports at: a background load's."""
    return load_nice(pb.LOAD_PRELOAD)


def imported(ready_file: Path) -> bool:
    """Whether the standby whose ready file is `ready_file` has imported the worker's modules."""
    return ready_file.with_name(IMPORTED).exists()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--ready-file", type=Path)
    ready_file = parser.parse_known_args(argv)[0].ready_file
    nice, t0 = import_nice(), time.monotonic()

    def load_worker():
        return thread_nice(), importlib.import_module("omlx_node.worker")

    niced, worker = on_niced_thread(load_worker, nice, "imports") if nice else load_worker()
    if ready_file is not None:  # the nice value the importing thread read
        write_ready(ready_file.with_name(IMPORTED),
                    {"nice": niced, "seconds": time.monotonic() - t0})
    return worker.main(argv)


if __name__ == "__main__":
    sys.exit(main())
