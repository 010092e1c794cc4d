"""`omlx-cluster coordinator` + `omlx-cluster join` over real mDNS, inside a private network
namespace: discovery, admission with the secret, losing a node, a coordinator restart."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omlx_shared.child import omlx_command
from tests.cluster_secret import OTHER_SECRET, SECRET
from tests.netns import namespace, netns_popen, netns_run, skip_unless_netns
from tests.helpers.processes import stop_all
from tests.helpers.waiting import wait_for

pytestmark = pytest.mark.slow

PORT = 8500  # inside the namespace: nothing else listens there


def http(ns: str, method: str, path: str, body: dict | None = None, timeout: float = 60) -> dict:
    """An HTTP call made from inside the namespace; returns {"status", "body"}."""
    script = (
        "import json, sys, urllib.request, urllib.error\n"
        "req = urllib.request.Request(sys.argv[1], method=sys.argv[2], data=(sys.argv[3] or None)"
        " and sys.argv[3].encode(), headers={'content-type': 'application/json'})\n"
        "try:\n"
        "    r = urllib.request.urlopen(req, timeout=float(sys.argv[4]))\n"
        "    print(json.dumps({'status': r.status, 'body': json.loads(r.read())}))\n"
        "except urllib.error.HTTPError as e:\n"
        "    print(json.dumps({'status': e.code, 'body': json.loads(e.read() or b'{}')}))\n"
        "except OSError as e:\n"
        "    print(json.dumps({'status': 0, 'body': {'error': str(e)}}))\n")
    r = netns_run(ns, [sys.executable, "-c", script, f"http://127.0.0.1:{PORT}{path}", method,
                       json.dumps(body) if body else "", str(timeout)],
                  capture_output=True, text=True, timeout=timeout + 30)
    return json.loads(r.stdout)


def status_when(ns: str, predicate, what: str, timeout: float = 60) -> dict:
    """The coordinator's /cluster/status, read from `ns`, once `predicate` holds for it."""
    def matching() -> dict | None:
        status = http(ns, "GET", "/cluster/status", timeout=5)["body"]
        return status if status.get("nodes") is not None and predicate(status) else None

    return wait_for(matching, timeout, what, interval=0.3)


def complete(ns: str, model: Path) -> dict:
    return http(ns, "POST", "/v1/completions", {
        "model": model.name, "prompt": [5, 6, 7, 8], "max_tokens": 16, "temperature": 0,
        "ignore_eos": True})


def start(ns: str, args: list[str], log: Path, secret: str | None = SECRET) -> subprocess.Popen:
    env = dict(os.environ, OMLX_CLUSTER_HOME=str(log.parent / "home"))
    env.pop("OMLX_CLUSTER_SECRET", None)
    cmd = omlx_command(*args) + (["--secret", secret] if secret else [])
    return netns_popen(ns, cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)


def seconds_between(log: str, first: str, second: str) -> float:
    """Seconds between the first log lines containing `first` and `second` (log timestamps)."""
    from datetime import datetime

    def when(text: str) -> datetime:
        line = next(ln for ln in log.splitlines() if text in ln)
        return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")

    return (when(second) - when(first)).total_seconds()


def alive_ids(status: dict) -> set[str]:
    return {n["id"] for n in status["nodes"] if n["alive"] and n["healthy"]}


def test_nodes_join_over_bonjour_and_survive_loss_and_restart(model, tmp_path):
    skip_unless_netns()
    with namespace("omlx-join") as ns:
        procs: list[subprocess.Popen] = []
        try:
            coord = start(ns, ["coordinator", "--model", str(model), "--port", str(PORT),
                               "--no-link-probe"],
                          tmp_path / "coordinator.log")
            procs.append(coord)
            nodes = {name: start(ns, ["join", "--name", name, "--port", str(port), *extra],
                                 tmp_path / f"{name}.log")
                     for name, port, extra in (("mac-a", 50061, []),
                                               ("mac-b", 50062, ["--hot-cache-max-size", "64MiB"]))}
            procs += nodes.values()
            # A node without the secret is refused and never planned: its certificate is not
            # from this cluster's CA, so the TLS handshake fails before any admission message
            # (which is why only the coordinator's log says so).
            rogue = start(ns, ["join", "--name", "rogue", "--port", "50063"],
                          tmp_path / "rogue.log", secret=OTHER_SECRET)
            procs.append(rogue)

            status = status_when(ns, lambda s: alive_ids(s) == {"mac-a", "mac-b"} and s["ready"]
                                 and all(n["layers"] for n in s["nodes"] if n["id"] != "rogue"),
                                 "both nodes to join and be planned")
            assert "rogue" not in {n["id"] for n in status["nodes"]}
            # Each node measured its speed and a layer's fixed cost when it joined; the planner
            # weighs the split by them.
            assert all(n["speed_gbps"] > 0.01 and n["layer_ms"] > 0
                       for n in status["nodes"]), status["nodes"]
            # And told the coordinator what its workers keep for their RAM prefix cache, which
            # the planner counts beside each stage's weights and KV.
            assert {n["id"]: n["worker_cache_bytes"] for n in status["nodes"]} == {
                "mac-a": 1 << 30, "mac-b": 64 << 20}
            r = complete(ns, model)
            assert r["status"] == 200, r
            reference = r["body"]["choices"][0]["text"]
            coordinator_log = (tmp_path / "coordinator.log").read_text()
            assert "node rogue (127.0.0.1:50063) does not hold this cluster's secret" in \
                coordinator_log and "TLS handshake failed" in coordinator_log

            # A node lost (its agent killed): detected within 5 s, re-planned over the other.
            # A plan later than the one both nodes served: the nodes may have joined one at a
            # time (a plan over mac-a alone, then one over both), and between the loss's
            # detection and the re-plan the old plan's status still reads ready.
            served = status["epoch"]
            t0 = time.monotonic()
            os.kill(nodes["mac-b"].pid, signal.SIGKILL)
            status = status_when(ns, lambda s: s["ready"] and alive_ids(s) == {"mac-a"}
                                 and s["epoch"] > served, "re-plan without mac-b", timeout=30)
            assert time.monotonic() - t0 < 15
            mac_a = next(n for n in status["nodes"] if n["id"] == "mac-a")
            assert mac_a["layers"] == [0, 4]
            assert complete(ns, model)["body"]["choices"][0]["text"] == reference

            # The coordinator restarts: the node is admitted again within 5 s.
            stop_all([coord])
            coord = start(ns, ["coordinator", "--model", str(model), "--port", str(PORT),
                               "--no-link-probe"],
                          tmp_path / "coordinator2.log")
            procs.append(coord)
            deadline = time.monotonic() + 60
            while http(ns, "GET", "/health", timeout=5)["status"] == 0:  # until it listens
                assert time.monotonic() < deadline
                time.sleep(0.2)
            status_when(ns, lambda s: "mac-a" in alive_ids(s), "mac-a to be admitted again",
                        timeout=30)
            # Measured in the coordinator's own log: from waiting for nodes to the admission
            # (this test's polling from inside the namespace is slower than that).
            log = (tmp_path / "coordinator2.log").read_text()
            assert seconds_between(log, "waiting for nodes", "node mac-a") < 5, log
            status_when(ns, lambda s: s["ready"], "a plan after the restart")
            assert complete(ns, model)["body"]["choices"][0]["text"] == reference

            # A node that cannot use multicast registers directly.
            procs.append(start(ns, ["join", "--name", "mac-c", "--port", "50064",
                                    "--no-announce", "--coordinator", f"127.0.0.1:{PORT}"],
                               tmp_path / "mac-c.log"))
            status = status_when(ns, lambda s: alive_ids(s) == {"mac-a", "mac-c"} and s["ready"]
                                 and all(n["layers"] for n in s["nodes"] if n["alive"]),
                                 "mac-c to register and be planned")
            assert complete(ns, model)["body"]["choices"][0]["text"] == reference
        finally:
            stop_all(procs)


def test_no_node_means_a_clear_503(model, tmp_path):
    skip_unless_netns()
    with namespace("omlx-join") as ns:
        coord = start(ns, ["coordinator", "--model", str(model), "--port", str(PORT)],
                      tmp_path / "c.log")
        try:
            deadline = time.monotonic() + 60
            r = {"status": 0}
            # Not listening yet (0), or listening while its start finishes (model_not_ready).
            while (r["status"] == 0 or (r.get("body") or {}).get("error", {}).get("code")
                   == "model_not_ready") and time.monotonic() < deadline:
                time.sleep(0.2)
                r = complete(ns, model)
            assert r["status"] == 503
            assert "no node has joined yet" in r["body"]["error"]["message"]
        finally:
            stop_all([coord])
