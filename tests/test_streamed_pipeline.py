"""A 2-stage pipeline of `join` nodes where one stage streams layers from its disk (issue 45):
a coordinator and two node agents on loopback, each with a `--weights-memory` that holds only
part of the model, planned so that the second node keeps three of its four layers on disk;
greedy answers equal to mlx-lm's generate_step."""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest

from omlx_coordinator.planning.model_layout import read_layout
from tests.conftest import free_port
from tests.helpers.processes import launch, status, stop_all
from tests.helpers.serving import expected, prompts_for
from tests.helpers.waiting import wait_for
from tests.tiny_models import build_model

pytestmark = pytest.mark.slow

TOKENS = 16


def replica(url: str) -> dict:
    models = status(url).get("models") or [{}]
    return (models[0].get("replicas") or [{}])[0]


def test_a_pipeline_stage_streaming_from_disk_answers_as_mlx_lm(tmp_path):
    model = build_model(tmp_path / "main", "llama", num_layers=6, hidden_size=64, seed=0)
    lay = read_layout(model)
    layer = max(lay.layer_bytes)
    # a holds the embedding and two layers, never three; b the head and one layer beside two
    # streamed layers' buffers: the only plans that fit are a [0, k) and b [k, 6) with b
    # streaming all but one of its layers (the planner picks k = 2: b streams 3).
    cap_a = lay.embed_bytes + 2 * layer + layer // 2
    cap_b = lay.head_bytes + lay.norm_bytes + 3 * layer + layer // 8
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    def join(name: str, cap: int) -> subprocess.Popen:
        return launch(["join", "--name", name, "--port", str(free_port()), "--no-announce",
                       "--coordinator", f"127.0.0.1:{port}", "--speed", "1",
                       "--hot-cache-max-size", "64MiB", "--weights-memory", f"{cap}B"],
                      tmp_path / f"home-{name}", tmp_path / f"{name}.log")

    procs = [launch(["coordinator", "--port", str(port), "--no-discovery", "--no-link-probe",
                     "--os-reserve",
                     "1GiB", "--model", f"main={model}"], tmp_path / "home-coordinator",
                    tmp_path / "coordinator.log"), join("a", cap_a)]
    try:
        # Nodes take their ring places in the order they are admitted: a first.
        wait_for(lambda: any(n["id"] == "a" for n in status(url).get("nodes") or []), 120,
                 "a to be admitted")
        procs.append(join("b", cap_b))
        served = wait_for(lambda: (r := replica(url)).get("ready") is True and r, 180,
                          "main served by a and b")
        assert [(s["node"], s["layers"]) for s in served["stages"]] == [
            ("a", [0, 2]), ("b", [2, 6])], served
        text = json.dumps(status(url))
        assert "Layers [3, 6) of b stream from its SSD" in text, text[:3000]

        prompts = prompts_for(model)
        for prompt, want in zip(prompts, expected(model, prompts, TOKENS)):
            r = httpx.post(f"{url}/v1/completions", timeout=120, json={
                "model": "main", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want, prompt
        assert "its disk reads" in (tmp_path / "b.log").read_text()
        worker_log = "".join(f.read_text() for f in (tmp_path / "home-b" / "logs").glob(
            "the-shard-worker-of-main-*.log"))
        assert "layers [2, 6) of main loaded" in worker_log, worker_log[-3000:]
        assert "the last 3 stream from disk" in worker_log, worker_log[-3000:]
    finally:
        stop_all(procs)

