"""The deploy/ files work: a real Prometheus, run on the shipped prometheus.yml, finds every
stage of a live 2-node `serve` through the coordinator's service discovery, and every query of
the shipped Grafana dashboard returns data from it. The launchd job runs `join`."""

from __future__ import annotations

import json
import math
import plistlib
import subprocess
import time

import httpx
import pytest

from tests.conftest import start_server
from tests.helpers.prometheus import (
    DEPLOY,
    NEEDS_PROMETHEUS,
    PROMTOOL,
    READY_TIMEOUT,
    SCRAPE_SECONDS,
    prometheus_config,
    run_prometheus,
)

KEY = "prometheus-test-key"
DATA_TIMEOUT = 90.0  # every dashboard query answered with data


def dashboard_queries() -> list[tuple[str, str]]:
    dash = json.loads((DEPLOY / "grafana" / "omlx-cluster.json").read_text())
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


def query(prometheus: str, expr: str) -> list[dict]:
    r = httpx.get(prometheus + "/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def has_data(result: list[dict]) -> bool:
    return any(math.isfinite(float(s["value"][1])) for s in result)


def wait_for_targets(prometheus: str, log_tail) -> list[dict]:
    """Every target up: the gateway and the two stages the discovery names."""
    deadline, active = time.monotonic() + READY_TIMEOUT, []
    while time.monotonic() < deadline:
        active = httpx.get(prometheus + "/api/v1/targets", timeout=10).json()["data"][
            "activeTargets"]
        if len(active) == 3 and all(t["health"] == "up" for t in active):
            return active
        time.sleep(0.5)
    pytest.fail(f"targets not all up: {json.dumps(active, indent=1)}\n{log_tail()}")


@pytest.mark.slow
@NEEDS_PROMETHEUS
def test_real_prometheus_scrapes_every_stage_and_the_dashboard_has_data(tiny_model_path,
                                                                         tmp_path):
    key_file = tmp_path / "omlx-api-key"
    key_file.write_text(KEY)
    auth = {"authorization": f"Bearer {KEY}"}
    with start_server(tiny_model_path, "--nodes", "2", "--api-key", KEY, "--protect-metrics",
                      "--cache-block-size", "16", home=tmp_path / "home") as server:
        gateway = server.url.removeprefix("http://")
        # The discovery is keyed like /cluster/status, and names both stages.
        assert httpx.get(server.url + "/cluster/prometheus-targets",
                         timeout=10).status_code == 401
        groups = httpx.get(server.url + "/cluster/prometheus-targets", headers=auth,
                           timeout=10).json()
        status = httpx.get(server.url + "/cluster/status", headers=auth, timeout=10).json()
        assert sorted(g["labels"]["stage"] for g in groups) == ["0", "1"]
        assert ({g["targets"][0] for g in groups}
                == {n["metrics"] for n in status["nodes"]})
        # --protect-metrics: the gateway's /metrics wants the admin key (Prometheus sends it).
        assert httpx.get(server.url + "/metrics", timeout=10).status_code == 401
        # Every endpoint passes Prometheus's own lint (names, types, help).
        for endpoint in [gateway, *(g["targets"][0] for g in groups)]:
            text = httpx.get(f"http://{endpoint}/metrics", headers=auth, timeout=10).text
            lint = subprocess.run([PROMTOOL, "check", "metrics"], input=text,
                                  capture_output=True, text=True, timeout=30)
            assert lint.returncode == 0 and not lint.stdout + lint.stderr.strip(), (
                endpoint, lint.stdout, lint.stderr)

        work = tmp_path / "prometheus"
        work.mkdir()
        with run_prometheus(prometheus_config(gateway, key_file), work) as prometheus:
            targets = wait_for_targets(prometheus, server.log_tail)
            nodes = sorted((t["labels"]["node"], t["labels"]["stage"]) for t in targets
                           if t["labels"]["job"] == "omlx-nodes")
            assert nodes == [("local0", "0"), ("local1", "1")]

            # Traffic after the first scrapes, so that every rate moves: the same long
            # prompt twice (the second restores its prefix from the cache), streamed too.
            prompt = "The capital of France is Paris. The capital of Italy is Rome. " * 4
            for stream in (False, True, False):
                r = httpx.post(server.base_url + "/completions", headers=auth, timeout=120,
                               json={"model": server.model_id, "prompt": prompt,
                                     "max_tokens": 24, "stream": stream})
                assert r.status_code == 200, r.text

            missing = dashboard_queries()
            deadline = time.monotonic() + DATA_TIMEOUT
            while missing and time.monotonic() < deadline:
                time.sleep(SCRAPE_SECONDS)
                missing = [(t, e) for t, e in missing if not has_data(query(prometheus, e))]
            assert not missing, f"dashboard queries without data: {missing}"

            # Each stage's series say which node, model, plan and layers they are of.
            series = query(prometheus, "omlx_node_stage_steps_total")
            identity = {(s["metric"]["node"], s["metric"]["stage"], s["metric"]["layers"],
                         s["metric"]["model"], s["metric"]["plan"]) for s in series}
            plan = status["plan"]
            assert identity == {(st["node"], str(rank), f"{st['layer_start']}:{st['layer_end']}",
                                 server.model_id, plan["plan_hash"])
                                for rank, st in enumerate(plan["stages"])}
            assert {s["metric"]["model"] for s in query(prometheus, "omlx_requests_total")} == {
                server.model_id}


def test_launchd_job_runs_join_and_keeps_the_secret_out_of_argv():
    plist = plistlib.loads((DEPLOY / "launchd" / "com.omlx-cluster.join.plist").read_bytes())
    args = plist["ProgramArguments"]
    assert args[0].endswith("/omlx-cluster") and args[1] == "join"
    assert "--secret" not in args  # ps would show it: it comes from the environment
    assert "OMLX_CLUSTER_SECRET" in plist["EnvironmentVariables"]
    assert plist["KeepAlive"] and plist["RunAtLoad"]
    from omlx_cluster.parser import build_parser

    build_parser().parse_args(args[1:])  # every flag exists
