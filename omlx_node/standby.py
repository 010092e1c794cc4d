"""A shard worker whose imports run at a load's priority: `python -m omlx_node.standby
[--import-nice N]`, which is `python -m omlx_node.worker` with the worker's modules imported on
a thread at nice N (and SCHED_IDLE where omlx_node.load_priority says), while the main thread,
which serves once a job comes, keeps its priority.

The agent starts its standby (a worker started ahead of its plan, omlx_node/agent.py) right after
each load, while the model just loaded starts serving beside the others; the imports (MLX, mlx-lm,
transformers' tokenizers, grpc: most of the CPU a worker spends before its first load) took that
core from them at nice 0. A standby imports at BACKGROUND_LOAD_NICE (a load nobody waits for yet);
a worker started fresh for a job (no standby ready) at that job's load's priority. No thread
outlives the imports to carry their priority on: MLX starts its stream threads at the first
evaluation, from the thread that evaluates, and OpenBLAS its pool when the process starts.

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

from omlx_node.load_priority import load_nice, on_niced_thread, thread_idle, thread_nice
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
    parser.add_argument("--import-nice", type=int, default=None)
    known, rest = parser.parse_known_args(argv)
    ready_file = known.ready_file
    nice = import_nice() if known.import_nice is None else known.import_nice
    t0 = time.monotonic()

    def load_worker():
        return thread_nice(), thread_idle(), importlib.import_module("omlx_node.worker")

    niced, idle, worker = (on_niced_thread(load_worker, nice, "imports") if nice
                           else load_worker())
    if ready_file is not None:  # the priority the importing thread read
        write_ready(ready_file.with_name(IMPORTED),
                    {"nice": niced, "idle": idle, "seconds": time.monotonic() - t0})
    return worker.main([*rest, *(["--ready-file", str(ready_file)] if ready_file else [])])


if __name__ == "__main__":
    sys.exit(main())
