"""Make before break on a re-plan. A join: a model served by node a alone keeps serving (new
requests too) while its plan over a and a newly joined b loads, then switches; a rebalancer
move likewise from one split to another. A greedy stream across a join's move runs on the old
plan to its end (it never fails over and resumes); across the rebalancer's it resumes on the
faster split; either way with the same tokens, no request is refused or fails, and the old
plan's workers are unloaded after the switch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.conftest import free_port, start_server
from tests.helpers.moves import assert_retired, assert_served_through
from tests.helpers.processes import launch, status, stop_all
from tests.helpers.waiting import wait_for
from tests.tiny_models import build_model

pytestmark = pytest.mark.slow

TOKENS = 4000  # a stream that outlasts the switch (the context holds 4096)
PROMPT = [5, 6, 7, 8]


def ask(url: str, max_tokens: int) -> str:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": "main", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def stream(url: str, out: dict) -> None:
    body = {"model": "main", "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    text: list[str] = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body,
                          timeout=httpx.Timeout(120, read=60)) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    text.append(event["choices"][0]["text"] if "choices" in event
                                else f"<error {event}>")
                    out["chunks"] = len(text)
        out["text"], out["ended_at"] = "".join(text), time.time()
    except httpx.HTTPError as e:
        out["text"] = f"<{type(e).__name__}>"


def switched_at(url: str) -> float:
    """When (wall clock) the move's new plan began to serve, as the coordinator says: what a
    client notices later (a status read, a request) on a loaded machine."""
    moved = wait_for(lambda: status(url).get("last_recovery"), 30, "the move's record")
    assert moved.get("moved"), moved
    return moved["started_at"] + moved["seconds"]


def main_replica(url: str) -> dict:
    models = status(url).get("models") or [{}]
    return (models[0].get("replicas") or [{}])[0]


def test_a_join_moves_the_model_while_it_serves(tmp_path):
    # Wide enough that the stream outlasts the load of the plan over a and b: at the default
    # width its 4000 tokens took less than the 3 s the load took on a loaded 2-core machine.
    model = build_model(tmp_path / "main", "llama", num_layers=4, hidden_size=256)
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    def join(name: str) -> subprocess.Popen:
        return launch(["join", "--name", name, "--port", str(free_port()), "--no-announce",
                       "--coordinator", f"127.0.0.1:{port}", "--speed", "1",
                       "--hot-cache-max-size", "64MiB"], tmp_path / f"home-{name}",
                      tmp_path / f"{name}.log")

    procs = [launch(["coordinator", "--port", str(port), "--no-discovery", "--no-link-probe",
                     "--os-reserve",
                     "1GiB", "--model", f"main={model}"], tmp_path / "home-coordinator",
                    tmp_path / "coordinator.log"), join("a")]
    try:
        wait_for(lambda: main_replica(url).get("ready") is True, 120, "main served by a")
        reference, short = ask(url, TOKENS), ask(url, 8)
        epoch = main_replica(url)["epoch"]

        out: dict = {}
        streaming = threading.Thread(target=stream, args=(url, out))
        procs.append(join("b"))
        # Until the plan over both serves: main stays ready, and requests are answered; a
        # long stream starts on the old plan while the new one loads.
        not_ready, answers = 0, []
        deadline = time.monotonic() + 120
        while (replica := main_replica(url)).get("epoch") == epoch:
            assert time.monotonic() < deadline, "no plan over a and b within 120 s"
            not_ready += replica.get("ready") is not True
            if replica.get("status", "").startswith("loading") and streaming.ident is None:
                streaming.start()
            answers.append(ask(url, 8))
        moved_at = switched_at(url)
        assert not_ready == 0, f"main was not ready {not_ready} time(s) during the move"
        assert streaming.ident is not None, "the move was over before the stream could start"
        streaming.join(120)
        assert not streaming.is_alive()
        stages = [s["node"] for s in main_replica(url)["stages"]]
        assert sorted(stages) == ["a", "b"], stages
        # Nobody waited for the new plan: its stages loaded at the lowest priority (Linux).
        assert main_replica(url)["load"]["reason"] == "move"
        assert main_replica(url)["load"]["nice"] == max(
            19 if sys.platform == "linux" else 0, os.getpriority(os.PRIO_PROCESS, 0))
        assert out["text"] == reference
        assert out["ended_at"] > moved_at, "the stream ended before the switch"
        assert answers and all(a == short for a in answers)
        assert ask(url, TOKENS) == reference
        assert "moving main while it serves" in (tmp_path / "coordinator.log").read_text()
        assert_served_through(tmp_path / "coordinator.log", ["a"])
    finally:
        stop_all(procs)


def test_a_rebalancer_move_serves_until_the_new_split_is_loaded(tmp_path):
    """Two local nodes on an uneven split (1 and 7 layers); the rebalancer is asked to move to
    its best split while a long greedy stream runs: the model never reports not-ready, short
    requests keep their answers, the stream resumes on the new split, faster, with the same
    tokens, and the old split's workers are unloaded only after the switch."""
    model = build_model(tmp_path / "main", "llama", num_layers=8)
    # Speculation off: a pipeline head's drafting is work of every step that the rebalancer
    # reads as a slow node, and it then keeps the one-layer stage as small as it is.
    with start_server(model, "--nodes", "2", "--split", "1,7", "--rebalance", "advise",
                      "--rebalance-window", "3", "--rebalance-threshold", "0.01",
                      "--rebalance-cooldown", "0", "--speculative", "off",
                      home=tmp_path / "home",
                      keepalive=None) as server:
        url = server.url
        reference, short = ask(url, TOKENS), ask(url, 8)
        epoch = main_replica(url)["epoch"]
        before = [s["node"] for s in main_replica(url)["stages"]]
        out: dict = {}
        streaming = threading.Thread(target=stream, args=(url, out))
        streaming.start()
        wait_for(lambda: out.get("chunks", 0) >= 20, 60, "the stream under way")
        moving: dict = {}

        def move() -> None:
            # Speeds measured on a shared machine come and go: ask until it moves, or 90 s.
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and not moving.get("moved"):
                moving.update(httpx.post(url + "/cluster/rebalance", timeout=300).json())
                time.sleep(1)

        mover = threading.Thread(target=move)
        mover.start()
        not_ready, answers = 0, []
        while mover.is_alive():
            not_ready += main_replica(url).get("ready") is not True
            answers.append(ask(url, 8))
        assert moving.get("moved") is True, moving
        moved_at = switched_at(url)
        assert main_replica(url)["epoch"] > epoch
        assert not_ready == 0, f"main was not ready {not_ready} time(s) during the move"
        streaming.join(180)
        assert not streaming.is_alive()
        stages = [[s["node"], *s["layers"]] for s in main_replica(url)["stages"]]
        assert stages == moving["decision"]["proposed"], (stages, moving["decision"])
        assert out["text"] == reference
        assert out["ended_at"] > moved_at, "the stream ended before the switch"
        assert answers and all(a == short for a in answers)
        assert "moving main while it serves" in server.log_path.read_text()
        assert_retired(server.log_path, before)
