"""A status text (what /health and `status` show) that is also a log line each time it changes.

`serve` printed "loading" and, seconds later, "loaded", while /health moved through "starting 2
node(s)" and "loading … (plan …)": the same texts in the log show where a start is, on a
terminal and in a log file alike.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("omlx_coordinator.status")


class LoggedStatus:
    """A descriptor: setting it to a new text logs `label(owner): text`; the first value (the
    constructor's) is not news."""

    def __init__(self, label: Callable[[Any], str]) -> None:
        self.label = label

    def __set_name__(self, owner: type, name: str) -> None:
        self.attr = f"_{name}"

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj, self.attr)

    def __set__(self, obj: Any, text: str) -> None:
        if getattr(obj, self.attr, text) != text:
            log.info("%s: %s", self.label(obj), text)
        setattr(obj, self.attr, text)
