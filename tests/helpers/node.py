"""A node agent of its own on loopback, for tests that drive its gRPC services."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc

from proto import omlx_pb2_grpc as pb_grpc


@contextmanager
def running_node(folder: Path, *flags: str) -> Iterator[tuple[subprocess.Popen,
                                                              pb_grpc.NodeAgentStub]]:
    """`omlx-cluster node` with `flags`, started in `folder`; it must shut down cleanly (every
    worker stopped, no abort)."""
    ready = folder / "ready.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "omlx_cluster", "node", "--port", "0", "--ready-file",
         str(ready), *flags])
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None, "node exited during start-up"
        assert time.monotonic() < deadline, "node did not start"
        time.sleep(0.05)
    channel = grpc.insecure_channel(f"127.0.0.1:{json.loads(ready.read_text())['port']}")
    yield proc, pb_grpc.NodeAgentStub(channel)
    channel.close()
    proc.terminate()
    assert proc.wait(15) == 0
