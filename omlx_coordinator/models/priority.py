"""Priority classes: one model's running slots shared by interactive and batch requests.

A key's `priority` (keys.py) puts its requests in a class. Each model has as many running slots
as its nodes decode sequences at once (`--max-batch` a replica). Interactive requests go to the
nodes at once, as every request did before classes: they are the node's queue, in arrival
order. Batch requests wait here, in arrival order, and go on only while fewer than `slots`
requests run in all and their class runs in fewer than `--batch-share` of the slots: a queue of
one person's agents therefore never stands in front of a colleague's turn at the node, and
the slots batch may not take stay free for interactive requests. No class starves: a batch
request that has waited BATCH_LONGEST_WAIT seconds goes on whatever runs.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass, field

INTERACTIVE, BATCH = "interactive", "batch"
DEFAULT_BATCH_SHARE = 0.5
BATCH_LONGEST_WAIT = 30.0  # seconds a batch request waits at most for a slot it may take


@dataclass
class _Waiter:
    since: float = field(default_factory=time.monotonic)
    ready: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop()
                                  .create_future())


class PriorityGate:
    """The running slots of one model, and the batch requests waiting for one."""

    def __init__(self, slots: int, batch_share: float = DEFAULT_BATCH_SHARE):
        if slots < 1 or not 0 < batch_share <= 1:
            raise ValueError(f"slots {slots} and batch share {batch_share}: need slots >= 1 "
                             "and a share in (0, 1]")
        self.slots = slots
        self.batch_cap = max(1, math.floor(batch_share * slots))
        self.running = {INTERACTIVE: 0, BATCH: 0}
        self._waiting: deque[_Waiter] = deque()

    @property
    def waiting(self) -> dict[str, int]:
        return {INTERACTIVE: 0, BATCH: len(self._waiting)}

    async def enter(self, priority: str) -> None:
        """Returns once the request holds a slot (cancelled: it holds none)."""
        if priority == INTERACTIVE:
            self.running[INTERACTIVE] += 1
            return
        waiter = _Waiter()
        self._waiting.append(waiter)
        self._grant()
        if not waiter.ready.done():  # its longest wait ends its wait
            asyncio.get_running_loop().call_later(BATCH_LONGEST_WAIT + 0.05, self._grant)
        try:
            await waiter.ready
        except asyncio.CancelledError:
            if waiter.ready.done() and not waiter.ready.cancelled():
                self.leave(priority)  # granted as it was cancelled: give the slot on
            else:
                self._waiting.remove(waiter)
            raise

    def leave(self, priority: str) -> None:
        self.running[priority] -= 1
        self._grant()

    def _grant(self) -> None:
        """Lets batch requests go on in order while the first may."""
        while self._waiting and self._may_go(self._waiting[0]):
            self._waiting.popleft().ready.set_result(None)
            self.running[BATCH] += 1

    def _may_go(self, first: _Waiter) -> bool:
        return (time.monotonic() - first.since >= BATCH_LONGEST_WAIT
                or (sum(self.running.values()) < self.slots
                    and self.running[BATCH] < self.batch_cap))
