"""The deploy/ files parse, and the dashboard graphs only metrics the services export."""

from __future__ import annotations

import json
import plistlib
import re
from pathlib import Path

import yaml

from omlx_coordinator.metrics import GatewayMetrics
from omlx_coordinator.weight_transfer import WeightCounters
from omlx_node.kv_metrics import KVCacheMetrics
from omlx_node.metrics import NodeMetrics

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
            "gauge": ("",)}


def exported_series() -> set[str]:
    names = set()
    for registry in (GatewayMetrics(WeightCounters()).registry, NodeMetrics().registry,
                     KVCacheMetrics().registry):
        for family in registry.collect():
            names.update(family.name + s for s in SUFFIXES[family.type])
    return names


def test_dashboard_graphs_only_exported_metrics():
    dash = json.loads((DEPLOY / "grafana" / "omlx-cluster.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"omlx(?:_node)?:[a-z_]+", e)}
    assert used, "no metric found in the dashboard"
    assert not used - exported_series(), sorted(used - exported_series())
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])


def test_prometheus_scrapes_gateway_and_nodes():
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert set(jobs) == {"omlx-gateway", "omlx-nodes"}
    node_ports = {t.rsplit(":", 1)[1] for c in jobs["omlx-nodes"]["static_configs"]
                  for t in c["targets"]}
    plist = plistlib.loads((DEPLOY / "launchd" / "com.omlx-cluster.join.plist").read_bytes())
    args = plist["ProgramArguments"]
    # The port the launchd job exports is the one Prometheus scrapes.
    assert node_ports == {args[args.index("--metrics-port") + 1]}


def test_launchd_job_runs_join_and_keeps_the_secret_out_of_argv():
    plist = plistlib.loads((DEPLOY / "launchd" / "com.omlx-cluster.join.plist").read_bytes())
    args = plist["ProgramArguments"]
    assert args[0].endswith("/omlx-cluster") and args[1] == "join"
    assert "--secret" not in args  # ps would show it: it comes from the environment
    assert "OMLX_CLUSTER_SECRET" in plist["EnvironmentVariables"]
    assert plist["KeepAlive"] and plist["RunAtLoad"]
    from omlx_cluster.cli import _build_parser

    _build_parser().parse_args(args[1:])  # every flag exists
