"""The nodes serving one model, as the gateway sees them.

`serve` starts its node agents as child processes on this machine (`--nodes N`, one by default)
and drives them over real gRPC on loopback, the path a multi-Mac cluster uses: it plans the
layer split, asks every agent at once to load its range (the data-plane group forms only when all
ranks join) and sends sequences to the head worker.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc

from omlx_cluster.child import ChildProcess, omlx_command
from omlx_coordinator.model_layout import read_layout
from omlx_coordinator.node_client import AgentClient, WorkerClient
from omlx_coordinator.planner import NodeSpec, Plan, make_plan
from omlx_coordinator.tokenizer import ChatTokenizer
from proto import omlx_pb2 as pb

log = logging.getLogger(__name__)

NODE_START_TIMEOUT_SECONDS = 120.0


def node_env() -> dict[str, str]:
    """A node's environment: on a Linux CPU, preload OpenBLAS when it is installed.

    MLX's CPU wheel ships reference BLAS (~5 GFLOP/s fp32); Debian's OpenBLAS measured ~26x
    faster here (bench/results). OMLX_BLAS=reference keeps the wheel's own."""
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


def machine_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass
class ClusterOptions:
    nodes: int = 1
    split: list[int] | None = None
    micro_batches: int = 0  # 0: one per stage
    backend: str = "ring"
    node_args: tuple[str, ...] = ()  # for every node agent
    head_args: tuple[str, ...] = ()  # for the first one only (e.g. its metrics port)


class Cluster:
    """One model served by a pipeline of local node agents (one: single-Mac mode)."""

    def __init__(self, model_path: Path, model_id: str, options: ClusterOptions | None = None):
        self.model_path = model_path
        self.model_id = model_id
        self.options = options or ClusterOptions()
        self.tokenizer = ChatTokenizer(model_path)
        config = json.loads((model_path / "config.json").read_text())
        self.max_context = int(config.get("max_position_embeddings") or 0)
        self.vocab_size = int(config.get("vocab_size") or len(self.tokenizer.tokenizer))
        self.processes: list[ChildProcess] = []
        self.agents: list[AgentClient] = []
        self.node: WorkerClient | None = None  # the head worker
        self.plan: Plan | None = None
        self.ready = False
        self.status = "starting"
        self.nodes: list[dict] = []

    def make_plan(self) -> Plan:
        """Local nodes share this machine's memory, so each is planned with its share."""
        n = self.options.nodes
        layout = read_layout(self.model_path, model_id=self.model_id)
        nodes = [NodeSpec(f"local{i}", machine_memory() // n) for i in range(n)]
        return make_plan(layout, nodes, os_reserve_bytes=(4 << 30) // n,
                         split=self.options.split)

    async def _start_agent(self, i: int) -> tuple[ChildProcess, dict]:
        extra = self.options.head_args if i == 0 else ()
        env = node_env()
        # One accelerator per local node on a multi-GPU host: OMLX_NODE_DEVICES=0,1,...
        devices = [d for d in os.environ.get("OMLX_NODE_DEVICES", "").split(",") if d]
        if devices:
            env["CUDA_VISIBLE_DEVICES"] = devices[i % len(devices)]
        proc = ChildProcess(omlx_command("node", "--port", "0", "--exit-with-parent",
                                         *self.options.node_args, *extra),
                            f"node agent {i}", env=env)
        info = await asyncio.to_thread(proc.wait_ready, NODE_START_TIMEOUT_SECONDS)
        return proc, info

    async def start(self) -> None:
        try:
            self.plan = plan = self.make_plan()
            self.status = f"starting {self.options.nodes} node(s)"
            started = await asyncio.gather(*(self._start_agent(i)
                                             for i in range(self.options.nodes)))
            self.processes = [p for p, _ in started]
            infos = [info for _, info in started]
            self.agents = [AgentClient(f"127.0.0.1:{info['port']}") for info in infos]
            peers = [f"127.0.0.1:{info['data_port']}" for info in infos]
            world = len(plan.stages)
            self.status = f"loading {self.model_id} (plan {plan.plan_hash})"
            replies = await asyncio.gather(*(
                agent.load_shard(pb.LoadShardRequest(
                    model_path=str(self.model_path), model_id=self.model_id,
                    layer_start=stage.layer_start, layer_end=stage.layer_end, rank=rank,
                    world_size=world, peers=peers if world > 1 else [],
                    backend=self.options.backend, plan_hash=plan.plan_hash,
                    micro_batches=self.options.micro_batches))
                for rank, (agent, stage) in enumerate(zip(self.agents, plan.stages))))
            self.node = WorkerClient(replies[0].worker_address)
            health = await self.node.health()
            self.nodes = [{"address": agent.address, "agent_pid": proc.pid,
                           "worker_pid": reply.worker_pid,
                           "layers": [reply.layer_start, reply.layer_end], "dtype": reply.dtype,
                           "metrics_port": (health.metrics_port or None) if rank == 0 else None}
                          for rank, (agent, proc, reply)
                          in enumerate(zip(self.agents, self.processes, replies))]
            log.info("serving %s on %d stage(s), split %s, loaded in %.1fs", self.model_id,
                     world, plan.split, max(r.load_seconds for r in replies))
            self.ready = True
            self.status = "ready"
        except Exception as e:
            reason = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
            self.status = f"failed: {reason}"
            log.error("could not start serving %s: %s", self.model_path, reason)
            raise

    async def stop(self) -> None:
        self.ready = False
        for client in [*self.agents, *([self.node] if self.node else [])]:
            await client.close()
        await asyncio.gather(*(asyncio.to_thread(p.stop) for p in self.processes))
