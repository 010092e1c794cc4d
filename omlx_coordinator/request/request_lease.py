"""One request's hold on its model and on the replica each of its attempts runs on.

A `RequestLease` is the one owner of what a request changes outside itself: the model's lease
(taken with the first replica, so that the model is not evicted under the request, and held to
its end), the drain exemption that lease earns (a drain waits for leases to end, so a leased
request resuming after a lost node must not wait for the drain), the replica's in-flight count
that routing balances and its count of attempts, and the prefix index that routes a follow-up
turn to the replica whose cache holds this one. Used as an async context manager, it gives all
of them back however the request ends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from omlx_coordinator.errors import APIError
from omlx_coordinator.models.deployment import Deployment
from omlx_coordinator.models.lifecycle import ModelManager
from omlx_coordinator.models.served_model import LOADED, ServedModel
from omlx_coordinator.nodes.cluster import NoCapacity
from omlx_coordinator.request.events import KeepAlive
from omlx_coordinator.request.retry import PlanRef

# How long a request that lost a plan waits for that replica's new plan before trying the same
# one again (its node may not be known lost yet).
REPLAN_WAIT_SECONDS = 5.0
# The most a wait for a load, a drain or a plan goes without a KeepAlive or a look again.
POLL_SECONDS = 0.5


class RequestLease:
    """`tokens()` is what the request's replica holds once an attempt has run: its prompt and
    what it generated so far (routing matches it against each replica's prefixes); none by
    default, as for an encode, whose inputs no prefix cache keeps."""

    def __init__(self, manager: ModelManager, model: ServedModel, deadline: float,
                 keepalive_seconds: float, tokens: Callable[[], list[int]] = list):
        self.manager, self.model, self.deadline = manager, model, deadline
        self.poll = min(keepalive_seconds, POLL_SECONDS)
        self.tokens = tokens
        self.leased = False  # holds the model's lease
        self.deployment: Deployment | None = None  # the replica of the attempt running now
        self.epoch = 0  # its epoch when the attempt started

    async def __aenter__(self) -> RequestLease:
        return self

    async def __aexit__(self, *_) -> None:
        # What an attempt running at the end generated is in that replica's cache now.
        self._end(record=True)
        if self.leased:
            self.model.release()
            self.leased = False

    async def replica(self, avoid: PlanRef | None = None) -> AsyncIterator[KeepAlive]:
        """Yields KeepAlive while the model loads, recovers or drains; when it returns, an
        attempt runs on `self.deployment`: not the plan `avoid` (one the request just lost)
        while another replica can take it or, for a little while, waiting for that one's new
        plan."""
        waited = 0.0
        while True:
            main = self.manager.replicas[self.model.name][0]
            if time.monotonic() > self.deadline:
                raise APIError(504, "the request ran past the server's time limit while the "
                                    f"model loaded or the cluster recovered ({main.status})",
                               type="server_error", code="timeout")
            if self.model.state != LOADED:
                if not await self._loaded():
                    yield KeepAlive()
                continue
            d = self.manager.route(self.model, self.tokens(), avoid=avoid)
            if self.model.name in self.manager.draining and not self.leased:
                await asyncio.sleep(self.poll)  # a load waits for the model to go
                yield KeepAlive()
                continue
            if d.ready and not (avoid == (d, d.epoch) and waited < REPLAN_WAIT_SECONDS):
                self._start(d)  # no await since it was found ready: it still is
                return
            try:
                await d.wait_ready(self.poll)
            except NoCapacity as e:
                raise APIError(503, f"the model cannot be served now: {e}",
                               type="server_error", code="no_capacity") from None
            except asyncio.TimeoutError:
                yield KeepAlive()
            if d.ready and avoid == (d, d.epoch):
                await asyncio.sleep(0.2)
                waited += 0.2

    async def _loaded(self) -> bool:
        """Waits a poll for the model's load; whether it ended. A failed load is the
        request's error."""
        task = self.manager.load_task(self.model)
        done, _ = await asyncio.wait({task}, timeout=self.poll)
        if not done:
            return False
        if isinstance(e := task.exception(), NoCapacity):
            raise APIError(503, f"the model {self.model.name} cannot be loaded: {e}",
                           type="server_error", code="no_capacity")
        if e is not None:
            raise APIError(503, f"loading the model {self.model.name} failed: {e}",
                           type="server_error", code="load_failed")
        return True

    def _start(self, d: Deployment) -> None:
        if not self.leased:
            self.model.acquire()
            self.leased = True
        self.deployment, self.epoch = d, d.epoch
        d.inflight += 1
        d.requests += 1

    def sent(self) -> None:
        """The attempt's request is on its way: its prompt is in the replica's cache soon.
        Recorded after the call's send is queued, so that hashing a long prompt's blocks does
        not delay it."""
        asyncio.get_running_loop().call_soon(self.manager.record, self.deployment,
                                             self.tokens())

    def lost(self) -> PlanRef:
        """The running attempt was lost (nothing of it is cached): the plan it ran on."""
        plan = self.deployment, self.epoch
        self._end(record=False)
        return plan

    def _end(self, record: bool) -> None:
        """The running attempt is over; `record`: its tokens are in its replica's cache."""
        if self.deployment is None:
            return
        if record:
            self.manager.record(self.deployment, self.tokens())
        self.deployment.inflight -= 1
        self.deployment = None
