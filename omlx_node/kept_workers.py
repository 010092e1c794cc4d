"""Workers of a model's previous plan, kept serving after a make-before-break move.

On a move (LoadShardRequest.keep_serving) the new worker loads while the old one serves; once
the new one is ready the coordinator switches new requests to it, but the requests already on
the old plan run there to their end: stopped at once, each would fail over and be prefilled
again on the new plan. So the old worker is kept, out of the agent's workers (Health reports
the new one), until the coordinator unloads it by pid, and stopped after the bound its load
named all the same, so that a coordinator that dies meanwhile leaves no worker behind.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from omlx_shared.child import ChildProcess

log = logging.getLogger(__name__)

# How long a kept worker serves at most when its load named no bound.
KEEP_DEFAULT_SECONDS = 120.0


@dataclass
class Kept:
    model_id: str
    pid: int  # the worker's, as its LoadShardReply said
    process: ChildProcess
    metrics_port: int  # the port its /metrics bound
    timer: threading.Timer


class KeptWorkers:
    """At most one kept worker a model (a second move ends the first one's requests). `stop`
    stops a process; it runs on the timer's thread when a bound passes."""

    def __init__(self, stop: Callable[[ChildProcess], None]):
        self._stop = stop
        self._lock = threading.Lock()
        self._kept: dict[int, Kept] = {}  # by pid

    def keep(self, model_id: str, pid: int, process: ChildProcess, metrics_port: int,
             seconds: float) -> list[ChildProcess]:
        """Keeps `process` serving for `seconds` at most (0: KEEP_DEFAULT_SECONDS); returns
        the model's worker kept before, if any, for the caller to stop."""
        before = self.take_model(model_id)
        timer = threading.Timer(seconds if seconds > 0 else KEEP_DEFAULT_SECONDS,
                                self._expire, (pid,))
        timer.daemon = True
        with self._lock:
            self._kept[pid] = Kept(model_id, pid, process, metrics_port, timer)
        timer.start()
        return before

    def take(self, pid: int) -> ChildProcess | None:
        """The kept worker of `pid`, no longer kept (None: none is)."""
        kept = self._pop(pid)
        return kept.process if kept is not None else None

    def _pop(self, pid: int) -> Kept | None:
        with self._lock:
            kept = self._kept.pop(pid, None)
        if kept is not None:
            kept.timer.cancel()
        return kept

    def take_model(self, model_id: str) -> list[ChildProcess]:
        with self._lock:
            pids = [k.pid for k in self._kept.values() if k.model_id == model_id]
        return [p for pid in pids if (p := self.take(pid)) is not None]

    def take_all(self) -> list[ChildProcess]:
        with self._lock:
            pids = list(self._kept)
        return [p for pid in pids if (p := self.take(pid)) is not None]

    def holds_port(self, port: int) -> bool:
        """Whether a kept worker still running holds /metrics port `port`."""
        with self._lock:
            return any(k.metrics_port == port and k.process.alive() for k in self._kept.values())

    def _expire(self, pid: int) -> None:
        if (kept := self._pop(pid)) is None:
            return
        log.warning("worker %d of %s's previous plan was kept serving to its bound and no "
                    "coordinator unloaded it: stopping it", pid, kept.model_id)
        self._stop(kept.process)
