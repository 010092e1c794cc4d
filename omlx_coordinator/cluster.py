"""The nodes serving one model, as the gateway sees them.

`serve` starts its node agents as child processes on this machine (`--nodes N`, one by default)
and drives them over real gRPC on loopback, the path a multi-Mac cluster uses: it plans the
layer split, asks every agent at once to load its range (the data-plane group forms only when all
ranks join) and sends sequences to the head worker. Those agents read the coordinator's model
folder; a node that joined over the network first receives the tensors of its range
(omlx_coordinator/weight_transfer.py) unless it holds them already.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from omlx_coordinator.backend import BackendChoice, BackendError, choose_backend
from omlx_coordinator.membership import DiscoveryBridge
from omlx_coordinator.model_layout import read_layout
from omlx_coordinator.node_client import AdmissionError, AgentClient, WorkerClient
from omlx_coordinator.planner import NodeSpec, Plan, PlanError, Stage, make_plan
from omlx_coordinator.tokenizer import ChatTokenizer
from omlx_coordinator.weight_transfer import (
    TransferProgress,
    WeightCounters,
    WeightSource,
    ensure_weights,
)
from omlx_shared import auth
from omlx_shared.child import ChildProcess, omlx_command
from omlx_shared.hardware import machine_memory
from proto import omlx_pb2 as pb

log = logging.getLogger(__name__)

NODE_START_TIMEOUT_SECONDS = 120.0
HEARTBEAT_SECONDS = 0.5
NODE_LOST_SECONDS = 3.0  # a node that has not answered for this long is gone


@dataclass
class ClusterOptions:
    nodes: int = 1
    split: list[int] | None = None
    micro_batches: int = 0  # 0: one per stage
    backend: str = "auto"  # the data plane: "auto", "ring" or "jaccl" (omlx_coordinator/backend.py)
    secret: str | None = None  # the cluster secret; serve makes one up for its own nodes
    os_reserve_bytes: int = 8 << 30  # memory every remote node keeps for its OS and apps
    discovery: bool = False  # admit nodes Bonjour announces (coordinator mode)
    discovery_interfaces: list[str] | None = None
    node_args: tuple[str, ...] = ()  # for every node agent
    # Local node i's shard worker exports /metrics on this port + i (0: each on any free one).
    node_metrics_port: int = 0


@dataclass
class Member:
    """A node agent of this cluster, as the coordinator tracks it."""

    name: str
    agent: AgentClient
    process: ChildProcess | None  # set when this coordinator started the agent itself
    budget_bytes: int = 0  # memory the plan may use on it
    speed: float = 1.0  # GB/s of weights it streams (1.0: not measured)
    chip: str = ""
    alive: bool = True
    last_seen: float = 0.0
    health: pb.HealthReply | None = None
    layers: tuple[int, int] | None = None
    # Its Thunderbolt ports with RDMA, from its handshake (none off macOS).
    rdma_ports: list[pb.RdmaPort] = field(default_factory=list)
    # Why the node cannot take this model's weights (no disk space): plans leave it out until
    # it joins again.
    weights_error: str = ""


class NoCapacity(RuntimeError):
    """The model fits on none of the nodes left; the message says how much is missing."""


class Cluster:
    """One model served by a pipeline of node agents (one: single-Mac mode).

    It watches its members (a health call every HEARTBEAT_SECONDS); when a node or a shard
    worker of the active plan dies it re-plans over the nodes left and loads the new plan, and
    `wait_ready` lets in-flight requests resume on it."""

    def __init__(self, model_path: Path, model_id: str, options: ClusterOptions | None = None):
        self.model_path = model_path
        self.model_id = model_id
        self.options = options or ClusterOptions()
        self.tokenizer = ChatTokenizer(model_path)
        config = json.loads((model_path / "config.json").read_text())
        self.max_context = int(config.get("max_position_embeddings") or 0)
        self.vocab_size = int(config.get("vocab_size") or len(self.tokenizer.tokenizer))
        self.layout = read_layout(model_path, model_id=model_id)
        self.members: list[Member] = []
        self.node: WorkerClient | None = None  # the head worker of the active plan
        self.plan: Plan | None = None
        self.epoch = 0  # plans loaded so far
        self.ready = False
        self.status = "starting"
        self.capacity_error = ""
        self.last_recovery: dict | None = None
        self.load_seconds = 0.0  # the slowest stage's weight load in the last plan
        self.backend: BackendChoice | None = None  # the data plane of the active plan
        # Stages (member names in rank order) whose automatic jaccl group failed to form, and
        # why: they go straight to ring until one of them joins again.
        self._jaccl_failed: dict[tuple[str, ...], str] = {}
        self._ready_event = asyncio.Event()
        self._monitor_task: asyncio.Task | None = None
        self._discovery = None
        self._replanning = asyncio.Lock()
        self._admitting = asyncio.Lock()  # add_remote
        self.registrations = auth.Registrations(self.options.secret)  # /cluster/register
        self.weight_counters = WeightCounters()
        self._weight_source: WeightSource | None = None  # indexed when a remote node needs it

    def local_budget(self) -> int:
        """Local nodes share this machine's memory (less 4 GiB for everything else)."""
        return max(0, machine_memory() - (4 << 30)) // max(1, self.options.nodes)

    def make_plan(self, members: list[Member] | None = None) -> Plan:
        """Plans over `members` (default: the local nodes `serve` is about to start)."""
        if members is None:
            nodes = [NodeSpec(f"local{i}", self.local_budget())
                     for i in range(self.options.nodes)]
        else:
            nodes = [NodeSpec(m.name, m.budget_bytes, m.speed) for m in members]
        split = self.options.split if len(nodes) == self.options.nodes else None
        return make_plan(self.layout, nodes, os_reserve_bytes=0, split=split)

    @property
    def nodes(self) -> list[dict]:
        """What /health and /cluster/status show of each member."""
        out = []
        for m in self.members:
            h = m.health
            out.append({
                "id": m.name, "address": m.agent.address, "alive": m.alive,
                "healthy": bool(m.alive and h and h.ready),
                "layers": list(m.layers) if m.layers else None,
                "agent_pid": h.pid if h else (m.process.pid if m.process else None),
                "worker_pid": (h.worker_pid or None) if h else None,
                "metrics_port": (h.metrics_port or None) if h else None,
                # Where Prometheus scrapes its shard worker (/cluster/prometheus-targets).
                "metrics": (f"{m.agent.address.rsplit(':', 1)[0]}:{h.metrics_port}"
                            if h and h.metrics_port else None),
                "version": h.version if h else None,
                "memory_budget": m.budget_bytes, "chip": m.chip, "speed_gbps": m.speed,
                "weights_error": m.weights_error or None,
                "rdma_devices": [p.device for p in m.rdma_ports],
                # The node's own checks of its machine (omlx-cluster doctor's), from its agent.
                "checks": [{"name": c.name, "status": c.status, "detail": c.detail,
                            "fix": c.fix} for c in h.checks] if h else [],
            })
        return out

    async def _start_agent(self, i: int) -> tuple[ChildProcess, dict]:
        port = self.options.node_metrics_port
        env = dict(os.environ)
        if self.options.secret:
            env[auth.SECRET_ENV] = self.options.secret  # not on the command line: ps shows it
        # One accelerator per local node on a multi-GPU host: OMLX_NODE_DEVICES=0,1,...
        devices = [d for d in os.environ.get("OMLX_NODE_DEVICES", "").split(",") if d]
        if devices:
            env["CUDA_VISIBLE_DEVICES"] = devices[i % len(devices)]
        # Named, so that its TLS certificate names the member the coordinator dials.
        proc = ChildProcess(omlx_command("node", "--port", "0", "--exit-with-parent",
                                         "--name", f"local{i}", *self.options.node_args,
                                         "--metrics-port", str(port + i if port else 0)),
                            f"node agent {i}", env=env)
        info = await asyncio.to_thread(proc.wait_ready, NODE_START_TIMEOUT_SECONDS)
        return proc, info

    async def start(self) -> None:
        if self.options.nodes == 0:  # a coordinator alone: nodes join over the network
            self.capacity_error = ("no node has joined yet: run `omlx-cluster join` on a Mac "
                                   "with this cluster's secret")
            self.status = f"waiting for nodes ({self.capacity_error})"
            log.info("waiting for nodes to join (Bonjour discovery %s)",
                     "on" if self.options.discovery else "off")
            self._monitor_task = asyncio.create_task(self._monitor())
            if self.options.discovery:
                self._discovery = DiscoveryBridge(self.add_remote,
                                                  self.options.discovery_interfaces)
                await self._discovery.start()
            return
        try:
            self.make_plan()  # fail before starting anything if the model cannot fit
            self.status = f"starting {self.options.nodes} node(s)"
            started = await asyncio.gather(*(self._start_agent(i)
                                             for i in range(self.options.nodes)))
            now = time.monotonic()
            self.members = [Member(f"local{i}", AgentClient(f"127.0.0.1:{info['port']}",
                                                            f"local{i}", self.options.secret),
                                   proc, budget_bytes=self.local_budget(), last_seen=now)
                            for i, (proc, info) in enumerate(started)]
            hellos = await asyncio.gather(*(m.agent.admit() for m in self.members))
            for m, hello in zip(self.members, hellos):
                m.chip, m.rdma_ports = hello.chip, list(hello.rdma_ports)
            await self._load_plan()
            self._monitor_task = asyncio.create_task(self._monitor())
        except Exception as e:
            reason = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
            self.status = f"failed: {reason}"
            log.error("could not start serving %s: %s", self.model_path, reason)
            raise

    async def _load_plan(self, plan: Plan | None = None) -> None:
        """Has each member of `plan` (default: a new plan over the live members) load its range;
        every agent at once, since the data-plane group forms only when all ranks have joined.
        A jaccl group chosen automatically that fails to form is loaded again over ring: RDMA
        that misbehaves must not leave the cluster down."""
        members, plan = self._staged(plan)
        if plan is None:
            self.capacity_error = self.capacity_error or "no node is left to run the model"
            self.status = f"no capacity: {self.capacity_error}"
            raise NoCapacity(self.capacity_error)
        try:
            choice = self._choose_backend(members)
        except BackendError as e:
            self.capacity_error = str(e)
            self.status = f"cannot serve: {e}"
            raise NoCapacity(str(e)) from None
        paths = await self._transfer_weights(members, plan)
        self.status = f"loading {self.model_id} (plan {plan.plan_hash})"
        try:
            replies = await self._load_stages(plan, members, paths, choice)
        except grpc.aio.AioRpcError as e:
            if choice.backend != "jaccl" or self.options.backend != "auto":
                raise
            error = _error_line(e.details() or str(e.code()))
            log.warning("the jaccl group of plan %s did not form (%s): loading it over ring",
                        plan.plan_hash, error)
            self._jaccl_failed[tuple(m.name for m in members)] = error
            choice = BackendChoice("ring", f"jaccl did not form: {error}")
            replies = await self._load_stages(plan, members, paths, choice)
        if self.node is not None:
            await self.node.close()
        self.node = members[0].agent.worker(replies[0].worker_address)
        for m in self.members:
            m.layers = None
        for m, r in zip(members, replies):
            m.layers = (r.layer_start, r.layer_end)
            m.health = await m.agent.health()
        self.plan, self.backend, self.capacity_error = plan, choice, ""
        self.load_seconds = max(r.load_seconds for r in replies)
        self.epoch += 1
        log.info("serving %s on %d stage(s) over %s (%s), split %s (plan %s, epoch %d)",
                 self.model_id, len(members), choice.backend, choice.reason, plan.split,
                 plan.plan_hash, self.epoch)
        self.ready, self.status = True, "ready"
        self._ready_event.set()

    def _choose_backend(self, members: list[Member]) -> BackendChoice:
        """The data plane for `members` (in rank order); raises BackendError."""
        failed = self._jaccl_failed.get(tuple(m.name for m in members))
        if failed is not None and self.options.backend == "auto":
            return BackendChoice("ring", f"jaccl did not form on these nodes before: {failed}")
        return choose_backend(self.options.backend, [m.rdma_ports for m in members],
                              [m.name for m in members])

    async def _load_stages(self, plan: Plan, members: list[Member], paths: dict[str, str],
                           choice: BackendChoice) -> list[pb.LoadShardReply]:
        """Has every stage load its range over `choice`'s backend. Waits for every agent to
        answer before raising: a retry must not find an agent still busy with this attempt, nor
        name a data port it is about to replace. Raises the first failure, usually the cause:
        the other ranks then wait for the failed one until their watchdog ends them."""
        world = len(members)
        peers: list[str] = []
        if world > 1:
            healths = await asyncio.gather(*(m.agent.health() for m in members))
            peers = [f"{m.agent.address.rsplit(':', 1)[0]}:{h.data_port}"
                     for m, h in zip(members, healths)]
        failures: list[BaseException] = []

        async def load(rank: int, m: Member, stage: Stage) -> pb.LoadShardReply:
            try:
                return await m.agent.load_shard(pb.LoadShardRequest(
                    model_path=paths.get(m.name, str(self.model_path)), model_id=self.model_id,
                    layer_start=stage.layer_start, layer_end=stage.layer_end, rank=rank,
                    world_size=world, peers=peers,
                    backend=choice.backend if world > 1 else "",
                    rdma_devices_json=choice.devices_json, plan_hash=plan.plan_hash,
                    micro_batches=self.options.micro_batches))
            except BaseException as e:
                failures.append(e)
                raise

        replies = await asyncio.gather(*(load(rank, m, stage) for rank, (m, stage)
                                         in enumerate(zip(members, plan.stages))),
                                       return_exceptions=True)
        if failures:
            raise failures[0]
        return replies

    def servable(self) -> list[Member]:
        """The live members a plan may use, in ring order."""
        return [m for m in self.members if m.alive and not m.weights_error]

    def _next_plan(self) -> tuple[list[Member], Plan | None]:
        """The live members that may serve, and a plan over them (None: none fits)."""
        live = self.servable()
        try:
            return live, self.make_plan(live) if live else None
        except PlanError as e:
            self.capacity_error = str(e)
            return live, None

    async def _transfer_weights(self, members: list[Member], plan: Plan) -> dict[str, str]:
        """Sends every remote stage the tensors of its range it lacks, all nodes at once;
        returns each remote node's folder to load from. Local nodes read the model's folder."""
        remote = [(m, s) for m, s in zip(members, plan.stages) if m.process is None]
        if not remote:
            return {}
        if self._weight_source is None:
            self._weight_source = await asyncio.to_thread(WeightSource, self.model_path,
                                                          self.model_id)
        source = self._weight_source
        progress: dict[str, TransferProgress] = {}
        before = self.status

        def show(p: TransferProgress) -> None:
            progress[p.node] = p
            self.status = "transferring weights: " + ", ".join(
                f"{q.node} {q.bytes_sent / 1e6:.0f}/{q.bytes_to_send / 1e6:.0f} MB"
                for q in progress.values())

        async def one(m: Member, stage: Stage) -> str:
            try:
                result = await ensure_weights(m.agent, source, stage.layer_start,
                                              stage.layer_end, show, self.weight_counters,
                                              label=m.name)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    m.weights_error = e.details()
                    log.error("node %s cannot take %s: %s", m.name, self.model_id, e.details())
                raise
            return result.local_path

        self.status = (f"transferring weights of {self.model_id} to "
                       f"{', '.join(m.name for m, _ in remote)}")
        # Every transfer runs to its end before a failure is raised: a retry must not race a
        # transfer still writing into the same node folder.
        results = await asyncio.gather(*(one(m, s) for m, s in remote), return_exceptions=True)
        self.status = before
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return {m.name: path for (m, _), path in zip(remote, results)}

    async def add_remote(self, address: str, node_id: str) -> Member | None:
        """Admits node `node_id`'s agent at `address` (over TLS it must hold a certificate for
        that id, and both sides prove the cluster secret) and adds it to the plan at once: a
        re-plan is a safe point, since in-flight requests resume on the new plan. A node that
        returns takes its old place, but only once that place is free: a live member (one that
        still answers on its own admitted channel) is never displaced. Returns None if it was
        refused."""
        # One admission at a time: two paths to the same node (Bonjour and a registration, or
        # a relay's) must not both admit it, the later replacing the earlier's session.
        async with self._admitting:
            holder = await self._live_holder(address, node_id)
            if holder is not None:
                if (holder.name, holder.agent.address) == (node_id, address):
                    return holder
                log.warning("refused node %s at %s: %s at %s is a live member, and a newcomer "
                            "cannot take its place", node_id, address, holder.name,
                            holder.agent.address)
                return None
            agent = AgentClient(address, node_id, self.options.secret)
            try:
                hello = await agent.admit()
            except (AdmissionError, grpc.aio.AioRpcError) as e:
                reason = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
                log.warning("refused node %s at %s: %s", node_id, address, reason)
                await agent.close()
                return None
            member = next((m for m in self.members if m.name == node_id), None)
            if member is None:
                member = Member(node_id, agent, None)
                self.members.append(member)
            else:
                await member.agent.close()
                member.agent = agent
            member.alive, member.last_seen, member.layers = True, time.monotonic(), None
        member.weights_error = ""
        member.rdma_ports = list(hello.rdma_ports)
        # It may come back with RDMA enabled or recabled: let jaccl be tried again.
        self._jaccl_failed = {k: v for k, v in self._jaccl_failed.items()
                              if member.name not in k}
        budget = max(0, hello.memory_bytes - self.options.os_reserve_bytes)
        member.budget_bytes, member.speed, member.chip = budget, hello.speed or 1.0, hello.chip
        log.info("node %s (%s, %s, %.1f GiB usable) joined", node_id, address, hello.chip,
                 budget / 2**30)
        await self.recover(f"node {node_id} joined", always=True)
        return member

    async def _live_holder(self, address: str, node_id: str) -> Member | None:
        """The live member with this id or at this address, if it still answers on its own
        admitted channel (the heartbeat may not have noticed yet that a restarted node's old
        process is gone)."""
        for m in self.members:
            if m.alive and (m.name == node_id or m.agent.address == address):
                try:
                    m.health = await m.agent.health(timeout=HEARTBEAT_SECONDS * 2)
                except grpc.aio.AioRpcError:
                    continue
                m.last_seen = time.monotonic()
                return m
        return None

    async def _monitor(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_SECONDS)
            if await self._check_members():
                await self.recover("a node or shard worker of the plan stopped answering")

    async def _check_members(self) -> bool:
        """Heartbeats every member; returns whether the active plan lost a stage."""
        broken = False
        now = time.monotonic()

        async def beat(m: Member) -> None:
            nonlocal broken
            if not m.alive:
                return
            exited = m.process is not None and not m.process.alive()
            try:
                if exited:
                    raise ConnectionError("the agent process exited")
                m.health = await m.agent.health(timeout=HEARTBEAT_SECONDS * 2)
                m.last_seen = now
                # While a plan loads, every worker is being replaced: not a failure.
                if m.layers is not None and not m.health.ready and not self._replanning.locked():
                    log.warning("node %s: its shard worker is gone (%s)", m.name,
                                m.health.status)
                    broken = True
            except (grpc.aio.AioRpcError, ConnectionError) as e:
                if exited or now - m.last_seen > NODE_LOST_SECONDS:
                    log.warning("node %s (%s) lost: %s", m.name, m.agent.address, e)
                    m.alive, m.health = False, None
                    broken = broken or m.layers is not None

        await asyncio.gather(*(beat(m) for m in self.members))
        return broken

    async def recover(self, reason: str, always: bool = False, plan: Plan | None = None) -> None:
        """Loads a new plan over the members alive (once, however many ask, unless `always`:
        a node that joined must be planned in even right after another re-plan); `plan`: that
        one instead, unless one of its nodes is gone or its load fails."""
        epoch = self.epoch
        async with self._replanning:
            if self.epoch != epoch and self.ready and not always:
                return  # someone else recovered already
            if self.ready:
                await self._prefetch_weights(plan)
            self.ready = False
            self._ready_event.clear()
            self.status = f"recovering: {reason}"
            log.warning("re-planning %s: %s", self.model_id, reason)
            t0, started_at = time.monotonic(), time.time()
            while True:
                try:
                    await self._load_plan(plan)
                    break
                except NoCapacity as e:
                    log.error("cannot serve %s: %s", self.model_id, e)
                    return  # new and in-flight requests get 503 until a node joins
                except (grpc.aio.AioRpcError, OSError) as e:
                    log.warning("re-plan failed, retrying: %s", e)
                    plan = None  # what failed may be a node of that plan: plan afresh
                    await asyncio.sleep(1.0)
                    await self._check_members()
            self.last_recovery = {"reason": reason, "seconds": time.monotonic() - t0,
                                  "started_at": started_at, "epoch": self.epoch,
                                  "load_seconds": self.load_seconds}
            log.info("recovered in %.2fs", self.last_recovery["seconds"])

    async def apply_plan(self, plan: Plan, budgets: dict[str, int], reason: str) -> bool:
        """Moves to `plan` (the rebalancer's) through the re-plan path: weights first while
        the current plan serves, then the switch, in-flight requests resuming on it. `budgets`
        (lowered for a node short of memory) stay for later plans; whether `plan` serves."""
        for m in self.members:
            m.budget_bytes = budgets.get(m.name, m.budget_bytes)
        await self.recover(reason, always=True, plan=plan)
        return self.plan is not None and self.plan.plan_hash == plan.plan_hash

    def _staged(self, plan: Plan | None) -> tuple[list[Member], Plan | None]:
        """The members that run `plan` in rank order, and the plan; a new plan over the live
        members when none is given or one of its nodes cannot serve."""
        by_name = {m.name: m for m in self.servable()}
        if plan is None or any(s.node not in by_name for s in plan.stages):
            live, plan = self._next_plan()
            by_name = {m.name: m for m in live}
        return ([by_name[s.node] for s in plan.stages] if plan else []), plan

    async def _prefetch_weights(self, plan: Plan | None = None) -> None:
        """While the current plan still serves (a node joined, a rebalance), sends the next
        plan's remote stages their weights: clients then wait only for the load, not for the
        transfer. A failure here is only logged: _load_plan transfers (and reports) again."""
        members, plan = self._staged(plan)
        if plan is None:
            return
        try:
            await self._transfer_weights(members, plan)
        except (grpc.aio.AioRpcError, OSError) as e:
            log.warning("weights for the next plan: %s", e)

    async def wait_ready(self, timeout: float) -> None:
        """Returns once a plan serves; raises NoCapacity at once when nothing can serve, or
        TimeoutError."""
        if self.capacity_error and not self.ready:
            raise NoCapacity(self.capacity_error)
        await asyncio.wait_for(self._ready_event.wait(), timeout)

    async def stop(self) -> None:
        self.ready = False
        if self._monitor_task is not None:
            self._monitor_task.cancel()
        if self._discovery is not None:
            await self._discovery.stop()
        for m in self.members:
            await m.agent.close()
        if self.node is not None:
            await self.node.close()
        await asyncio.gather(*(asyncio.to_thread(m.process.stop) for m in self.members
                               if m.process is not None))


def _error_line(details: str) -> str:
    """The line that says what went wrong in a failed LoadShard's details (which end with the
    worker's log): its last "error:" line, else its last line."""
    lines = [line.strip() for line in details.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or [details])[-1].removeprefix("error:").strip()
