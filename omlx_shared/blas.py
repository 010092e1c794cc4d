"""The BLAS a process that runs MLX on a Linux CPU should load: the environment to start it with.

MLX's CPU wheel ships reference BLAS; Debian's OpenBLAS is many times faster (bench/results/,
e.g. single-node-cpu.md). The library must be preloaded when the process starts, so whoever starts
a shard worker (the node agent, for `serve`'s nodes and `join`'s alike) passes this environment.
OMLX_BLAS=reference keeps the wheel's own.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
OPENBLAS_PACKAGE = "libopenblas0-pthread"  # Debian's package that installs it


def blas_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) with OpenBLAS preloaded on a Linux CPU
    where it is installed, single-threaded unless OPENBLAS_NUM_THREADS says otherwise (the
    setting bench/results measured)."""
    env = dict(os.environ if base is None else base)
    if (sys.platform == "linux" and env.get("OMLX_BLAS", "openblas") == "openblas"
            and Path(OPENBLAS).exists() and "LD_PRELOAD" not in env):
        env["LD_PRELOAD"] = OPENBLAS
        env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return env
