"""The bound on how many requests of one model the gateway holds at once, and the Retry-After
its refusals carry.

Every request the gateway admits holds memory (its prompt, its events, a slot in the node's
queue) until it ends, so past `limit` a request is refused at once with a 429 (Anthropic: 529),
before any prompt work: a refusal costs a fraction of a millisecond, a queued request seconds or
minutes of everyone's wait. Retry-After is how long the requests held now take to drain at the
rate requests finished recently, so that refused clients come back when there is room rather
than all at once a second later. The rate is per second of busy time (while anything was held):
a server idle all morning has not drained slowly. And per slot taken: the nodes run up to
`slots` sequences at once, so 32 held drain about 8 times faster at a batch of 8 than the one or
two that ran alone before a burst. Counted per busy second instead, a burst after a few
requests one at a time was told the 32 would take 32 of those requests' times, several times
longer than the queue took to drain.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass

from omlx_coordinator.errors import APIError

# A model's bound when none is given is this many batches (`omlx-cluster serve --help` says
# why), of a node's default --max-batch where the gateway does not know the nodes' own.
QUEUE_BATCHES, NODE_DEFAULT_BATCH = 4, 64
DEFAULT_MAX_QUEUE = QUEUE_BATCHES * NODE_DEFAULT_BATCH
# The error code of a refusal (OpenAI's, as for a quota: access.py); Anthropic's routes render
# an Overloaded as their 529.
OVERLOADED = "rate_limit_exceeded"
# Where a request's held places are noted in its ASGI scope, for `ReleaseWhenDone`, and its
# place among the undecided (`Arrivals`).
_SCOPE_KEY = "omlx.admitted"
_ARRIVAL_KEY = "omlx.undecided"
# The recent past the drain rate is measured over: long enough to count several completions
# of long generations, short enough to follow a change of load.
DRAIN_WINDOW_SECONDS = 60.0
# The longest a request counts among the undecided (`Arrivals`): far more than parsing a body and
# finding its model takes, even queued behind a burst's others.
UNDECIDED_SECONDS = 1.0
# Retry-After when nothing finished within the window (no rate to go by) ...
UNMEASURED_RETRY_SECONDS = 10
# ... and its range: a client told 0 comes back at once; one told an hour gives up.
MIN_RETRY_SECONDS, MAX_RETRY_SECONDS = 1, 120


@dataclass(frozen=True)
class Refusal:
    held: int  # requests (sequences) held when it came
    limit: int
    retry_after: int  # seconds


class Admission:
    """One model's requests held now, against its limit. A request of `n` choices holds n
    places: each is a sequence the node runs."""

    def __init__(self, limit: int, clock: Callable[[], float] = time.monotonic,
                 slots: int | None = None):
        """`slots`: how many of its sequences the nodes run at once (None: all it holds)."""
        if limit < 1:
            raise ValueError(f"the queue bound must be at least 1, got {limit}")
        self.limit, self._clock = limit, clock
        self.slots = max(1, slots or limit)
        self.held = 0
        self.refused = 0
        # Until `_busy_from`: seconds with something held, and the seconds of the slots taken
        # (each second counts min(held, slots)).
        self._busy, self._slot_seconds = 0.0, 0.0
        self._busy_from = clock()
        # (busy time, slot seconds) at each recent release, and at the last one forgotten.
        self._finished: deque[tuple[float, float]] = deque()
        self._since = (0.0, 0.0)

    def full(self, undecided: int = 0) -> bool:
        """Whether it is at its bound, with `undecided` requests counted as held."""
        return self.held + undecided >= self.limit

    def admit(self, n: int = 1) -> Refusal | None:
        """Holds `n` places and returns None, or refuses. A request wider than the whole bound
        is admitted alone (when nothing else is held): refused, it never could run."""
        n = min(n, self.limit)
        if self.held + n > self.limit:
            return self.refuse()
        self._advance()
        self.held += n
        return None

    def refuse(self, undecided: int = 0) -> Refusal:
        """The refusal of a request now (`undecided` others counted as held)."""
        self.refused += 1
        return Refusal(self.held + undecided, self.limit, self.retry_after())

    def release(self, n: int = 1) -> None:
        n = min(n, self.limit)
        now = self._advance()
        self.held -= n
        self._finished.extend([now] * n)
        self._forget(now[0])

    def drain_rate(self) -> float:
        """Sequences a second that what is held now finishes at: the recent window's
        finishes per slot-second, times the slots it takes; 0.0 when none finished."""
        busy, slot_seconds = self._advance()
        self._forget(busy)
        span = slot_seconds - self._since[1]
        if not self._finished or span <= 0:
            return 0.0
        return len(self._finished) / span * min(max(self.held, 1), self.slots)

    def retry_after(self) -> int:
        """Seconds until the requests held now have drained at the recent rate."""
        rate = self.drain_rate()
        if rate <= 0:
            return UNMEASURED_RETRY_SECONDS
        return max(MIN_RETRY_SECONDS, min(MAX_RETRY_SECONDS, math.ceil(self.held / rate)))

    def _advance(self) -> tuple[float, float]:
        """(seconds with something held, slot-seconds) so far: what the rate runs on."""
        now = self._clock()
        if self.held:
            self._busy += now - self._busy_from
            self._slot_seconds += (now - self._busy_from) * min(self.held, self.slots)
        self._busy_from = now
        return self._busy, self._slot_seconds

    def _forget(self, busy: float) -> None:
        while self._finished and self._finished[0][0] < busy - DRAIN_WINDOW_SECONDS:
            self._since = self._finished.popleft()


def default_bound(max_batch: int | None) -> int:
    """The bound for a model whose nodes decode `max_batch` sequences at once (None: unknown)."""
    return QUEUE_BATCHES * (max_batch or NODE_DEFAULT_BATCH)


def hold(scope: MutableMapping, admission: Admission, n: int = 1) -> None:
    """Admits the request whose ASGI `scope` this is for `n` places of `admission`, held until
    its response has been sent or abandoned; raises the 429 of a refusal."""
    Arrivals.decided(scope)
    refusal = admission.admit(n)
    if refusal is not None:
        raise overloaded(refusal)
    scope[_SCOPE_KEY].append((admission, n))


class Overloaded(APIError):
    """A refusal past a queue bound: the server's state, not the client's quota."""


def overloaded(refusal: Refusal, headers: dict[str, str] | None = None) -> Overloaded:
    """The 429 of `refusal` (Anthropic's routes render it as their 529), with its Retry-After
    and any other `headers`."""
    return Overloaded(429, f"the server is at its queue bound for this model ({refusal.held} of "
                         f"{refusal.limit} requests held): retry after {refusal.retry_after} s",
                    type="requests", code=OVERLOADED,
                    headers={"Retry-After": str(refusal.retry_after), **(headers or {})})


def all_full(admissions: list[Admission], undecided: int = 0) -> bool:
    """Whether every model is at its bound, `undecided` requests counted as held in each."""
    return bool(admissions) and all(a.full(undecided) for a in admissions)


def refuse_all_full(admissions: list[Admission], undecided: int = 0) -> Refusal | None:
    """A refusal when every model is at its bound, `undecided` requests counted as held in each
    (the soonest Retry-After of theirs), else None: a request may then be refused before its
    body is read, whichever model it names."""
    if not all_full(admissions, undecided):
        return None
    return min((a.refuse(undecided) for a in admissions), key=lambda r: r.retry_after)


class Arrivals:
    """Generation requests that are running but not yet admitted or refused: their model is
    unknown until their body has been read and parsed. Before a request runs at all, these
    count as held in every model (`refuse_all_full(..., arrivals.undecided)`), so that a burst
    of thousands arriving at once is refused from its headers beyond the first bound's worth,
    rather than each running until its model is known because nothing was admitted yet. The
    price: in a burst, a request may be refused that would have found room once the
    undecided ones turned out to name another model or to be invalid; it is told when to come
    back like any other refusal. A request counts for `window` seconds at most: one whose body
    comes slowly (a large prompt on a slow link, or a client that means harm) must not have
    every other refused meanwhile."""

    def __init__(self, window: float = UNDECIDED_SECONDS,
                 clock: Callable[[], float] = time.monotonic):
        self.window, self._clock = window, clock
        self._since: OrderedDict[object, float] = OrderedDict()  # arrival order

    @property
    def undecided(self) -> int:
        oldest = self._clock() - self.window
        while self._since and next(iter(self._since.values())) < oldest:
            self._since.popitem(last=False)
        return len(self._since)

    def arrived(self, scope: MutableMapping) -> None:
        """The request of `scope` runs now, undecided until `decided`."""
        token = object()
        scope[_ARRIVAL_KEY] = (self, token)
        self._since[token] = self._clock()

    @staticmethod
    def decided(scope: MutableMapping) -> None:
        """The request of `scope` was admitted, refused or ended (once; a no-op after)."""
        if (arrival := scope.pop(_ARRIVAL_KEY, None)) is not None:
            arrivals, token = arrival
            arrivals._since.pop(token, None)


class ReleaseWhenDone:
    """ASGI middleware: releases what each request held (and its undecided place) once the
    app is done with it, however it ended (sent, failed, a client gone mid-stream), since a stream's response outlives its
    route function."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held = scope[_SCOPE_KEY] = []
        try:
            await self.app(scope, receive, send)
        finally:
            Arrivals.decided(scope)  # ended without reaching admission: an error, a 404
            for admission, n in held:
                admission.release(n)
