"""One replica of one model: a plan over some of the cluster's nodes, its workers, its epochs.

A model runs as one deployment (one node, or a pipeline) or as several replicas, each on nodes
of its own (omlx_coordinator/models/placement.py decides). A deployment plans within what the other
models leave free on each node, asks every stage's agent at once to load its range (the
data-plane group forms only when all ranks join) and sends sequences to its head worker. When a
node or worker of its plan dies it re-plans over the nodes left, and `wait_ready` lets in-flight
requests resume on the new plan; an unload stops its workers and frees their memory.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc

from omlx_coordinator.models.placement import plan_bytes
from omlx_coordinator.models.routing import PrefixIndex
from omlx_coordinator.models.served_model import ServedModel
from omlx_coordinator.nodes.backend import (
    BackendChoice,
    BackendError,
    JacclFailures,
    choose_backend,
)
from omlx_coordinator.nodes.cluster import HEARTBEAT_SECONDS, Cluster, Member, NoCapacity
from omlx_coordinator.nodes.node_client import WorkerClient
from omlx_coordinator.nodes.status_log import LoggedStatus
from omlx_coordinator.nodes.weight_transfer import (
    TransferProgress,
    WeightCounters,
    WeightSource,
    ensure_weights,
)
from omlx_coordinator.planning.layout_choice import plan_layout
from omlx_coordinator.planning.links import with_links
from omlx_coordinator.planning.measured_speeds import MeasuredSpeeds
from omlx_coordinator.planning.planner import NodeSpec, Plan, PlanError, Stage
from omlx_coordinator.planning.tensor_plan import rank_heads
from omlx_shared.hardware import mlx_on_cpu
from proto import omlx_pb2 as pb

log = logging.getLogger(__name__)

UNLOAD_GRACE_SECONDS = 10.0  # SIGTERM to SIGKILL: a worker flushes its prefix cache first
RETRY_MAX_SECONDS = 30.0  # a re-plan that keeps failing tries again at most this far apart
ABANDONED_LOAD_SECONDS = 10.0  # the most a re-plan waits for agents to drop an abandoned load
# After a move, the old plan serves the requests that were on it this long at most (the rest
# then resume on the new plan) ...
MOVE_DRAIN_SECONDS = 60.0
# ... and each agent keeps the old worker this long at most unless unloaded sooner: a bound
# for a coordinator that dies meanwhile, past the drain and the unloads that follow it.
KEEP_SERVING_SECONDS = MOVE_DRAIN_SECONDS + 60.0
DRAIN_POLL_SECONDS = 0.1


@dataclass
class Retired:
    """A plan a move replaced, serving the requests that were on it to their end."""

    node: WorkerClient  # its head worker
    workers: dict[str, int]  # its worker's pid on each of its nodes
    plan: Plan | None  # (None: unknown)


@dataclass(frozen=True)
class Folders:
    """Where the remote nodes of a plan load from (local ones read the coordinator's folders)."""

    model: dict[str, str]  # each remote node's folder of the model, by node name
    head_draft: str = ""  # a remote head's folder of the draft model ("": PATH as configured)


class Holder(Protocol):
    """What holds memory on nodes: a deployment of a model."""

    def held_bytes(self) -> dict[str, int]: ...


class Deployment:
    status = LoggedStatus(lambda d: d.name)

    def __init__(self, cluster: Cluster, model: ServedModel, replica: int = 0,
                 plan: Plan | None = None, *, holders: Sequence[Holder],
                 plan_loads: asyncio.Lock, jaccl_failures: JacclFailures,
                 weight_counters: WeightCounters):
        """`holders` (every deployment of the cluster: what the others leave free on a node),
        `plan_loads`, `jaccl_failures`, `weight_counters`: the model manager's, shared by
        every deployment of the cluster."""
        self.cluster, self.model, self.replica = cluster, model, replica
        self.holders = holders
        self.plan_loads, self.jaccl_failures = plan_loads, jaccl_failures
        self.weight_counters = weight_counters
        self.name = model.name if replica == 0 else f"{model.name}#{replica}"
        self.node: WorkerClient | None = None  # the head worker of the active plan
        self.worker_pids: dict[str, int] = {}  # the active plan's worker on each of its nodes
        self._retiring: asyncio.Task | None = None  # the last move's `_retire`
        self.retiring: Plan | None = None  # the plan it retires, its memory still held
        self.plan: Plan | None = None
        self.placed = plan  # the plan placement chose, loaded first
        self.epoch = 0  # plans loaded so far
        self.ready = False
        self.status = "unloaded"
        self.capacity_error = ""
        self.last_recovery: dict | None = None
        self.load_seconds = 0.0  # the slowest stage's weight load in the last plan
        # Why the last plan loaded (a pb.LoadReason), and the highest nice value a stage's
        # load ran at (omlx_node/load_priority.py).
        self.load_reason, self.load_nice = pb.LOAD_REASON_UNSPECIFIED, 0
        self.backend: BackendChoice | None = None  # the data plane of the active plan
        self.inflight = 0  # requests on it now: what routing balances
        self.requests = 0  # attempts it has run (a resumed request counts again)
        self.prefixes = PrefixIndex()  # block hashes of what it served: cache-aware routing
        self.unloaded = False  # stopped on purpose: never re-planned
        self.caps: dict[str, int] = {}  # bytes per node it may hold at most (shed by rebalancing)
        self.measured = MeasuredSpeeds()  # the rebalancer's record (mode auto), its plans' input
        self._recovery: asyncio.Task | None = None  # recover_soon's
        self.siblings: list[Deployment] = []  # the model's other replicas (disjoint nodes)
        self._ready_event = asyncio.Event()
        self._replanning = asyncio.Lock()

    # ---- where it may run -------------------------------------------------------------------

    def stages_on(self) -> dict[str, tuple[int, int]]:
        """The layer range of the active plan on each of its nodes."""
        if self.plan is None:
            return {}
        return {s.node: (s.layer_start, s.layer_end) for s in self.plan.stages}

    def layout_status(self) -> dict:
        """The active plan's layout, as status shows it: "tensor x2 over ring", and a
        tensor-parallel stage's ranks with the heads each holds."""
        plan = self.plan
        if plan is None:
            return {"parallel": None, "ranks": []}
        over = (f" over {self.backend.backend}" if self.backend and len(plan.stages) > 1
                else "")
        return {"parallel": plan.layout_name + over,
                "ranks": rank_heads(plan, self.model.layout)}

    @property
    def holding(self) -> Plan | None:
        """The plan whose memory it holds: the active one, else the one it is loading."""
        return self.plan or self.placed

    def held_bytes(self) -> dict[str, int]:
        """What its plan holds on each node (weights and KV, as the planner counts them), and
        the plan a move replaced while that one serves its last requests."""
        held = plan_bytes(self.holding) if self.holding else {}
        for node, n in (plan_bytes(self.retiring) if self.retiring else {}).items():
            held[node] = held.get(node, 0) + n
        return held

    def usable(self) -> list[Member]:
        """The live members it may plan over: not those of its sibling replicas."""
        taken = {n for d in self.siblings for n in d.held_bytes()}
        return [m for m in self.cluster.servable() if m.name not in taken]

    def room(self, node: str) -> int:
        """What its plans may hold on `node`: what the other deployments (the other models,
        the other replicas) leave free of its budget there, and no more than the rebalancer
        shed it to where the node ran short of memory."""
        held = sum(h.held_bytes().get(node, 0) for h in self.holders if h is not self)
        return min(max(0, self.cluster.budget(node) - held), self.caps.get(node, 1 << 62))

    def speed(self, member: Member) -> float:
        """The GB/s its plans count `member` at: as measured, else as calibrated."""
        return self.measured.speed(member.name, member.speed)

    def make_plan(self, members: list[Member] | None = None) -> Plan:
        """Plans over `members` (default: the local nodes `serve` is about to start), each
        within what the other deployments leave free on it."""
        if members is None:
            # Its local nodes run on this machine.
            nodes = [NodeSpec(f"local{i}", self.cluster.local_budget(),
                              cache_bytes=self.cluster.options.worker_cache_bytes,
                              weights_cap=self.cluster.options.weights_cap_bytes,
                              dequantizes=mlx_on_cpu())
                     for i in range(self.cluster.options.nodes)]
        else:
            nodes = with_links([NodeSpec(m.name, self.room(m.name), self.speed(m),
                                         cache_bytes=m.cache_bytes, weights_cap=m.weights_cap,
                                         disk_gbps=m.disk_speed, dequantizes=m.dequantizes,
                                         layer_ms=m.layer_ms)
                                for m in members],
                               self.cluster.measured_links())
        split = self.model.config.split
        options = self.cluster.options
        return plan_layout(self.model.layout, nodes,
                           self.model.config.parallel or options.parallel, os_reserve_bytes=0,
                           context_tokens=options.context_tokens,
                           max_sequences=options.max_sequences,
                           split=split if split and len(split) == len(nodes) else None)

    def _next_plan(self) -> tuple[list[Member], Plan | None]:
        """The members that may serve, and a plan over them (None: none fits)."""
        live = self.usable()
        try:
            return live, self.make_plan(live) if live else None
        except PlanError as e:
            self.capacity_error = str(e)
            return live, None

    def _staged(self, plan: Plan | None) -> tuple[list[Member], Plan | None]:
        """The members that run `plan` in rank order, and the plan; a new plan over the usable
        members when none is given, one of its nodes cannot serve, or a stage no longer fits
        its node (a plan made before another model loaded there: a rebalance, a placement)."""
        by_name = {m.name: m for m in self.usable()}
        if plan is None or any(s.node not in by_name or s.memory_bytes > self.room(s.node)
                               for s in plan.stages):
            live, plan = self._next_plan()
            by_name = {m.name: m for m in live}
        return ([by_name[s.node] for s in plan.stages] if plan else []), plan

    # ---- loading ----------------------------------------------------------------------------

    async def load(self, reason: int = pb.LOAD_REQUESTED) -> None:
        """Loads its placed plan (or a new one) for `reason` (a pb.LoadReason: whether
        requests wait for it); raises NoCapacity, or the failed load's error."""
        self.unloaded = False
        await self._load_plan(self.placed, reason)

    async def _load_plan(self, plan: Plan | None, reason: int) -> Retired | None:
        """Has each member of `plan` (default: a new plan over the usable members) load its
        range; every agent at once, since the data-plane group forms only when all ranks have
        joined. A jaccl group chosen automatically that fails to form is loaded again over
        ring: RDMA that misbehaves must not leave the model down. `reason` (a pb.LoadReason)
        sets the nodes' CPU priority for the load; LOAD_MOVE: each node's worker of the
        current plan serves while its new one loads, and the requests on it after the switch:
        the plan replaced is returned, for `_retire`."""
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
        self.placed = plan  # what it holds from now on, for the other models' budgets
        folders = await self._transfer_weights(members, plan)
        self.status = f"loading {self.name} (plan {plan.plan_hash})"
        async with self.plan_loads:
            try:
                replies = await self._load_stages(plan, members, folders, choice, reason)
            except grpc.aio.AioRpcError as e:
                if choice.backend != "jaccl" or self.cluster.options.backend != "auto":
                    raise
                error = _error_line(e.details() or str(e.code()))
                log.warning("the jaccl group of plan %s did not form (%s): loading it over "
                            "ring", plan.plan_hash, error)
                self.jaccl_failures.record([(m.name, m.admissions) for m in members], error)
                choice = BackendChoice("ring", f"jaccl did not form: {error}")
                replies = await self._load_stages(plan, members, folders, choice, reason)
        previous = self.node
        if previous is not None and reason != pb.LOAD_MOVE:
            await previous.close()
            previous = None
        self.node = members[0].agent.worker(replies[0].worker_address)
        retired = (Retired(previous, self.worker_pids, self.plan) if previous is not None
                   else None)
        self.worker_pids = {m.name: r.worker_pid for m, r in zip(members, replies)}
        for m in members:
            m.health = await m.agent.health()
        self.plan, self.backend, self.capacity_error = plan, choice, ""
        self.load_seconds = max(r.load_seconds for r in replies)
        self.load_reason, self.load_nice = reason, max(r.load_nice for r in replies)
        log.info("serving %s on %d stage(s) over %s (%s), split %s (plan %s, epoch %d)",
                 self.name, len(members), choice.backend, choice.reason, plan.split,
                 plan.plan_hash, self.epoch + 1)
        self.serving()
        return retired

    def serving(self) -> None:
        """Sequences go to `self.node`, the head worker of the plan just loaded, from now on: a
        new epoch, which requests lost on an earlier one resume on."""
        self.epoch += 1
        self.ready, self.status = True, "ready"
        self._ready_event.set()

    def pause(self, status: str) -> None:
        """No sequence goes to it until it is `serving` again (a re-plan, an unload)."""
        self.ready, self.status = False, status
        self._ready_event.clear()

    def _choose_backend(self, members: list[Member]) -> BackendChoice:
        """The data plane for `members` (in rank order); raises BackendError."""
        failed = self.jaccl_failures.reason([(m.name, m.admissions) for m in members])
        if failed is not None and self.cluster.options.backend == "auto":
            return BackendChoice("ring", f"jaccl did not form on these nodes before: {failed}")
        return choose_backend(self.cluster.options.backend, [m.rdma_ports for m in members],
                              [m.name for m in members])

    async def _load_stages(self, plan: Plan, members: list[Member], folders: Folders,
                           choice: BackendChoice, reason: int) -> list[pb.LoadShardReply]:
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
                    model_path=folders.model.get(m.name, str(self.model.path)),
                    model_id=self.model.name, layer_start=stage.layer_start,
                    layer_end=stage.layer_end, rank=rank, world_size=world, peers=peers,
                    backend=choice.backend if world > 1 else "",
                    rdma_devices_json=choice.devices_json, plan_hash=plan.plan_hash,
                    micro_batches=self.cluster.options.micro_batches,
                    speculative=(f"draft={folders.head_draft}" if rank == 0 and folders.head_draft
                                 else self.model.config.speculative),
                    kind=self.model.kind.kind,
                    streamed_layers=stage.streamed_layers,
                    tensor=plan.parallel == "tensor", load_reason=reason,
                    keep_serving=reason == pb.LOAD_MOVE,
                    keep_serving_seconds=KEEP_SERVING_SECONDS,
                    stage_ranks=plan.stage_ranks if plan.parallel == "tensor-pipeline" else ()))
            except BaseException as e:
                failures.append(e)
                raise

        calls = [asyncio.ensure_future(load(rank, m, stage))
                 for rank, (m, stage) in enumerate(zip(members, plan.stages))]
        pending = set(calls)
        while pending:
            _, pending = await asyncio.wait(pending, timeout=HEARTBEAT_SECONDS)
            if pending and (lost := [m.name for m in members if not m.alive]):
                # The group can never form: every rank's agent stops its worker as its call
                # ends, instead of holding the cluster's plan lock until its group times out.
                for c in pending:
                    c.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                await self._agents_idle(members)
                raise NoCapacity(f"node(s) {', '.join(lost)} of plan {plan.plan_hash} were "
                                 "lost while it loaded")
        if failures:
            for c in calls:  # read, so none is logged as an exception never retrieved
                c.exception()
            raise failures[0]
        return [c.result() for c in calls]

    async def _agents_idle(self, members: list[Member]) -> None:
        """Waits (bounded) until the live agents of an abandoned load have dropped it, so that
        the next plan reads the data ports they will use."""
        deadline = time.monotonic() + ABANDONED_LOAD_SECONDS
        for m in members:
            while m.alive and time.monotonic() < deadline:
                try:
                    if not (await m.agent.health()).loading:
                        break
                except grpc.aio.AioRpcError:
                    break
                await asyncio.sleep(0.2)

    async def _transfer_weights(self, members: list[Member], plan: Plan) -> Folders:
        """Sends every remote stage the tensors of its range it lacks, and a remote head the
        draft model's files where this machine holds them, all nodes at once; returns each
        remote node's folder to load from. Local nodes read the model's folder."""
        remote = [(m, s) for m, s in zip(members, plan.stages) if m.process is None]
        if not remote:
            return Folders({})
        source = await self.model.weight_source()
        draft = await self.model.draft_source() if members[0].process is None else None
        progress: dict[str, TransferProgress] = {}
        before = self.status

        def show(p: TransferProgress) -> None:
            progress[p.node] = p
            # Not through the status setter: a line per message would flood the log (the
            # transfer logs its own, every few seconds).
            self._status = "transferring weights: " + ", ".join(
                f"{q.node} {q.bytes_sent / 1e6:.0f}/{q.bytes_to_send / 1e6:.0f} MB"
                for q in progress.values())

        async def one(m: Member, source: WeightSource, start: int, end: int, label: str) -> str:
            try:
                result = await ensure_weights(m.agent, source, start, end, show,
                                              self.weight_counters, label=label)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    m.weights_error = e.details()
                    log.error("node %s cannot take %s: %s", m.name, self.name, e.details())
                raise
            return result.local_path

        self.status = (f"transferring weights of {self.name} to "
                       f"{', '.join(m.name for m, _ in remote)}")
        # Every transfer runs to its end before a failure is raised: a retry must not race a
        # transfer still writing into the same node folder.
        jobs = [one(m, source, s.layer_start, s.layer_end, m.name) for m, s in remote]
        if draft is not None:  # the head drafts: the draft model runs beside its layers
            jobs.append(one(members[0], draft, 0, draft.num_layers, f"{members[0].name} (draft)"))
        results = await asyncio.gather(*jobs, return_exceptions=True)
        self.status = before
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return Folders({m.name: path for (m, _), path in zip(remote, results)},
                       results[-1] if draft is not None else "")

    # ---- failures, moves and unloads --------------------------------------------------------

    def broken_by(self, lost: set[str]) -> bool:
        """Whether its active plan lost a stage: a node in `lost` or gone, or a stage's worker of
        this model that its agent no longer reports ready (not while a plan of it loads: then
        every worker is being replaced); or is wedged: its head worker silent past
        --stall-timeout with requests on it (the data plane between two stages cut while
        their agents answer: no heartbeat sees that)."""
        if self.plan is None or self.unloaded:
            return False
        silent = self.node.session.silent_seconds() if self.node is not None else 0.0
        if silent > self.cluster.options.stall_seconds and not self._replanning.locked():
            log.warning("%s: its head worker sent nothing for %.0f s while it had requests "
                        "(--stall-timeout): the plan is wedged", self.name, silent)
            return True
        by_name = {m.name: m for m in self.cluster.members}
        for s in self.plan.stages:
            m = by_name.get(s.node)
            # A node lost during a re-plan still counts: `recover` runs after that one.
            if s.node in lost or m is None or not m.alive:
                return True
            if self._replanning.locked():
                continue
            if m.health is not None and not any(w.model_id == self.model.name and w.ready
                                                for w in m.health.workers):
                log.warning("node %s: the shard worker of %s is gone", m.name, self.name)
                return True
        return False

    async def recover(self, reason: str, always: bool = False, plan: Plan | None = None,
                      move: bool = False, drain: bool = True) -> None:
        """Loads a new plan over the usable members (once, however many ask, unless `always`:
        a node that joined must be planned in even right after another re-plan); `plan`: that
        one instead, unless one of its nodes is gone or its load fails. `move`: a plan that
        serves keeps serving while the next one loads, where the nodes hold both (`_move`);
        `drain`: and then the requests on it to their end, else they resume on the next."""
        epoch = self.epoch
        async with self._replanning:
            if self.unloaded or (self.epoch != epoch and self.ready and not always
                                 and not self.broken_by(set())):
                return  # unloaded on purpose, or someone else recovered already
            if self.ready:
                await self._prefetch_weights(plan)
                if move and await self._move(plan, reason, drain):
                    return
            self.pause(f"recovering: {reason}")
            log.warning("re-planning %s: %s", self.name, reason)
            t0, started_at = time.monotonic(), time.time()
            delay = 1.0
            while True:
                try:
                    await self._load_plan(plan, self._recovery_reason())
                    break
                except NoCapacity as e:
                    log.error("cannot serve %s: %s", self.name, e)
                    return  # new and in-flight requests get 503 until a node joins
                except (grpc.aio.AioRpcError, OSError) as e:
                    why = _error_line(e.details() or str(e.code())) if isinstance(
                        e, grpc.aio.AioRpcError) else str(e)
                    log.warning("re-plan of %s failed, retrying in %.0fs: %s", self.name,
                                delay, why)
                    self.status = f"recovering: {reason}; the last try failed: {why}"
                    plan = None  # what failed may be a node of that plan: plan afresh
                    # Backing off: a load that fails the same way every time (a model folder
                    # gone) must not keep the nodes busy; an unload stops the retries.
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, RETRY_MAX_SECONDS)
                    if self.unloaded:
                        return
                    await self.cluster.check_members()
            self.last_recovery = {"reason": reason, "seconds": time.monotonic() - t0,
                                  "started_at": started_at, "epoch": self.epoch,
                                  "load_seconds": self.load_seconds}
            log.info("recovered in %.2fs", self.last_recovery["seconds"])

    async def _move(self, plan: Plan | None, reason: str, drain: bool = True) -> bool:
        """Make before break: loads the next plan while this one serves (new requests too),
        then switches new requests to it while the old plan serves those on it to their end
        (`_retire`): no request waits for the load or is prefilled again. Unless `drain` is
        off: a move away from a plan measured slow (the rebalancer's) has them resume on the
        faster one as soon as it serves, which costs each a prefill. Only where every
        node's memory holds both plans' stages at once. Whether it moved: a failure leaves the
        re-plan to `recover`."""
        _, next_plan = self._staged(plan)
        if next_plan is None or self.plan is None:
            return False
        held = plan_bytes(self.plan)
        if any(s.memory_bytes + held.get(s.node, 0) > self.room(s.node)
               for s in next_plan.stages):
            log.info("%s: the nodes cannot hold both plans at once: re-planning it", self.name)
            return False
        log.warning("moving %s while it serves: %s", self.name, reason)
        t0, started_at = time.monotonic(), time.time()
        try:
            retired = await self._load_plan(next_plan, pb.LOAD_MOVE)
        except (NoCapacity, grpc.aio.AioRpcError, OSError) as e:
            why = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
            log.warning("moving %s failed (%s): re-planning it", self.name, _error_line(why or ""))
            return False
        # Said as soon as the new plan serves (what /cluster/status shows from then on), not
        # after the old plan's stages are let go below.
        self.last_recovery = {"reason": reason, "seconds": time.monotonic() - t0,
                              "started_at": started_at, "epoch": self.epoch,
                              "load_seconds": self.load_seconds, "moved": True}
        log.info("moved in %.2fs", self.last_recovery["seconds"])
        if retired is not None:  # in a task: the plan lock is not held across the drain
            self.retiring = retired.plan
            self._retiring = asyncio.ensure_future(
                self._retire(retired, MOVE_DRAIN_SECONDS if drain else 0.0))
            self._retiring.add_done_callback(_log_failure)
        return True

    async def _retire(self, retired: Retired, drain_seconds: float) -> None:
        """Once the requests on the plan a move replaced have ended (`drain_seconds` at most:
        those left then resume on the new plan; at once if the model is unloaded),
        closes its head's session and has each of its nodes unload its worker by pid: those
        the new plan replaced, which their agents kept serving, and those of the nodes it left
        out, where nothing replaced them. By pid: a later plan's worker on the node stays."""
        deadline = time.monotonic() + drain_seconds
        while (retired.node.session.open_sequences() and not self.unloaded
               and time.monotonic() < deadline):
            await asyncio.sleep(DRAIN_POLL_SECONDS)
        left = retired.node.session.open_sequences()
        await retired.node.close()
        by_name = {m.name: m for m in self.cluster.members if m.alive}
        nodes = [(by_name[n], pid) for n, pid in retired.workers.items() if n in by_name and pid]
        try:
            results = await asyncio.gather(*(m.agent.unload_shard(self.model.name,
                                                                  UNLOAD_GRACE_SECONDS, pid)
                                             for m, pid in nodes), return_exceptions=True)
        finally:
            if self.retiring is retired.plan:  # (not a later move's)
                self.retiring = None
        for (m, pid), r in zip(nodes, results):
            if isinstance(r, BaseException):
                log.warning("unloading worker %d of %s's previous plan on %s: %s", pid,
                            self.name, m.name, r)
        unloaded = sorted(m.name for (m, _), r in zip(nodes, results)
                          if not isinstance(r, BaseException) and r.was_loaded)
        log.info("%s: the previous plan's workers unloaded on %s (%s)", self.name,
                 ", ".join(unloaded) or "no node",
                 f"{left} request(s) left on it to resume" if left else "its requests done")

    def _recovery_reason(self) -> int:
        """Why a re-plan loads: a replica's while another serves the model meanwhile (requests
        go there), else a recovery that the model's requests wait for."""
        return (pb.LOAD_REPLICA if any(d.ready for d in self.siblings)
                else pb.LOAD_RECOVERY)

    def replan_changes(self) -> bool:
        """Whether a new plan over the usable members would differ from the one serving, in
        its layer ranges or its data plane."""
        if not self.ready:
            return True
        members, next_plan = self._staged(None)
        if next_plan is None or self.plan is None or next_plan.plan_hash != self.plan.plan_hash:
            return True
        try:
            return self._choose_backend(members) != self.backend
        except BackendError:
            return True

    def recover_soon(self, reason: str) -> None:
        """Starts `recover` in a task of its own unless one runs: a recovery may take minutes
        (weights on their way, a load that keeps failing), and neither the heartbeat nor the
        other models' recoveries wait for it."""
        if self._recovery is None or self._recovery.done():
            self._recovery = asyncio.ensure_future(self.recover(reason))
            self._recovery.add_done_callback(_log_failure)

    async def apply_plan(self, plan: Plan, budgets: dict[str, int], reason: str) -> bool:
        """Moves to `plan` (the rebalancer's) through the re-plan path: weights first while
        the current plan serves, then the new plan loads while the current one still serves
        where the nodes hold both (make before break, `_move`), then the switch, in-flight
        requests resuming on it. `budgets` lowered below a node's room (a node short of
        memory) stay as this model's caps for its later plans, not the node's for every model;
        whether `plan` serves."""
        for node, budget in budgets.items():
            if budget < self.room(node):
                self.caps[node] = budget
        await self.recover(reason, always=True, plan=plan, move=True, drain=False)
        return self.plan is not None and self.plan.plan_hash == plan.plan_hash

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

    async def unload(self, grace: float = UNLOAD_GRACE_SECONDS) -> None:
        """Stops its workers (SIGTERM, `grace`, then SIGKILL), every stage at once; returns once
        each agent saw its worker exit, so the memory is free. Never re-planned afterwards."""
        self.unloaded = True  # a recovery retrying a failed load stops at its next try
        async with self._replanning:
            self.pause("unloading")
            by_name = {m.name: m for m in self.cluster.members}
            stages = [by_name[n] for n in self.stages_on() if n in by_name
                      and by_name[n].alive]
            # The head first: its STOP ends the later stages, which wait for it rather than
            # for a SIGTERM (omlx_node/pipeline.py).
            results = [await _settled(m.agent.unload_shard(self.model.name, grace))
                       for m in stages[:1]]
            results += await asyncio.gather(*(m.agent.unload_shard(self.model.name, grace)
                                              for m in stages[1:]), return_exceptions=True)
            for m, r in zip(stages, results):
                if isinstance(r, BaseException):
                    log.warning("unloading %s on %s: %s", self.name, m.name, r)
                elif r.killed:
                    log.warning("the worker of %s on %s outlived %.0fs after SIGTERM and was "
                                "killed", self.name, m.name, grace)
            if self.node is not None:
                await self.node.close()
            self.node, self.plan, self.placed, self.backend = None, None, None, None
            self.status = "unloaded"

    async def wait_ready(self, timeout: float) -> None:
        """Returns once a plan serves; raises NoCapacity at once when nothing can serve, or
        TimeoutError."""
        if self.capacity_error and not self.ready:
            raise NoCapacity(self.capacity_error)
        await asyncio.wait_for(self._ready_event.wait(), timeout)

    async def close(self) -> None:
        for task in (self._recovery, self._retiring):  # a kept worker: its agent's bound
            if task is not None:
                task.cancel()
        if self.node is not None:
            await self.node.close()


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("a recovery failed", exc_info=task.exception())


async def _settled(call):
    """`call`'s result, or the exception it raised (as asyncio.gather's return_exceptions)."""
    try:
        return await call
    except Exception as e:
        return e


def _error_line(details: str) -> str:
    """The line that says what went wrong in a failed LoadShard's details (which end with the
    worker's log): its last "error:" line, else its last line."""
    lines = [line.strip() for line in details.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or [details])[-1].removeprefix("error:").strip()
