"""A real Prometheus scraping the cluster, where the binary is installed."""

from __future__ import annotations

import shutil
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import REPO, _stop, free_port

DEPLOY = REPO / "deploy"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
SCRAPE_SECONDS = 1
READY_TIMEOUT = 60.0  # Prometheus up and every target scraped
NEEDS_PROMETHEUS = pytest.mark.skipif(
    PROMETHEUS is None or PROMTOOL is None,
    reason="needs Prometheus and promtool on the PATH (Debian: apt-get install prometheus)")


def prometheus_config(gateway: str, key_file: Path) -> dict:
    """The shipped prometheus.yml, pointed at this machine's gateway and scraping faster."""
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    config["global"].update(scrape_interval=f"{SCRAPE_SECONDS}s",
                            evaluation_interval=f"{SCRAPE_SECONDS}s")
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert set(jobs) == {"omlx-gateway", "omlx-nodes"}
    jobs["omlx-gateway"]["static_configs"] = [{"targets": [gateway]}]
    (sd,) = jobs["omlx-nodes"]["http_sd_configs"]
    assert sd["url"].endswith("/cluster/prometheus-targets")
    sd.update(url=f"http://{gateway}/cluster/prometheus-targets", refresh_interval="1s")
    sd["authorization"]["credentials_file"] = str(key_file)
    jobs["omlx-gateway"]["authorization"]["credentials_file"] = str(key_file)
    return config


@contextmanager
def run_prometheus(config: dict, work: Path, port: int | None = None):
    """The `prometheus` binary on a loopback port (`port`, default a free one), its data in
    `work` (never the system's service); yields its base URL."""
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = port or free_port()
    log = open(work / "prometheus.log", "wb")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={work / 'prometheus.yml'}",
                             f"--storage.tsdb.path={work / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    log.close()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(url + "/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            pytest.fail(f"Prometheus did not start:\n{(work / 'prometheus.log').read_text()}")
        yield url
    finally:
        _stop(proc)


