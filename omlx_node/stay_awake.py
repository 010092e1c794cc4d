"""Keeps a Mac awake while its node agent holds a shard.

A Mac that idle-sleeps drops out of its plan (the coordinator re-plans without it) and misses
the next one. While a shard is loading or loaded the agent runs `caffeinate -i -w <agent pid>`:
a power assertion against idle system sleep that macOS keeps until caffeinate exits, and that
ends by itself with the agent (`-w`), however the agent ends. App Nap throttles apps that are
hidden and idle, not a command-line process, and launchd does not throttle the agent either as
the job of deploy/launchd runs it (ProcessType Interactive). A closed lid on battery sleeps all
the same: `omlx-cluster doctor` warns about the battery settings.

Off macOS there is nothing to hold: `hold` says so once in the log and does nothing.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

log = logging.getLogger(__name__)


def caffeinate_command(pid: int) -> list[str] | None:
    """The command that holds the assertion for as long as `pid` lives; None off macOS."""
    return ["caffeinate", "-i", "-w", str(pid)] if sys.platform == "darwin" else None


class StayAwake:
    """`hold()` when a shard loads, `release()` when none is loaded; both are idempotent."""

    def __init__(self, command: list[str] | None = None):
        self.command = command if command is not None else caffeinate_command(os.getpid())
        self._process: subprocess.Popen | None = None
        self._said = False

    @property
    def holding(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def hold(self) -> None:
        if self.command is None:
            if not self._said:
                log.info("not macOS: no power assertion to hold while a shard is loaded")
                self._said = True
            return
        if self.holding:
            return
        try:
            self._process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL,
                                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except OSError as e:  # no caffeinate: the Mac may sleep, the node still serves
            log.warning("cannot keep this Mac awake (%s): %s", " ".join(self.command), e)
            return
        log.info("holding a power assertion against idle sleep while a shard is loaded "
                 "(%s, pid %d)", self.command[0], self._process.pid)

    def release(self) -> None:
        if self._process is None:
            return
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None
        log.info("no shard loaded: released the power assertion")
