"""Waiting for a condition a live process brings about, bounded: every poll of a test goes
through `wait_for`, so none can hang (bench/soak.py's too: it raises AssertionError, not
pytest's outcome, so it needs no test session)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.2) -> T:
    """Polls `predicate` every `interval` seconds until it returns something truthy, and returns
    that; fails, naming `what`, after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)
    return value
