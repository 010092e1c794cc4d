"""The nodes of a cluster, as the coordinator tracks them.

`serve` starts its node agents as child processes on this machine (`--nodes N`, one by default)
and drives them over real gRPC on loopback, the path a multi-Mac cluster uses; a coordinator
admits the nodes that join over the network. Every model the cluster serves plans over these
members (omlx_coordinator/models/deployment.py): local agents read the coordinator's model folders, and
a node that joined over the network first receives the tensors of its range
(omlx_coordinator/nodes/weight_transfer.py) unless it holds them already.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from omlx_coordinator.nodes.known_nodes import FILE_NAME, REJOIN_SECONDS, KnownNodes
from omlx_coordinator.nodes.link_freshness import (
    DEFAULT_MAX_AGE_SECONDS,
    FreshnessPolicy,
    LinkAge,
)
from omlx_coordinator.nodes.link_survey import keep_fresh, survey
from omlx_coordinator.nodes.membership import DiscoveryBridge
from omlx_coordinator.nodes.node_client import AdmissionError, AgentClient
from omlx_coordinator.nodes.status_log import LoggedStatus
from omlx_coordinator.planning.disk_layers import DEFAULT_DISK_GBPS
from omlx_coordinator.planning.links import MeasuredLinks, link_key
from omlx_shared import auth
from omlx_shared.child import ChildProcess, omlx_command
from omlx_shared.hardware import machine_memory
from omlx_shared.link_probe import LinkMeasurement
from omlx_shared.model_store import data_home
from omlx_shared.outsider_logs import Refusals, cut
from proto import omlx_pb2 as pb

log = logging.getLogger(__name__)

NODE_START_TIMEOUT_SECONDS = 120.0
HEARTBEAT_SECONDS = 0.5
NODE_LOST_SECONDS = 3.0  # a node that has not answered for this long is gone
# ... of the coordinator's own time: while its event loop was stalled (CPU-bound work on it, or
# the whole machine starved, as under a heavy load) it could not hear a node, and a node that
# answers late after that stall is not lost for it. Up to this much of such stalls is taken off
# a node's silence: a node is lost within NODE_LOST_SECONDS + STALL_BUDGET_SECONDS of wall time
# however busy the coordinator is.
STALL_BUDGET_SECONDS = 10.0
STALL_PROBE_SECONDS = 0.2  # how often the loop's lateness is measured
STALL_MIN_SECONDS = 0.25  # lateness below this is scheduling noise, not a stall
# A lost node answering again is a member again once it has answered every heartbeat this long:
# one that is only intermittently responsive (a machine throttled or swapping) would otherwise
# be planned in and out, each time a pause for every stream, and planned in by its calibrated
# speed, not the slowness it was lost for.
NODE_BACK_SECONDS = 30.0
# A member's client replaced when the node is admitted again stays open this long: a recovery
# that read it before (a plan's members are read before their loads) then fails as a call to a
# lost node does, and retries, instead of raising on a closed channel.
REPLACED_CLIENT_SECONDS = 60.0


@dataclass
class ClusterOptions:
    nodes: int = 1
    micro_batches: int = 0  # 0: one per stage
    parallel: str = "pipeline"  # a model's layout, one of omlx_shared/parallel_modes.py's PARALLEL
    backend: str = "auto"  # the data plane: "auto", "ring" or "jaccl" (omlx_coordinator/nodes/backend.py)
    secret: str | None = None  # the cluster secret; serve makes one up for its own nodes
    os_reserve_bytes: int = 8 << 30  # memory every remote node keeps for its OS and apps
    local_reserve_bytes: int = 4 << 30  # what serve's machine keeps besides its local nodes
    context_tokens: int = 4096  # KV a plan reserves per sequence...
    max_sequences: int = 8  # ... for this many sequences at once
    discovery: bool = False  # admit nodes Bonjour announces (coordinator mode)
    link_probe: bool = True  # measure a joining node's links (link_survey.py)
    # ... and again while the cluster is quiet, once a reading is this old (0: never).
    link_max_age_s: float = DEFAULT_MAX_AGE_SECONDS
    discovery_interfaces: list[str] | None = None
    node_args: tuple[str, ...] = ()  # for every node agent
    # Local node i's shard worker exports /metrics on this port + i (0: each on any free one).
    node_metrics_port: int = 0
    node_memory_bytes: int = 0  # what each local node may hold (0: this machine's share)
    worker_cache_bytes: int = 0  # each local node's workers' RAM prefix cache (their flag's)
    weights_cap_bytes: int = 0  # each local node's --weights-memory (0: none)
    # A plan whose head worker sent nothing this long while it had requests is wedged (a
    # pipeline whose stages cannot reach each other, their agents still answering).
    stall_seconds: float = 600.0


@dataclass
class Member:
    """A node agent of this cluster, as the coordinator tracks it."""

    name: str
    agent: AgentClient
    process: ChildProcess | None  # set when this coordinator started the agent itself
    budget_bytes: int = 0  # memory the plan may use on it
    cache_bytes: int = 0  # what each of its shard workers keeps for its RAM prefix cache
    weights_cap: int = 0  # its --weights-memory: weights past it stream from its SSD (0: none)
    disk_gbps: float = 0.0  # its disk's measured read speed (0: not measured)
    speed: float = 1.0  # GB/s of weights it streams (1.0: not measured)
    layer_ms: float = 0.0  # a layer's fixed cost a decode step (0.0: not measured)
    dequantizes: bool = False  # its workers run on a CPU, which dequantizes (its handshake)
    chip: str = ""
    alive: bool = True
    # Admitted, its links still being measured (add_remote): no plan may use it yet, and a
    # restarted coordinator does not count it back. A plan loading on it meanwhile raced the
    # probes for its data port: the load's pipeline never linked (60 s lost, then a re-plan).
    joining: bool = False
    last_seen: float = 0.0
    answering_since: float | None = None  # lost, but answering every heartbeat since then
    lost_before: bool = False  # lost at least once: it may come back holding a stale plan
    health: pb.HealthReply | None = None
    # Its Thunderbolt ports with RDMA, from its handshake (none off macOS).
    rdma_ports: list[pb.RdmaPort] = field(default_factory=list)
    # Why the node cannot take this model's weights (no disk space): plans leave it out until
    # it joins again.
    weights_error: str = ""
    admissions: int = 0  # times it was admitted over the network, each a new session
    # Its links to the other members, measured when it or they joined (link_survey.py), and
    # again once old while the cluster is quiet (link_freshness.py): a measurement, or why
    # there is none; and when each was taken.
    links: dict[str, LinkMeasurement | str] = field(default_factory=dict)
    link_ages: dict[str, LinkAge] = field(default_factory=dict)
    control_rtt_ms: float = 0.0  # the coordinator's Health round trip to it (0: not measured)

    @property
    def disk_speed(self) -> float:
        """GB/s its streamed layers are counted at: as measured, else a typical SSD's."""
        return self.disk_gbps or DEFAULT_DISK_GBPS


class NoCapacity(RuntimeError):
    """A model fits on none of the nodes left; the message says how much is missing."""


class Cluster:
    """The node agents of this cluster (the local ones `serve` starts, or those that joined),
    shared by every model it serves.

    It watches its members (a health call every HEARTBEAT_SECONDS) and tells `on_lost` which
    ones stopped answering, and `on_joined` of a node that joined: the models' deployments
    (omlx_coordinator/models/lifecycle.py) then re-plan."""

    status = LoggedStatus(lambda c: "cluster")

    def __init__(self, options: ClusterOptions | None = None):
        self.options = options or ClusterOptions()
        self.members: list[Member] = []
        self.ready = False  # the local nodes started (a coordinator alone: at once)
        self.status = "starting"
        self.on_lost: Callable[[set[str]], Awaitable[None]] | None = None
        self.on_joined: Callable[[Member], Awaitable[None]] | None = None
        # Whether anything uses the nodes now (a request in flight, a load): links are
        # measured again only while it says no for a while. None: never measured again.
        self.busy: Callable[[], bool] | None = None
        self._freshness_task: asyncio.Task | None = None
        # on_joined calls under way, replaced clients to close
        self._reactions: set[asyncio.Task] = set()
        self._monitor_task: asyncio.Task | None = None
        self._discovery = None
        self._admitting = asyncio.Lock()  # add_remote
        self._surveying = asyncio.Lock()  # one node's links measured at a time
        # Anyone on the LAN can announce a node over Bonjour and have its admission refused.
        self.refusals = Refusals(log)
        # A coordinator (no local nodes) remembers its members; after a restart the first plan
        # waits for them (gathered).
        self.known = KnownNodes(data_home() / FILE_NAME) if self.options.nodes == 0 else None
        self.expected: set[str] = set()  # members before the restart, not back yet
        # The links measured between them before the restart, each kept for its pair's first
        # survey after it, where a probe finds none (known_nodes.py).
        self.kept_links: dict[frozenset[str], LinkMeasurement] = {}
        # The event loop's stalls (when each ended, how long), the last STALL_BUDGET_SECONDS
        # and NODE_LOST_SECONDS of them: what a node's silence is excused.
        self._stalls: deque[tuple[float, float]] = deque()
        self._started_at = time.monotonic()

    def local_budget(self) -> int:
        """Local nodes share this machine's memory (less --os-reserve for everything else),
        unless --node-memory says how much each may use."""
        if self.options.node_memory_bytes:
            return self.options.node_memory_bytes
        return (max(0, machine_memory() - self.options.local_reserve_bytes)
                // max(1, self.options.nodes))

    def budget(self, name: str) -> int:
        """What the plans of every model together may hold on node `name` (one not started
        yet: a local node's share of this machine)."""
        member = next((m for m in self.members if m.name == name), None)
        return member.budget_bytes if member else self.local_budget()

    @property
    def nodes(self) -> list[dict]:
        """What /health and /cluster/status show of each member."""
        out = []
        for m in self.members:
            h = m.health
            out.append({
                "id": m.name, "address": m.agent.address, "alive": m.alive,
                "healthy": bool(m.alive and h),
                "agent_pid": h.pid if h else (m.process.pid if m.process else None),
                "version": h.version if h else None,
                "memory_budget": m.budget_bytes, "worker_cache_bytes": m.cache_bytes,
                "chip": m.chip, "speed_gbps": m.speed, "layer_ms": m.layer_ms,
                "memory_total": (h.memory_total_bytes or None) if h else None,
                "memory_available": (h.memory_available_bytes or None) if h else None,
                "memory_pressure": (h.memory_pressure or None) if h else None,
                "weights_error": m.weights_error or None,
                "rdma_devices": [p.device for p in m.rdma_ports],
                # Measured at join, again once old (link_survey.py); the planner counts the
                # data-plane ones.
                "links": {peer: _link_status(link, m.link_ages.get(peer))
                          for peer, link in m.links.items()},
                "coordinator_rtt_ms": m.control_rtt_ms or None,
                # Each model's shard worker on it: where Prometheus scrapes it
                # (/cluster/prometheus-targets), and its real memory.
                "workers": [{
                    "model": w.model_id, "ready": w.ready, "pid": w.pid or None,
                    "layers": [w.layer_start, w.layer_end], "rank": w.rank,
                    "metrics": (f"{m.agent.address.rsplit(':', 1)[0]}:{w.metrics_port}"
                                if w.metrics_port else None),
                    "footprint_bytes": w.footprint_bytes,
                    "mlx_active_bytes": w.mlx_active_bytes} for w in h.workers] if h else [],
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
        """Starts the local node agents and admits them (a coordinator alone: waits for nodes
        to join); the models load afterwards."""
        self._started_at = time.monotonic()
        if self.known is not None:  # a coordinator alone: nodes join over the network
            self.expected, self.kept_links = self.known.load(), self.known.load_links()
            self.status = ("waiting for nodes: run `omlx-cluster join` on a Mac with this "
                           "cluster's secret")
            log.info("waiting for nodes to join (Bonjour discovery %s)",
                     "on" if self.options.discovery else "off")
            self._monitor_task = asyncio.create_task(self._monitor())
            self._keep_links_fresh()
            if self.options.discovery:
                self._discovery = DiscoveryBridge(self.add_remote,
                                                  self.options.discovery_interfaces)
                await self._discovery.start()
            self.ready = True
            return
        try:
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
                m.cache_bytes, m.weights_cap = hello.worker_cache_bytes, hello.weights_cap_bytes
                m.disk_gbps, m.dequantizes = hello.disk_gbps, hello.dequantizes
                m.health = await m.agent.health()
            self._monitor_task = asyncio.create_task(self._monitor())
            self._keep_links_fresh()
            self.ready, self.status = True, "ready"
        except Exception as e:
            reason = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
            self.status = f"failed: {reason}"
            log.error("could not start the nodes: %s", reason)
            raise

    def servable(self) -> list[Member]:
        """The live members a plan may use, in ring order."""
        return [m for m in self.members if m.alive and not m.joining and not m.weights_error]

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
                            "cannot take its place", cut(node_id), cut(address), holder.name,
                            holder.agent.address)
                return None
            agent = AgentClient(address, node_id, self.options.secret)
            try:
                hello = await agent.admit()
            except (AdmissionError, grpc.aio.AioRpcError) as e:
                reason = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
                self.refusals.warning(address.rpartition(":")[0], "admission",
                                      "refused node %s at %s: %s", cut(node_id), cut(address),
                                      cut(reason))
                await agent.close()
                return None
            member = next((m for m in self.members if m.name == node_id), None)
            if member is None:
                member = Member(node_id, agent, None)
                self.members.append(member)
            else:
                self._react(_close_later(member.agent))
                member.agent = agent
            member.alive, member.last_seen, member.joining = True, time.monotonic(), True
        try:
            await self._welcome(member, agent, hello)
        finally:
            member.joining = False
        log.info("node %s (%s, %s, %.1f GiB usable) joined", node_id, address, hello.chip,
                 member.budget_bytes / 2**30)
        self._remember_members()
        if self.on_joined is not None:
            await self.on_joined(member)
        return member

    async def _welcome(self, member: Member, agent: AgentClient, hello: pb.HandshakeReply) -> None:
        """Records what `member`, admitted just now, said of itself, and measures its links."""
        member.weights_error = ""
        member.rdma_ports = list(hello.rdma_ports)
        # It may come back with RDMA enabled or recabled: jaccl is tried again (JacclFailures).
        member.admissions += 1
        budget = max(0, hello.memory_bytes - self.options.os_reserve_bytes)
        member.budget_bytes, member.speed, member.chip = budget, hello.speed or 1.0, hello.chip
        member.cache_bytes, member.weights_cap = hello.worker_cache_bytes, hello.weights_cap_bytes
        member.disk_gbps, member.dequantizes = hello.disk_gbps, hello.dequantizes
        member.layer_ms = hello.layer_ms
        try:
            member.health = await agent.health()
        except grpc.aio.AioRpcError as e:
            log.warning("node %s: no health after admission: %s", member.name, e.details())
        await self._survey(member)

    async def _survey(self, member: Member) -> None:
        """Measures the links of `member`, admitted just now, before any plan counts it."""
        for m in self.members:  # what it measured before it left may no longer hold
            m.links.pop(member.name, None)
            m.link_ages.pop(member.name, None)
        member.links, member.link_ages = {}, {}
        if not self.options.link_probe:
            return
        async with self._surveying:
            others = [m for m in self.members if m.alive and m is not member]
            await survey(member, others)
        for other in others:
            before = self.kept_links.pop(link_key(member.name, other.name), None)
            if before is not None and not isinstance(member.links.get(other.name),
                                                     LinkMeasurement):
                member.links[other.name] = other.links[member.name] = before
                log.info("link %s <-> %s: the reading from before the restart kept "
                         "(%.2f GB/s, %.0f us)", member.name, other.name, before.gb_per_s,
                         before.latency_us)

    def _keep_links_fresh(self) -> None:
        policy = FreshnessPolicy(self.options.link_max_age_s if self.options.link_probe else 0)
        if policy.enabled and self.busy is not None:
            self._freshness_task = asyncio.create_task(
                keep_fresh(self.servable, self.busy, self._surveying, policy))

    def measured_links(self) -> MeasuredLinks:
        """Every link measured between members, for the planner."""
        return {link_key(m.name, peer): link for m in self.members
                for peer, link in m.links.items() if isinstance(link, LinkMeasurement)}

    def _remember_members(self) -> None:
        if self.known is not None:
            back = {m.name for m in self.members if m.alive and not m.joining}
            self.expected -= back
            self.known.save(back, self.measured_links())

    async def gathered(self) -> None:
        """Returns once the members this coordinator had before its restart are back, or
        REJOIN_SECONDS after its start without the missing ones."""
        while self.expected and time.monotonic() - self._started_at < REJOIN_SECONDS:
            await asyncio.sleep(HEARTBEAT_SECONDS / 2)
        if self.expected:
            log.warning("planning without node(s) %s: members before the restart, not back "
                        "within %.0f s", ", ".join(sorted(self.expected)), REJOIN_SECONDS)
            self.expected = set()

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
        """Heartbeats; on_lost checks every plan at each (it starts a recovery without waiting
        for it)."""
        stalls = asyncio.create_task(self._watch_stalls())
        try:
            while True:
                await asyncio.sleep(HEARTBEAT_SECONDS)
                lost = await self.check_members()
                if self.on_lost is not None:
                    await self.on_lost(lost)
        finally:
            stalls.cancel()

    async def _watch_stalls(self) -> None:
        """Records how late a short sleep wakes: the time the loop could run nothing."""
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(STALL_PROBE_SECONDS)
            now = time.monotonic()
            late = now - t0 - STALL_PROBE_SECONDS
            if late >= STALL_MIN_SECONDS:
                self._stalls.append((now, late))
            while self._stalls and now - self._stalls[0][0] > (NODE_LOST_SECONDS
                                                               + STALL_BUDGET_SECONDS):
                self._stalls.popleft()

    def _silence(self, m: Member, now: float) -> float:
        """How long `m` has not answered, less the coordinator's own stalls since (bounded)."""
        stalled = sum(late for at, late in self._stalls if at > m.last_seen)
        return now - m.last_seen - min(stalled, STALL_BUDGET_SECONDS)

    def _react(self, call: Awaitable[None]) -> None:
        task = asyncio.ensure_future(call)
        self._reactions.add(task)
        task.add_done_callback(self._reactions.discard)

    async def check_members(self) -> set[str]:
        """Heartbeats every member; returns the names of those found lost just now. A node
        found lost whose agent answers again on its admitted channel (it was stalled, not
        restarted: a restarted agent knows no session of ours) is a member again, and goes to
        on_joined in a task of its own: a re-plan takes seconds (minutes, when it waits for
        weights), and the next failure, of another model's nodes too, must still be noticed
        meanwhile."""
        lost: set[str] = set()
        back: set[str] = set()
        now = time.monotonic()

        async def beat(m: Member) -> None:
            if not m.alive:
                if m.process is None or m.process.alive():
                    try:
                        m.health = await m.agent.health(timeout=HEARTBEAT_SECONDS * 2)
                    except grpc.aio.AioRpcError:
                        m.answering_since = None
                        return
                    m.answering_since = m.answering_since or now
                    if now - m.answering_since >= NODE_BACK_SECONDS:
                        log.warning("node %s (%s) answers again", m.name, m.agent.address)
                        m.alive, m.last_seen, m.answering_since = True, now, None
                        back.add(m.name)
                        if self.on_joined is not None:
                            self._react(self.on_joined(m))
                return
            exited = m.process is not None and not m.process.alive()
            try:
                if exited:
                    raise ConnectionError("the agent process exited")
                m.health = await m.agent.health(timeout=HEARTBEAT_SECONDS * 2)
                m.last_seen = now
            except (grpc.aio.AioRpcError, ConnectionError) as e:
                if exited or self._silence(m, time.monotonic()) > NODE_LOST_SECONDS:
                    log.warning("node %s (%s) lost: %s", m.name, m.agent.address, e)
                    m.alive, m.health, m.lost_before = False, None, True
                    lost.add(m.name)

        await asyncio.gather(*(beat(m) for m in self.members))
        if lost or back:
            self._remember_members()
        return lost

    async def stop(self) -> None:
        self.ready = False
        for task in (self._monitor_task, self._freshness_task):
            if task is not None:
                task.cancel()
        for task in list(self._reactions):
            task.cancel()
        if self._discovery is not None:
            await self._discovery.stop()
        for m in self.members:
            await m.agent.close()
        await asyncio.gather(*(asyncio.to_thread(m.process.stop) for m in self.members
                               if m.process is not None))


def _link_status(link: LinkMeasurement | str, age: LinkAge | None) -> dict:
    """A link as /cluster/status shows it: its reading (or why there is none) and when the
    reading was taken (Unix time), the same on both of its members."""
    out = link.to_dict() if isinstance(link, LinkMeasurement) else {"error": link}
    if age is not None and age.measured_unix is not None:
        out["measured_at"] = round(age.measured_unix, 3)
    return out


async def _close_later(agent: AgentClient) -> None:
    try:
        await asyncio.sleep(REPLACED_CLIENT_SECONDS)
    finally:
        await agent.close()
