"""Logging what outsiders send without letting them write the log.

A refused registration used to log the attacker's address at any length (each body's whole
size went into the log) and a line per refusal (a flood of refusals, a flood of lines). So
every string a client, a LAN peer or a Bonjour announcement controls goes through `cut` before
it is logged: at most ~200 characters, one line (control characters escaped, so a value cannot
forge a log line of its own). And refusals go through `Refusals`: one line a minute for each
source and reason, with a count of the rest.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

CUT_CHARS = 200
REFUSAL_INTERVAL_SECONDS = 60.0
REFUSAL_SOURCES = 256  # (source, reason) pairs remembered; more share one line
_CROWD = "(more sources)"  # the source that stands for every pair past REFUSAL_SOURCES


def cut(value: object, limit: int = CUT_CHARS) -> str:
    """`value` as one log-safe line of at most about `limit` characters, saying how long it
    was when it was longer."""
    text = value if isinstance(value, str) else str(value)
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    if len(text) <= limit and len(shown) <= limit:
        return shown
    return f"{shown[:limit]}... ({len(text)} characters)"


@dataclass
class _Window:
    started: float
    more: int = 0  # refusals since the line that opened this window


class Refusals:
    """Warnings about refused outsiders, one line a minute per (source, reason): the first at
    once, the rest of that minute counted and told in the next line for the pair (or, if none
    comes, in the line of the first refusal of any pair after the minute). At most
    REFUSAL_SOURCES pairs are remembered; past that, new ones share one pair, so neither the
    log nor this table grows with the number of sources an attacker uses. For one event loop
    (not thread-safe)."""

    def __init__(self, logger: logging.Logger, interval: float = REFUSAL_INTERVAL_SECONDS,
                 max_sources: int = REFUSAL_SOURCES,
                 clock: Callable[[], float] = time.monotonic):
        self.logger, self.interval, self.max_sources, self.clock = (logger, interval,
                                                                    max_sources, clock)
        self._windows: OrderedDict[tuple[str, str], _Window] = OrderedDict()  # oldest first

    def warning(self, source: str, reason: str, message: str, *args: object) -> None:
        """Logs `message % args` (cut them first) unless (source, reason) had its line this
        minute; then it only counts."""
        now = self.clock()
        carried = self._expire(now, (source, reason))
        key = (source, reason)
        if key not in self._windows and len(self._windows) >= self.max_sources:
            key = (_CROWD, reason)
        window = self._windows.get(key)
        if window is not None:
            window.more += 1
            return
        self._windows[key] = _Window(now)
        if carried:
            message += " (and %d more from %s in the last minute)"
            args += (carried, cut(source))
        self.logger.warning(message, *args)

    def _expire(self, now: float, current: tuple[str, str]) -> int:
        """Forgets the windows older than the interval, logging the count of each that has one,
        but the count of `current`'s, which is returned to go on its new line."""
        carried = 0
        while self._windows:
            key, window = next(iter(self._windows.items()))
            if now - window.started < self.interval:
                break
            del self._windows[key]
            if key == current:
                carried = window.more
            elif window.more:
                self.logger.warning("%d more refusals (%s) from %s in the last minute",
                                    window.more, key[1], cut(key[0]))
        return carried
