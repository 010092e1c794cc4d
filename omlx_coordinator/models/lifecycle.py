"""Several models on one cluster: which are loaded where, loads on demand, evictions.

Every request holds a lease on its model from admission to its last token. A request for an
unloaded model loads it; if memory is short, the least recently used unpinned models with no
lease are unloaded first (a model whose leases block the room is drained: it takes no new
requests until the waiting load is done, so a busy model cannot starve the others). Loads run
one at a time (the main model first at start): two loads would read the same disks and each
plan must see what the other holds. An unload finishes, the workers gone and each node's memory
back under its watermark, before the next load starts. Idle models with a TTL are unloaded;
pinned ones never are. Placement (omlx_coordinator/models/placement.py) is a pure function of the
models and the nodes; routing between replicas (omlx_coordinator/models/routing.py) follows the prefix
each replica's cache holds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

import grpc

from omlx_coordinator.models import placement, routing
from omlx_coordinator.models.deployment import Deployment, Holder
from omlx_coordinator.models.served_model import LOADED, LOADING, UNLOADED, ServedModel
from omlx_coordinator.nodes.backend import JacclFailures
from omlx_coordinator.nodes.cluster import Cluster, Member, NoCapacity
from omlx_coordinator.nodes.weight_transfer import WeightCounters
from omlx_coordinator.planning.links import with_links
from omlx_coordinator.planning.planner import NodeSpec, Plan, PlanError
from omlx_shared.block_hashes import DEFAULT_BLOCK_SIZE, block_hashes
from omlx_shared.heap import freeze_startup_heap
from omlx_shared.model_kinds import ENDPOINTS
from proto import omlx_pb2 as pb

log = logging.getLogger(__name__)

TTL_CHECK_SECONDS = 1.0
TOKENIZERS_WAIT_SECONDS = 60.0  # the longest the tokenizers wait for a model to serve first
# Memory a node must have free (as its OS reports it) beyond a new stage's bytes before the
# stage loads: the planner's bytes leave out the worker process itself.
WATERMARK_HEADROOM_BYTES = 1 << 30
WATERMARK_WAIT_SECONDS = 30.0
PRESSURE_EVICT_SECONDS = 10.0  # at most one eviction for memory pressure this often
# prefix: to the replica holding the longest prefix (else the least loaded); round-robin: in
# turn, ignoring the caches (what a plain load balancer in front of the replicas would do).
ROUTING_MODES = ("prefix", "round-robin")
# A stale worker's pipeline peers are gone: it may be blocked on one and never run its SIGTERM
# handler, so do not wait long (it holds the cluster's plan lock meanwhile).
STALE_GRACE = 1.0
NO_NODES = "no node has joined yet: run `omlx-cluster join` on a Mac with this cluster's secret"


class ModelManager:
    def __init__(self, cluster: Cluster, models: list[ServedModel],
                 block_size: int = DEFAULT_BLOCK_SIZE, routing_mode: str = "prefix"):
        if routing_mode not in ROUTING_MODES:
            raise ValueError(f"routing {routing_mode!r}: one of {', '.join(ROUTING_MODES)}")
        self.cluster = cluster
        self.routing_mode = routing_mode
        self._turn = 0  # round-robin's next replica
        self.models = models  # the first is the main model
        self.by_name = {n: m for m in models for n in m.names}
        self.block_size = block_size  # the nodes' prefix-cache block, for routing
        # One plan loads at a time over the whole cluster: each load reads the nodes' data
        # ports, which an agent moves only once its load is done, so two plans loading at once
        # (two models recovering from one failure) would be given the same ports and join each
        # other's groups.
        self.plan_loads = asyncio.Lock()
        self.jaccl_failures = JacclFailures()  # a stage's, whichever model it failed for
        self.weight_counters = WeightCounters()  # every transfer's, for /metrics
        self.holders: list[Holder] = []  # every deployment: what room() takes off a budget
        # Replica 0 of every model always exists (unloaded or not): requests wait on it.
        self.replicas: dict[str, list[Deployment]] = {
            m.name: [self.new_deployment(m)] for m in models}
        self.draining: set[str] = set()  # models a waiting load needs unloaded
        self.loading = asyncio.Lock()
        self.evictions: list[dict] = []  # the last few unloads, for /cluster/status
        self._last_pressure_evict = 0.0
        self._loads: dict[str, asyncio.Task] = {}
        # Requests that find a model unloaded at once share one answer to "does it fit?".
        self._shortfalls: dict[str, asyncio.Task] = {}
        self.started = False  # the models that fit at start are loaded (or failed)
        self._task: asyncio.Task | None = None
        self._sync_holders()
        cluster.on_lost, cluster.on_joined = self._on_lost, self._on_joined
        cluster.busy = self.busy

    @property
    def main(self) -> Deployment:
        """The main model's first replica: what the rebalancer balances."""
        return self.replicas[self.models[0].name][0]

    def new_deployment(self, model: ServedModel, replica: int = 0) -> Deployment:
        """Replica `replica` of `model`, not loaded, sharing what every deployment of the
        cluster shares."""
        return Deployment(self.cluster, model, replica, holders=self.holders,
                          plan_loads=self.plan_loads,
                          jaccl_failures=self.jaccl_failures,
                          weight_counters=self.weight_counters)

    def busy(self) -> bool:
        """Whether the nodes are in use: a request admitted and not finished, or a load (its
        weights may be crossing the links). Links are measured again only while not."""
        return (self.loading.locked() or self.plan_loads.locked()
                or any(m.leases for m in self.models)
                or any(d.inflight for d in self.deployments()))

    def deployments(self) -> list[Deployment]:
        return [d for ds in self.replicas.values() for d in ds]

    def _sync_holders(self) -> None:
        self.holders[:] = self.deployments()  # in place: every deployment reads this list

    # ---- start and stop ---------------------------------------------------------------------

    async def start(self) -> None:
        """Starts the nodes, then loads every model that fits without evicting another, in
        order (the main model first; its failure is the start's). The rest load on demand."""
        await self._start()
        self.started = True
        freeze_startup_heap()  # the app and what the start loaded: not walked again

    async def load_tokenizers(self) -> None:
        """Loads every model's tokenizer on a thread, one after another, once a model serves
        (or TOKENIZERS_WAIT_SECONDS after the start): before, their CPU (a second or more on
        a small machine, many on a loaded one) would be taken from finding the nodes and
        loading a plan, which /health waits for, while in a restart side by side they delayed
        its ready as much as they had delayed its listening. A request that comes first loads
        its model's itself (ServedModel.load_tokenizer). One that fails is logged; its
        model's requests then fail saying why."""
        deadline = time.monotonic() + TOKENIZERS_WAIT_SECONDS
        while not any(d.ready for d in self.deployments()) and time.monotonic() < deadline:
            await asyncio.sleep(TTL_CHECK_SECONDS / 4)
        for m in self.models:
            try:
                await asyncio.to_thread(m.load_tokenizer)
            except Exception as e:  # transformers raises many kinds for a broken folder
                log.error("the tokenizer of %s did not load: %s", m.name, e)
        freeze_startup_heap()  # the tokenizers: not walked again

    async def _start(self) -> None:
        await self.cluster.start()
        self._task = asyncio.create_task(self._watch())
        if not self.cluster.members:
            self.main.capacity_error = self._no_nodes()
            self.main.status = f"waiting for nodes ({self.main.capacity_error})"
            return
        for i, m in enumerate(self.models):
            if i and not await self._fits(m):
                log.info("%s does not fit beside the models loaded now: it loads on demand",
                         m.name)
                continue
            try:
                # The main model is what requests wait for; the others load beside it ahead
                # of any request (one that comes meanwhile waits for that slower load).
                await self.ensure_loaded(m, evict=False,
                                         reason=pb.LOAD_PRELOAD if i else pb.LOAD_REQUESTED)
            except NoCapacity as e:
                if i == 0:
                    raise
                log.warning("%s not loaded at start: %s", m.name, e)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for task in self._loads.values():  # a load half done must not outlive the nodes
            task.cancel()
        for d in self.deployments():
            await d.close()
        await self.cluster.stop()

    # ---- what requests see ------------------------------------------------------------------

    def resolve(self, name: str) -> ServedModel | None:
        return self.by_name.get(name)

    async def shortfall(self, model: ServedModel) -> str:
        """Why `model` cannot be placed even with every unpinned model unloaded ("" when it
        can). Calls while one is planning share its answer: a burst of requests to an unloaded
        model runs the planner once, not once each."""
        task = self._shortfalls.get(model.name)
        if task is None:
            task = asyncio.create_task(self._shortfall(model))
            self._shortfalls[model.name] = task
            task.add_done_callback(lambda _: self._shortfalls.pop(model.name, None))
        return await asyncio.shield(task)

    def _no_nodes(self) -> str:
        """Why nothing can run while no node is a member: none ever joined, or (a restart) the
        nodes it had have not registered again yet."""
        if self.cluster.expected:
            return (f"waiting for the nodes it had before its restart to register again "
                    f"({', '.join(sorted(self.cluster.expected))}): retry in a few seconds")
        return NO_NODES

    async def _shortfall(self, model: ServedModel) -> str:
        if not self.cluster.servable():
            return (self._no_nodes() if not self.cluster.members
                    else "no node is left to run the model")
        try:
            await self._place(model, self._loaded(model, idle=True))
        except PlanError as e:
            return str(e)
        return ""

    def route(self, model: ServedModel, tokens: list[int],
              avoid: tuple[Deployment, int] | None = None) -> Deployment:
        """The replica of `model` for a request of `tokens`: the ready one whose cache holds
        the longest prefix of them, else the least loaded; not the one (at that epoch) a
        request just lost, while another can take it. Replica 0 when none is ready: requests
        wait on it."""
        ds = self.replicas[model.name]
        if len(ds) == 1:  # nothing to choose: no prefix hashing on the request's critical path
            return ds[0]
        usable = [d.ready and model.name not in self.draining
                  and not (avoid and avoid == (d, d.epoch)) for d in ds]
        if self.routing_mode == "round-robin" and any(usable):
            self._turn += 1
            ready = [d for d, ok in zip(ds, usable) if ok]
            return ready[self._turn % len(ready)]
        chain = block_hashes(model.name, tokens, self.block_size)
        try:
            return ds[routing.choose_replica(chain, [routing.Replica(d.prefixes, d.inflight, ok)
                                                     for d, ok in zip(ds, usable)])]
        except routing.NoReadyReplica:
            return ds[0]

    def record(self, d: Deployment, tokens: list[int]) -> None:
        """`tokens` (prompt and output) are now in `d`'s prefix cache."""
        d.prefixes.record(block_hashes(d.model.name, tokens, self.block_size))

    # ---- loading and unloading ----------------------------------------------------------------

    def load_task(self, model: ServedModel, reason: int = pb.LOAD_REQUESTED) -> asyncio.Task:
        """The load of `model` requests wait for (shielded: a client that goes away must not
        cancel a load half done), one per model at a time. `reason` (a pb.LoadReason): a
        request's, or LOAD_PRELOAD where nobody waits for it yet (its priority stays that of
        the caller that started it: a load cannot be hurried once it runs)."""
        task = self._loads.get(model.name)
        if task is None or task.done():
            task = self._loads[model.name] = asyncio.create_task(
                self.ensure_loaded(model, reason=reason))
            # Its failure reaches the requests that wait for it, not the event loop's log.
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    async def ensure_loaded(self, model: ServedModel, evict: bool = True,
                            reason: int = pb.LOAD_REQUESTED) -> None:
        """Returns once `model` serves; loads it (evicting others if `evict`) for `reason`
        (a pb.LoadReason) when it does not. Raises NoCapacity when it fits nowhere even
        after eviction."""
        while model.state != LOADED:
            async with self.loading:
                if model.state == LOADED:
                    return
                await self._load(model, evict, reason)

    async def _load(self, model: ServedModel, evict: bool, reason: int) -> None:
        t0 = time.monotonic()
        model.state, model.error = LOADING, ""
        ds = self.replicas[model.name]
        if self.cluster.expected:  # restarted: plan once over the nodes it had, not one by one
            ds[0].status = ("waiting for the nodes of the cluster before its restart: "
                            + ", ".join(sorted(self.cluster.expected)))
            await self.cluster.gathered()
        ds[0].status = "waiting for memory"
        for d in ds:  # an earlier load's failure says nothing of this one
            d.capacity_error = ""
        try:
            plans = await self._make_room(model, evict)
            await self._watermark(plans)
            while len(ds) < len(plans):
                ds.append(self.new_deployment(model, len(ds)))
            del ds[len(plans):]
            for d in ds:
                d.siblings = [x for x in ds if x is not d]
            for d, plan in zip(ds, plans):
                d.placed = plan
            self._sync_holders()
            for d in ds:  # one replica at a time: one load per node and disk
                await d.load(reason)  # the model serves once all have loaded
        except BaseException as e:
            error = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
            model.state, model.error = UNLOADED, error
            if not isinstance(e, asyncio.CancelledError):
                log.error("could not load %s: %s", model.name, error)
                ds[0].status = f"failed: {error}"
            for d in ds:
                if not d.ready:
                    d.placed = None
                    d.capacity_error = str(e) if isinstance(e, NoCapacity) else ""
            if not isinstance(e, asyncio.CancelledError):
                # A model loads whole or not at all: replicas that did load would hold memory
                # no placement counts (an unloaded model holds none) and none could unload.
                await asyncio.gather(*(d.unload() for d in ds if d.ready))
            raise
        model.state, model.loads = LOADED, model.loads + 1
        model.load_seconds = time.monotonic() - t0
        model.last_used, model.loaded_at = time.monotonic(), time.time()
        log.info("%s loaded in %.1fs (%d replica(s))", model.name, model.load_seconds,
                 len(plans))

    def _loaded(self, model: ServedModel | None, idle: bool = False
                ) -> list[placement.LoadedModel]:
        """The loaded models but `model`, as placement sees them (`idle`: as if none had a
        lease)."""
        return [placement.LoadedModel(
            m.name, placement.plan_bytes(*(d.holding for d in self.replicas[m.name]
                                           if d.holding)),
            m.last_used, m.pinned, 0 if idle else m.leases)
            for m in self.models if m is not model and m.state != UNLOADED]

    async def _place(self, model: ServedModel, loaded: list[placement.LoadedModel]
                     ) -> tuple[list[Plan], list[str]]:
        """Where `model` goes beside `loaded`, and which of them to evict first. On a thread:
        with many nodes and `replicas=auto` the planner takes long enough that on the event
        loop it would pause every stream the gateway serves."""
        nodes = with_links([NodeSpec(m.name, m.budget_bytes, m.speed, cache_bytes=m.cache_bytes,
                                     weights_cap=m.weights_cap, disk_gbps=m.disk_speed,
                                     dequantizes=m.dequantizes, layer_ms=m.layer_ms)
                            for m in self.cluster.servable()], self.cluster.measured_links())
        # Budgets are net of the OS reserve already (Cluster.local_budget, admission).
        options = self.cluster.options
        settings = placement.PlanSettings(os_reserve_bytes=0,
                                          context_tokens=options.context_tokens,
                                          max_sequences=options.max_sequences,
                                          parallel=model.config.parallel or options.parallel)
        return await asyncio.to_thread(placement.place_evicting, model.layout, nodes, loaded,
                                       model.config.replicas, model.config.split, settings)

    async def _fits(self, model: ServedModel) -> bool:
        """Whether `model` fits beside the loaded models, evicting none."""
        loaded = [replace(m, pinned=True) for m in self._loaded(model)]
        try:
            await self._place(model, loaded)
            return True
        except PlanError:
            return False

    async def _make_room(self, model: ServedModel, evict: bool) -> list[Plan]:
        """The plans of `model`, after unloading the least recently used unpinned models it
        needs gone (`evict`; else it must fit as things are). Models with leases among those
        are drained and waited for; raises NoCapacity when even unloading every unpinned
        model would not make room."""
        drained: set[str] = set()
        try:
            return await self._plan_room(model, evict, drained)
        finally:
            self.draining.difference_update(drained)

    async def _plan_room(self, model: ServedModel, evict: bool, drained: set[str]
                         ) -> list[Plan]:
        """_make_room's loop; the models it drains stay drained (`drained`) until the room is
        made: let go between two looks, they would take new requests, and a steady client
        would keep the waiting load from ever starting."""
        while True:
            if not self.cluster.servable():
                raise NoCapacity(self._no_nodes() if not self.cluster.members
                                 else "no node is left to run the model")
            loaded = self._loaded(model)
            if not evict:
                loaded = [replace(m, pinned=True) for m in loaded]
            try:
                plans, victims = await self._place(model, loaded)
            except PlanError as e:
                if not evict:
                    raise NoCapacity(str(e)) from None
                try:  # would it fit once the requests on the others end?
                    _, victims = await self._place(model, self._loaded(model, idle=True))
                except PlanError as e2:
                    raise NoCapacity(str(e2)) from None
                busy = [self.by_name[v] for v in victims if self.by_name[v].leases]
                if not busy:  # their requests ended while the planner ran: plan again
                    continue
                # Drained, so that their leases end; then look again.
                drained.update(b.name for b in busy)
                self.draining.update(drained)
                self.replicas[model.name][0].status = (
                    f"waiting for {', '.join(b.name for b in busy)} to finish "
                    f"{sum(b.leases for b in busy)} request(s)")
                await busy[0].lease_ended(timeout=1.0)
                continue
            # The planner ran on a thread: what it was shown may have changed meanwhile.
            if self._changed(plans, victims):
                continue
            if not victims:
                return plans
            # All drained before the first unload: one that took a request while another
            # unloaded would fail the load (and the first would have gone for nothing).
            drained.update(victims)
            self.draining.update(drained)
            for v in victims:
                if self.by_name[v].leases:  # taken just before the drain: let it end
                    await self.by_name[v].lease_ended(timeout=1.0)
                    break
                await self.unload(self.by_name[v], reason=f"room for {model.name}")

    def _changed(self, plans: list[Plan], victims: list[str]) -> bool:
        """Whether a node of `plans` is no longer servable or a victim got a request since
        they were planned."""
        servable = {m.name for m in self.cluster.servable()}
        return (any(s.node not in servable for p in plans for s in p.stages)
                or any(self.by_name[v].leases for v in victims))

    async def _watermark(self, plans: list[Plan]) -> None:
        """Waits until every node of `plans` has the memory its stage needs free, as its OS
        reports it (an unloaded worker's pages may take a moment to go back)."""
        need = placement.plan_bytes(*plans)
        by_name = {m.name: m for m in self.cluster.members}
        deadline = time.monotonic() + WATERMARK_WAIT_SECONDS
        while True:
            short = {}
            for name, b in need.items():
                h = by_name[name].health
                if h is not None and h.memory_available_bytes and (
                        h.memory_available_bytes < b + WATERMARK_HEADROOM_BYTES):
                    short[name] = b + WATERMARK_HEADROOM_BYTES - h.memory_available_bytes
            if not short:
                return
            if time.monotonic() > deadline:
                raise NoCapacity("the memory of " + ", ".join(
                    f"{n} stayed {b / 2**30:.1f} GiB short" for n, b in short.items())
                    + f" of its watermark for {WATERMARK_WAIT_SECONDS:.0f}s")
            await asyncio.sleep(0.5)
            await self.cluster.check_members()

    async def unload(self, model: ServedModel, reason: str, kind: str = "evicted",
                     wait_leases: float = 0.0) -> None:
        """Unloads every replica of `model`; its workers are gone when this returns. With
        requests in flight it waits up to `wait_leases` seconds for them (drained meanwhile),
        then raises ModelBusy."""
        if model.leases:
            self.draining.add(model.name)
            try:
                await self._await_leases(model, wait_leases)
            finally:
                self.draining.discard(model.name)
        if model.state == UNLOADED:
            return
        log.info("unloading %s: %s", model.name, reason)
        ds = self.replicas[model.name]
        await asyncio.gather(*(d.unload() for d in ds))
        del ds[1:]
        ds[0].siblings = []
        self._sync_holders()
        model.state = UNLOADED
        model.unloads[kind] = model.unloads.get(kind, 0) + 1
        self.evictions = [*self.evictions[-9:], {"model": model.name, "reason": reason,
                                                 "at": time.time()}]
        await self.cluster.check_members()  # its workers gone from every node's picture

    async def unload_asked(self, model: ServedModel, wait_leases: float,
                           reason: str = "asked over HTTP") -> None:
        """An operator's unload (HTTP, `models unload --wait`): the model's requests are drained
        and waited for before the load lock is taken, so that other loads, re-plans and idle
        unloads go on meanwhile; raises ModelBusy as `unload` does."""
        self.draining.add(model.name)
        try:
            await self._await_leases(model, wait_leases)
            async with self.loading:
                await self.unload(model, reason=reason, kind="request")
        finally:
            self.draining.discard(model.name)

    @staticmethod
    async def _await_leases(model: ServedModel, wait: float) -> None:
        """Waits up to `wait` seconds for `model`'s requests to end; raises ModelBusy if some
        are left."""
        deadline = time.monotonic() + wait
        while model.leases and time.monotonic() < deadline:
            await model.lease_ended(timeout=min(1.0, deadline - time.monotonic()))
        if model.leases:
            raise ModelBusy(f"{model.name} has {model.leases} request(s) in flight")

    # ---- failures and joins -----------------------------------------------------------------

    async def _on_lost(self, lost: set[str]) -> None:
        for d in self.deployments():
            if d.broken_by(lost):
                d.recover_soon("a node or shard worker of the plan stopped answering")

    async def _on_joined(self, member: Member) -> None:
        """A node joined: the models with one replica re-plan over it, once any load in
        progress is done (a load that began before the join would not see it), and a replica
        down since its node was lost loads again; the main model, not loaded yet for want of
        nodes, loads now. A node lost before first gives up the workers of plans it was lost
        from."""
        if member.lost_before:
            await self._drop_stale(member)
        async with self.loading:
            for m in self.models:
                ds = self.replicas[m.name]
                if m.state == LOADED and len(ds) == 1:
                    if not ds[0].replan_changes():
                        # The planner leaves the node out: reloading the same plan would only
                        # cut every stream and empty the caches.
                        log.info("node %s joined; the plan of %s stays", member.name, m.name)
                        continue
                    await ds[0].recover(f"node {member.name} joined", always=True, move=True)
                elif m.state == LOADED:
                    for d in ds:
                        if not d.ready and not d.unloaded:
                            await d.recover(f"node {member.name} joined")
        if self.models[0].state == UNLOADED:
            try:
                await self.ensure_loaded(self.models[0], evict=False)
            except NoCapacity as e:
                log.error("cannot serve %s: %s", self.models[0].name, e)

    async def _drop_stale(self, member: Member) -> None:
        """Unloads the workers on `member` that no current plan placed there: a node lost and
        back still runs the plan it was lost from, which no request reaches any more, on
        memory the planner counts as free (and whose pipeline peers are gone)."""
        async with self.plan_loads:  # no load in flight: every worker is a plan's
            try:
                health = await member.agent.health()
            except grpc.aio.AioRpcError:
                return  # lost again: it comes back through here
            current = {(d.model.name, d.holding.plan_hash) for d in self.deployments()
                       if d.holding is not None and member.name in d.held_bytes()}
            stale = [w for w in health.workers if (w.model_id, w.plan_hash) not in current]
            for w in stale:
                log.warning("node %s is back with a worker of %s from plan %s, no longer "
                            "current: unloading it", member.name, w.model_id, w.plan_hash)
            results = await asyncio.gather(*(member.agent.unload_shard(w.model_id, STALE_GRACE)
                                              for w in stale), return_exceptions=True)
            for w, r in zip(stale, results):
                if isinstance(r, BaseException):
                    log.warning("unloading the stale worker of %s on %s: %s", w.model_id,
                                member.name, r)

    async def _watch(self) -> None:
        """Idle TTLs, and memory pressure."""
        while True:
            await asyncio.sleep(TTL_CHECK_SECONDS)
            for m in self.models:
                ttl = m.ttl_seconds
                if (ttl and not m.pinned and m.state == LOADED and not m.leases
                        and m.idle_seconds() > ttl and not self.loading.locked()):
                    async with self.loading:
                        if m.state == LOADED and not m.leases:
                            await self.unload(m, reason=f"idle for {ttl:.0f}s (ttl)", kind="ttl")
            await self._relieve_pressure()

    async def _relieve_pressure(self) -> None:
        """A node whose OS reports critical memory pressure sheds its least recently used
        unpinned, idle model."""
        if (time.monotonic() - self._last_pressure_evict < PRESSURE_EVICT_SECONDS
                or self.loading.locked()):
            return
        for member in self.cluster.members:
            h = member.health
            if h is None or h.memory_pressure != "critical":
                continue
            victim = placement.pressure_victim(self._loaded(None), member.name)
            if victim is not None:
                self._last_pressure_evict = time.monotonic()
                async with self.loading:
                    await self.unload(self.by_name[victim],
                                      reason=f"memory pressure on {member.name}",
                                      kind="pressure")
                return

    # ---- what status shows ----------------------------------------------------------------

    def describe(self, model: ServedModel) -> dict:
        """A model's state, replicas, where their stages run and their memory."""
        footprints: dict[str, dict] = {}
        speculative: list[dict] = []  # each replica head's, as its agent last probed it
        for m in self.cluster.members:
            for w in m.health.workers if m.health else ():
                if w.model_id == model.name:
                    footprints[m.name] = {"footprint_bytes": w.footprint_bytes,
                                          "mlx_active_bytes": w.mlx_active_bytes}
                    if w.rank == 0 and w.speculative_tokens_per_step:
                        speculative.append({
                            "node": m.name,
                            "acceptance_rate": round(w.speculative_acceptance_rate, 4),
                            "tokens_per_step": round(w.speculative_tokens_per_step, 3)})
        return {
            "id": model.name, "aliases": list(model.config.aliases),
            "kind": model.kind.kind, "endpoints": list(ENDPOINTS[model.kind.kind]),
            "state": "pinned" if model.pinned and model.state == LOADED else model.state,
            "loaded": model.state == LOADED, "pinned": model.pinned,
            "ttl_seconds": model.ttl_seconds or None, "leases": model.leases,
            "idle_seconds": round(model.idle_seconds(), 1), "loads": model.loads,
            "load_seconds": round(model.load_seconds, 3), "loaded_at": model.loaded_at or None,
            "error": model.error or None,
            "speculative": speculative,
            "replicas": [{"replica": d.replica, "ready": d.ready, "status": d.status,
                          "epoch": d.epoch, "inflight": d.inflight, "requests": d.requests,
                          **d.layout_status(),
                          "load": {"reason": pb.LoadReason.Name(d.load_reason)
                                   .removeprefix("LOAD_").lower(), "nice": d.load_nice},
                          "stages": [{"node": s.node, "layers": [s.layer_start, s.layer_end],
                                      "planned_bytes": s.memory_bytes,
                                      **footprints.get(s.node, {})}
                                     for s in (d.plan.stages if d.plan else ())]}
                         for d in self.replicas[model.name]],
        }


class ModelBusy(RuntimeError):
    """An unload asked for a model with requests in flight; the message says how many."""
