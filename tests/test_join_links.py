"""A node's links measured at `join` (omlx_coordinator/nodes/link_survey.py): two nodes join a
coordinator over loopback; /cluster/status carries the measured link between them and each
one's round trip to the coordinator, `status` prints them, and the plan counts the link. Once
the reading is older than --link-max-age and the cluster is quiet, it is measured again."""

from __future__ import annotations

import subprocess
import sys

import pytest

from omlx_cluster.client import links_lines
from tests.conftest import free_port
from tests.helpers.processes import launch, status, stop_all
from tests.helpers.waiting import wait_for
from tests.tiny_models import build_model

pytestmark = pytest.mark.slow


def test_join_measures_the_link_between_nodes(tmp_path):
    model = build_model(tmp_path / "main", "llama", num_layers=2)
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    def join(name: str) -> subprocess.Popen:
        return launch(["join", "--name", name, "--port", str(free_port()), "--no-announce",
                       "--coordinator", f"127.0.0.1:{port}", "--speed", "0.001",
                       "--hot-cache-max-size", "64MiB"], tmp_path / f"home-{name}",
                      tmp_path / f"{name}.log")

    procs = [launch(["coordinator", "--port", str(port), "--no-discovery", "--os-reserve",
                     "1GiB", "--link-max-age", "2", "--model", f"main={model}"], tmp_path / "home-coordinator",
                    tmp_path / "coordinator.log"), join("a")]
    try:
        wait_for(lambda: any(n["id"] == "a" for n in status(url).get("nodes") or []), 120,
                 "node a admitted")
        procs.append(join("b"))

        def measured() -> dict | None:
            nodes = {n["id"]: n for n in status(url).get("nodes") or []}
            if "b" in nodes and "a" in (nodes["b"].get("links") or {}):
                return nodes
            return None

        nodes = wait_for(measured, 120, "b's link to a measured")
        link = nodes["b"]["links"]["a"]
        assert "error" not in link, link
        assert link["gb_per_s"] > 0 and 0 < link["latency_us"] < 100_000, link
        assert nodes["a"]["links"]["b"] == link  # one link, recorded on both nodes
        assert nodes["b"]["coordinator_rtt_ms"] > 0
        lines = links_lines(list(nodes.values()))
        assert any(line.startswith("link a <-> b: ") or line.startswith("link b <-> a: ")
                   for line in lines), lines
        # The CLI shows it too.
        out = subprocess.run([sys.executable, "-m", "omlx_cluster", "status", "--url", url],
                             capture_output=True, text=True, timeout=60)
        assert " <-> " in out.stdout and "GB/s" in out.stdout, out.stdout + out.stderr
        # The plan over both counts the measured link: a stage's "+ X ms link" is not 0. (At
        # the 1 MB/s the nodes claim, a layer's time dwarfs any link: the split is 2 stages.)
        wait_for(lambda: len(((status(url).get("plan") or {}).get("stages") or [])) == 2, 180,
                 "a plan over a and b")
        explanation = "\n".join(status(url)["plan"]["explanation"])
        assert "+ 0 ms link" not in explanation, explanation

        # No request, no load: the 2 s old reading is taken again (after the quiet the policy
        # waits for), still one link on both nodes.
        def remeasured() -> dict | None:
            nodes = {n["id"]: n for n in status(url).get("nodes") or []}
            again = nodes["b"]["links"]["a"]
            return nodes if again.get("measured_at", 0) > link["measured_at"] else None

        nodes = wait_for(remeasured, 90, "the link measured again while the cluster is quiet")
        again = nodes["b"]["links"]["a"]
        assert "error" not in again and again["gb_per_s"] > 0, again
        assert nodes["a"]["links"]["b"] == again
    finally:
        stop_all(procs)
