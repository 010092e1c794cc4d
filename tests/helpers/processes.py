"""A coordinator and node agents as processes, each with its own log."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import httpx

from omlx_shared.child import omlx_command
from tests.cluster_secret import SECRET
from tests.conftest import descendants
from tests.helpers.waiting import wait_for
from tests.netns import netns_popen


def launch(args: list[str], home: Path, log: Path, ns: str | None = None) -> subprocess.Popen:
    """`omlx-cluster ARGS` with its own home and log; inside network namespace `ns` when given
    (tests/netns.py: `ip netns exec` execs it, so the pid is the process's own)."""
    env = dict(os.environ, OMLX_CLUSTER_HOME=str(home), OMLX_CLUSTER_SECRET=SECRET)
    command, out = omlx_command(*args), dict(stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    if ns is not None:
        return netns_popen(ns, command, env=env, **out)
    return subprocess.Popen(command, env=env, **out)


def settled_count(pid: int) -> int:
    """The node agent's processes below it once the count holds still for 3 s (a standby
    worker may be starting)."""
    counts: list[int] = []

    def steady() -> bool:
        counts.append(len(descendants(pid)))
        return len(counts) > 15 and len(set(counts[-15:])) == 1

    wait_for(steady, 60, "the node's processes to settle")
    return counts[-1]


def status(url: str) -> dict:
    """The coordinator's /cluster/status, {} while it does not answer."""
    try:
        r = httpx.get(f"{url}/cluster/status", timeout=5)
        return r.json() if r.status_code == 200 else {}
    except httpx.HTTPError:
        return {}


def stop_all(procs: list[subprocess.Popen]) -> None:
    """SIGTERM to every process still running, then up to 20 s each before a SIGKILL (and its
    reaping)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
