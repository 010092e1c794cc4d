"""A coordinator and node agents as processes, each with its own log."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from omlx_shared.child import omlx_command
from tests.cluster_secret import SECRET


def launch(args: list[str], home: Path, log: Path) -> subprocess.Popen:
    env = dict(os.environ, OMLX_CLUSTER_HOME=str(home), OMLX_CLUSTER_SECRET=SECRET)
    return subprocess.Popen(omlx_command(*args), stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, env=env)
