"""A child process that announces readiness by writing a JSON file, with its log kept for errors.

The coordinator starts node agents this way in `serve`, and a node agent its shard workers:
either side must report a child that fails to start with the child's own words, and never wait
for it without a deadline. Each child's output goes to its own file under
$OMLX_CLUSTER_HOME/logs/ (`node-agent-0-<time>-<pid>.log`, `shard-worker-...`), kept after it
exits so a crash can be read later; the newest LOGS_KEPT files stay, older ones are removed.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from omlx_shared.model_store import data_home
from omlx_shared.private_files import write_private

LOGS_KEPT = 100
KILL_WAIT_SECONDS = 10.0  # how long a stop waits for a killed child to be gone


class ChildError(RuntimeError):
    """The child exited or did not become ready in time; the message holds its log's tail."""


def write_ready(path: Path, info: dict) -> None:
    """Called by the child once it is ready; readers never see a half-written file."""
    write_private(path, json.dumps(info))


def omlx_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "omlx_cluster", *args]


class ChildProcess:
    def __init__(self, cmd: list[str], what: str, env: dict[str, str] | None = None,
                 stdin_pipe: bool = False):
        self._dir = tempfile.TemporaryDirectory(prefix="omlx-child-")
        self.ready_file = Path(self._dir.name) / "ready.json"
        self.log_path = _new_log(what)
        self.what = what
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([*cmd, "--ready-file", str(self.ready_file)],
                                         stdout=log, stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.PIPE if stdin_pipe else None)

    def rename(self, what: str) -> None:
        """Names the child (and its log file) for what it does now: a standby worker becomes
        a model's shard worker. The child keeps writing to the renamed file."""
        path = _log_name(self.log_path.parent, what)
        try:
            os.rename(self.log_path, path)
            self.log_path = path
        except OSError:  # pruned meanwhile: the child writes on to an unlinked file
            pass
        self.what = what

    def send_line(self, line: str) -> None:
        """Writes one line to the child's stdin and closes it (the child reads it once)."""
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self, timeout: float, abandoned: threading.Event | None = None) -> dict:
        """Blocks until the child wrote its ready file; raises ChildError if it exits first,
        the deadline passes or `abandoned` is set (and then stops it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if abandoned is not None and abandoned.is_set():
                self.stop(timeout=1.0)
                raise ChildError(f"{self.what}: its start was abandoned by whoever asked for it")
            if self.proc.poll() is not None:
                raise ChildError(f"{self.what} exited with code {self.proc.returncode}:\n"
                                 f"{self.log_tail()}")
            if self.ready_file.exists():
                return json.loads(self.ready_file.read_text())
            time.sleep(0.05)
        tail = self.log_tail()
        self.stop()
        raise ChildError(f"{self.what} was not ready within {timeout:.0f}s:\n{tail}")

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                # SIGKILL cannot be ignored, but a loaded machine may take a while to reap a
                # large process: wait past the grace, and never raise out of a stop.
                try:
                    self.proc.wait(max(timeout, KILL_WAIT_SECONDS))
                except subprocess.TimeoutExpired:
                    pass
        self._dir.cleanup()


def logs_dir() -> Path:
    return data_home() / "logs"


def _new_log(what: str) -> Path:
    folder = logs_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)  # logs hold what clients sent
    logs = []
    for p in folder.glob("*.log"):
        try:
            logs.append((p.stat().st_mtime, p))
        except FileNotFoundError:  # another process pruned it meanwhile
            pass
    for _, p in sorted(logs)[:max(0, len(logs) + 1 - LOGS_KEPT)]:
        p.unlink(missing_ok=True)
    path = _log_name(folder, what)
    path.touch(mode=0o600)
    return path


def _log_name(folder: Path, what: str) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "-", what.lower()).strip("-")[:80]
    return folder / f"{slug}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}.log"


def watch_parent(on_exit: Callable[[], None], interval: float = 1.0) -> None:
    """Calls `on_exit` (once, from a daemon thread) when the process that started us exits."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        on_exit()

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def on_stop_signals(stop: Callable[[], None]) -> None:
    """Calls `stop` (from a daemon thread) on each SIGTERM or SIGINT.

    A Python signal handler runs on the main thread between two of its bytecodes, maybe while
    that thread holds a lock the handler's work takes (a queue's, an Event's): it would wait
    for itself forever, and the process would ignore every later SIGTERM until its SIGKILL.
    The handler here only puts the signal on a SimpleQueue, whose put is reentrant; a thread
    of its own makes the call."""
    received: queue.SimpleQueue[int] = queue.SimpleQueue()

    def watch() -> None:
        while True:
            received.get()
            stop()

    threading.Thread(target=watch, name="stop-signals", daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: received.put(signum))
