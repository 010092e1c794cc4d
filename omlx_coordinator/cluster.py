"""The nodes serving one model, as the gateway sees them.

Single-Mac mode is a cluster of one local node: `serve` starts the node agent as a child process
and drives it over real gRPC on loopback, the same path a multi-Mac cluster uses.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from omlx_coordinator.node_client import NodeClient
from omlx_coordinator.tokenizer import ChatTokenizer

log = logging.getLogger(__name__)

NODE_START_TIMEOUT_SECONDS = 120.0


def _node_env() -> dict[str, str]:
    """The node's environment: on a Linux CPU, preload OpenBLAS when it is installed.

    MLX's CPU wheel ships reference BLAS (~5 GFLOP/s fp32); Debian's OpenBLAS measured ~17x
    faster here. OMLX_BLAS=reference keeps the wheel's own."""
    env = dict(os.environ)
    blas = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
    if (
        sys.platform == "linux"
        and os.environ.get("OMLX_BLAS", "openblas") == "openblas"
        and Path(blas).exists()
        and "LD_PRELOAD" not in env
    ):
        env["LD_PRELOAD"] = blas
        env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return env


class LocalNodeProcess:
    """A node agent started as a child process (`omlx-cluster node`)."""

    def __init__(self, host: str = "127.0.0.1", extra_args: list[str] | None = None,
                 log_path: Path | None = None):
        self._dir = tempfile.TemporaryDirectory(prefix="omlx-node-")
        self.port_file = Path(self._dir.name) / "port"
        cmd = [sys.executable, "-m", "omlx_cluster.cli", "node", "--host", host, "--port", "0",
               "--port-file", str(self.port_file), "--exit-with-parent", *(extra_args or [])]
        self.log_path = log_path or Path(self._dir.name) / "node.log"
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=_node_env())
        self.host = host

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    async def wait_address(self, timeout: float = NODE_START_TIMEOUT_SECONDS) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the node process exited with code {self.proc.returncode}:\n{self.log_tail()}"
                )
            if self.port_file.exists() and self.port_file.read_text().strip():
                return f"{self.host}:{int(self.port_file.read_text())}"
            await asyncio.sleep(0.05)
        raise TimeoutError(f"the node did not start within {timeout:.0f}s:\n{self.log_tail()}")

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        self._log.close()
        self._dir.cleanup()


class Cluster:
    """One model served by one node (single-Mac mode)."""

    def __init__(self, model_path: Path, model_id: str, node_args: list[str] | None = None):
        self.model_path = model_path
        self.model_id = model_id
        self.tokenizer = ChatTokenizer(model_path)
        config = json.loads((model_path / "config.json").read_text())
        self.max_context = int(config.get("max_position_embeddings") or 0)
        self.vocab_size = int(config.get("vocab_size") or len(self.tokenizer.tokenizer))
        self.node_args = node_args or []
        self.process: LocalNodeProcess | None = None
        self.node: NodeClient | None = None
        self.ready = False
        self.status = "starting"
        self.nodes: list[dict] = []

    async def start(self) -> None:
        try:
            self.status = "starting the node"
            self.process = LocalNodeProcess(extra_args=self.node_args)
            address = await self.process.wait_address()
            self.node = NodeClient(address)
            self.status = f"loading {self.model_id}"
            reply = await self.node.load_shard(str(self.model_path), self.model_id)
            log.info("node %s loaded %s in %.1fs (%s)", address, reply.model_id,
                     reply.load_seconds, reply.dtype)
            health = await self.node.health()
            self.nodes = [{"address": address, "pid": health.pid,
                           "metrics_port": health.metrics_port or None,
                           "layers": [reply.layer_start, reply.layer_end], "dtype": reply.dtype}]
            self.ready = True
            self.status = "ready"
        except Exception as e:
            tail = self.process.log_tail() if self.process else ""
            reason = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
            self.status = f"failed: {reason}"
            log.error("the node failed to load %s: %s\n%s", self.model_path, reason, tail)
            raise

    async def stop(self) -> None:
        self.ready = False
        if self.node is not None:
            await self.node.close()
        if self.process is not None:
            await asyncio.to_thread(self.process.stop)
