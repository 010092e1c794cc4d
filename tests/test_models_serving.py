"""Several models on one cluster, through a real `serve`: each token-identical to mlx-lm, loads
on demand, LRU eviction under a memory budget, leases, pinning, TTL, serialised loads, replicas
with prefix-affine routing and failover, and the errors around them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from tests.conftest import REPO, start_server
from tests.helpers.serving import (
    CACHE_FLAGS,
    N,
    card,
    complete,
    expected,
    one_fits,
    prompts_for,
    stream,
    two_models,
)
from tests.helpers.waiting import wait_for

pytestmark = pytest.mark.slow


def loaded_for(reason: str) -> dict:
    """A replica's `load` in /cluster/status when it loaded for `reason` (on Linux a nice
    value of 19 where nobody waited for it, 10 where requests did)."""
    waited = reason in ("requested", "recovery")
    nice = (10 if waited else 19) if sys.platform == "linux" else 0
    return {"reason": reason, "nice": max(nice, os.getpriority(os.PRIO_PROCESS, 0))}


def load_of(url: str, model: str) -> dict:
    status = httpx.get(url + "/cluster/status", timeout=10).json()
    return next(m for m in status["models"] if m["id"] == model)["replicas"][0]["load"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return two_models(tmp_path_factory.mktemp("served-models"))


def test_two_models_at_once_each_as_mlx_lm(models, tmp_path):
    """Both loaded at start; requests to both interleaved and concurrent; each model's answers
    are its own greedy mlx-lm output, reached by its name and by an alias."""
    a, b = models["alpha"], models["beta"]
    pa, pb = prompts_for(a), prompts_for(b)
    want = {"alpha": expected(a, pa), "beta": expected(b, pb)}
    with start_server(a, "--model", f"beta={b}", "--alias", "coder=beta",
                      home=tmp_path / "home") as server:
        listed = httpx.get(server.url + "/v1/models", timeout=10).json()["data"]
        assert [(m["id"], m["state"]) for m in listed] == [("alpha", "loaded"),
                                                            ("beta", "loaded")]
        jobs = [("alpha", i) for i in range(3)] + [("coder", i) for i in range(3)]
        jobs = [j for pair in zip(jobs[:3], jobs[3:]) for j in pair] * 2  # interleaved
        with ThreadPoolExecutor(6) as pool:
            outs = list(pool.map(lambda j: complete(
                server.url, j[0], (pa if j[0] == "alpha" else pb)[j[1]]), jobs))
        for (name, i), out in zip(jobs, outs):
            model = "alpha" if name == "alpha" else "beta"
            assert out["model"] == model  # an alias answers with the model's own name
            assert out["choices"][0]["text"] == want[model][i], (name, i)
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        assert 'omlx_model_loaded{model="alpha"} 1.0' in metrics
        assert 'omlx_model_loaded{model="beta"} 1.0' in metrics
        assert 'omlx_requests_total{endpoint="completions",model="beta",outcome="ok"}' in metrics
        status = httpx.get(server.url + "/cluster/status", timeout=10).json()
        # The main model loads for the requests that wait; beta, beside it, ahead of any.
        assert {m["id"]: m["replicas"][0]["load"] for m in status["models"]} == {
            "alpha": loaded_for("requested"), "beta": loaded_for("preload")}
        stages = {m["id"]: m["replicas"][0]["stages"] for m in status["models"]}
        assert all(s[0]["footprint_bytes"] > 0 for s in stages.values()), stages
        shown = subprocess.run([sys.executable, "-m", "omlx_cluster", "status", "--url",
                                server.url], capture_output=True, text=True, timeout=60,
                               cwd=REPO, env={**os.environ, "COLUMNS": "200"})
        assert shown.returncode == 0, shown.stderr
        rows = [line for line in shown.stdout.splitlines() if "local0 [0, " in line]
        assert any("alpha" in r and "loaded" in r for r in rows), shown.stdout
        assert any("beta (coder)" in r and "loaded" in r for r in rows), shown.stdout


def test_a_budget_for_one_evicts_the_least_recently_used(models, tmp_path):
    """--node-memory holds one model: a request for the other evicts the idle one, loads and
    answers; the first comes back on demand, with the same answers."""
    a, b = models["alpha"], models["beta"]
    pa, pb = prompts_for(a)[:1], prompts_for(b)[:1]
    want_a, want_b = expected(a, pa)[0], expected(b, pb)[0]
    with start_server(a, "--model", f"beta={b}", "--node-memory", one_fits(models), *CACHE_FLAGS,
                      home=tmp_path / "home") as server:
        assert card(server.url, "beta")["state"] == "unloaded"
        assert complete(server.url, "alpha", pa[0])["choices"][0]["text"] == want_a
        assert complete(server.url, "beta", pb[0])["choices"][0]["text"] == want_b
        assert (card(server.url, "alpha")["state"], card(server.url, "beta")["state"]) == (
            "unloaded", "loaded")
        assert load_of(server.url, "beta") == loaded_for("requested")  # a request waited
        assert complete(server.url, "alpha", pa[0])["choices"][0]["text"] == want_a
        assert card(server.url, "beta")["state"] == "unloaded"
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        assert 'omlx_model_unloads_total{model="alpha",reason="evicted"} 1.0' in metrics
        assert 'omlx_model_unloads_total{model="beta",reason="evicted"} 1.0' in metrics
        # One worker per node at any time: the evicted one's process is gone.
        workers = httpx.get(server.url + "/health", timeout=10).json()["nodes"][0]["workers"]
        assert [w["model"] for w in workers] == ["alpha"]


def test_a_leased_model_is_not_evicted_until_its_stream_ends(models, tmp_path):
    """A long stream on alpha while a request for beta needs alpha's memory: alpha finishes its
    stream whole, beta's client sees keep-alives meanwhile and then its answer."""
    a, b = models["alpha"], models["beta"]
    pa, pb = prompts_for(a)[0], prompts_for(b)[0]
    long_n = 1500  # seconds of decoding: beta waits that long
    want_a, want_b = expected(a, [pa], long_n)[0], expected(b, [pb])[0]
    with start_server(a, "--model", f"beta={b}", "--node-memory", one_fits(models), *CACHE_FLAGS,
                      home=tmp_path / "home") as server:
        results: dict[str, tuple] = {}
        t = threading.Thread(target=lambda: results.update(
            alpha=stream(server.url, "alpha", pa, long_n)))
        t.start()
        wait_for(lambda: card(server.url, "alpha")["leases"] == 1, 60, "alpha's stream")
        time.sleep(0.5)
        results["beta"] = stream(server.url, "beta", pb, N)
        t.join(300)
        text_a, _, alpha_done = results["alpha"]
        text_b, keepalives, beta_done = results["beta"]
        assert text_a == want_a  # not cut short by the eviction
        assert text_b == want_b and beta_done > alpha_done
        assert keepalives and keepalives[0] < alpha_done, "beta's client saw no keep-alive"
        status = httpx.get(server.url + "/cluster/status", timeout=10).json()
        unload = next(u for u in status["unloads"] if u["model"] == "alpha")
        assert unload["reason"] == "room for beta"
        assert card(server.url, "beta")["loaded_at"] >= time.time() - 300


def test_pinned_models_stay_and_idle_ones_time_out(models, tmp_path):
    """Pinned alpha is never evicted: beta, which would need its memory, is a 503 naming the
    shortfall. Without the pin, beta loads and its TTL unloads it once idle; a server whose
    every model its TTL unloaded stays healthy."""
    a, b = models["alpha"], models["beta"]
    pb = prompts_for(b)[0]
    budget = one_fits(models)
    with start_server(a, "--model", f"beta={b}", "--node-memory", budget, *CACHE_FLAGS,
                      "--pin", "alpha", home=tmp_path / "pinned") as server:
        r = httpx.post(server.url + "/v1/completions", json={
            "model": "beta", "prompt": pb, "max_tokens": 4}, timeout=60)
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "no_capacity"
        assert "beta" in error["message"] and "alpha" in error["message"]
        assert "GiB" in error["message"]
        assert card(server.url, "alpha")["state"] == "pinned"
    with start_server(a, "--model", f"beta={b}", "--ttl", "beta=2",
                      home=tmp_path / "ttl") as server:
        complete(server.url, "beta", pb)
        wait_for(lambda: card(server.url, "beta")["state"] == "unloaded", 30, "beta's ttl")
        assert card(server.url, "alpha")["state"] == "loaded"  # no ttl: stays
        assert complete(server.url, "beta", pb)["choices"][0]["text"]  # loads again
    # Every model unloaded by its TTL: still healthy (a load balancer that dropped it would
    # never send the request that loads one again).
    with start_server(b, "--ttl", "2", home=tmp_path / "all-idle") as server:
        wait_for(lambda: card(server.url, server.model_id)["state"] == "unloaded", 30, "the ttl")
        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 200 and health.json()["status"] == "ok", health.text
        assert complete(server.url, server.model_id, pb)["choices"][0]["text"]


def test_two_loads_on_one_node_run_one_after_the_other(models, tmp_path):
    a, b = models["alpha"], models["beta"]
    with start_server(a, "--model", f"beta={b}", home=tmp_path / "home") as server:
        for name in ("alpha", "beta"):
            r = httpx.post(f"{server.url}/cluster/models/{name}/unload", timeout=60)
            assert r.status_code == 200 and r.json()["state"] == "unloaded", r.text
        with ThreadPoolExecutor(2) as pool:
            cards = list(pool.map(lambda n: httpx.post(
                f"{server.url}/cluster/models/{n}/load", timeout=300).json(),
                ["alpha", "beta"]))
        assert all(c["state"] == "loaded" for c in cards), cards
        # /load is a preload: nobody waits for it yet.
        assert [load_of(server.url, n) for n in ("alpha", "beta")] == [loaded_for("preload")] * 2
        spans = sorted((c["loaded_at"] - c["load_seconds"], c["loaded_at"]) for c in cards)
        assert spans[0][1] <= spans[1][0] + 0.05, spans  # the second began after the first


def test_replicas_follow_their_prefix_and_survive_a_lost_replica(models, tmp_path):
    """Two replicas of one model on two nodes: each conversation's repeats and continuations
    land where its prefix is cached (cached_tokens > 0 every time), distinct conversations use
    both replicas, and a replica killed mid-stream loses no request."""
    a = models["alpha"]
    tok = AutoTokenizer.from_pretrained(str(a))
    conversations = [tok.encode(f"Conversation {i}: " + "the quick brown fox jumps " * 8)
                     for i in range(4)]
    with start_server(a, "--nodes", "2", "--replicas", "2", "--cache-block-size", "16",
                      home=tmp_path / "home") as server:
        replicas = card(server.url, "alpha")["replicas"]
        assert replicas == 2
        for convo in conversations:
            first = complete(server.url, "alpha", convo)
            text = first["choices"][0]["text"]
            follow = convo + tok.encode(text)
            for prompt in (convo, follow):
                usage = complete(server.url, "alpha", prompt)["usage"]
                assert usage["prompt_tokens_details"]["cached_tokens"] > 0, (prompt, usage)
        status = httpx.get(server.url + "/cluster/status", timeout=10).json()
        served = [r["requests"] for r in status["models"][0]["replicas"]]
        assert len(served) == 2 and all(n >= 3 for n in served), served

        # Kill one replica's worker while 6 streams run on both: every one completes whole.
        prompts = [conversations[i % 4] + [5 + i] for i in range(6)]
        want = expected(a, prompts, 60)
        health = httpx.get(server.url + "/health", timeout=10).json()
        victim = next(w["pid"] for n in health["nodes"] for w in n["workers"]
                      if n["id"] == "local1")
        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(stream, server.url, "alpha", p, 60) for p in prompts]
            time.sleep(1.0)
            os.kill(victim, signal.SIGKILL)
            outs = [f.result(timeout=300)[0] for f in futures]
        assert outs == want
        # Its sibling served meanwhile: the lost replica reloaded as nobody's wait.
        def replicas() -> list[dict]:
            return httpx.get(server.url + "/cluster/status", timeout=10).json()[
                "models"][0]["replicas"]

        wait_for(lambda: any(r["epoch"] > 1 for r in replicas())
                 and all(r["ready"] for r in replicas()), 120, "the lost replica back")
        loads = [r["load"] for r in replicas()]
        assert sorted(loads, key=lambda x: x["reason"]) == [loaded_for("replica"),
                                                             loaded_for("requested")]


def test_bad_model_requests(models, tmp_path):
    a, b = models["alpha"], models["beta"]
    home = tmp_path / "home"
    missing = tmp_path / "models.toml"
    missing.write_text(f'[[model]]\nname = "alpha"\npath = "{a}"\n\n'
                       f'[[model]]\nname = "ghost"\npath = "{tmp_path / "nowhere"}"\n')
    proc = subprocess.run([sys.executable, "-m", "omlx_cluster", "serve", "--models-config",
                           str(missing), "--port", "0"], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env={**os.environ, "OMLX_CLUSTER_HOME":
                                                      str(home)})
    assert proc.returncode == 2, proc.stderr
    assert "nowhere" in proc.stderr and "neither a model folder" in proc.stderr
    with start_server(a, "--model", f"beta={b}", "--speculative", "off", home=home) as server:
        r = httpx.post(server.url + "/v1/chat/completions", json={
            "model": "gamma", "messages": [{"role": "user", "content": "hi"}]}, timeout=10)
        assert r.status_code == 404
        assert r.json()["error"]["message"] == ("model 'gamma' is not served here; available: "
                                                "'alpha', 'beta' (GET /v1/models)")
        assert httpx.get(server.url + "/v1/models/gamma", timeout=10).status_code == 404
        # Unloading a model with a request in flight: 409, unless the caller waits for it.
        pa = prompts_for(a)[0]
        # Long enough to be seen in flight: speculative decoding makes short ones quick.
        t = threading.Thread(target=stream, args=(server.url, "alpha", pa, 3000))
        t.start()
        wait_for(lambda: card(server.url, "alpha")["leases"] == 1, 60, "alpha's stream")
        busy = httpx.post(server.url + "/cluster/models/alpha/unload", timeout=30)
        assert busy.status_code == 409, busy.text
        assert "1 request(s) in flight" in busy.json()["error"]["message"]
        waited = subprocess.run([sys.executable, "-m", "omlx_cluster", "models", "unload",
                                 "alpha", "--url", server.url, "--wait", "120"],
                                capture_output=True, text=True, timeout=180, cwd=REPO)
        t.join(120)
        assert waited.returncode == 0, waited.stderr
        assert waited.stdout.strip() == "alpha: unloaded"
        pinned = subprocess.run([sys.executable, "-m", "omlx_cluster", "models", "pin",
                                 "beta", "--url", server.url], capture_output=True, text=True,
                                timeout=60, cwd=REPO)
        assert pinned.stdout.strip() == "beta: loaded (pinned)", pinned.stdout + pinned.stderr
        shown = subprocess.run([sys.executable, "-m", "omlx_cluster", "models", "load",
                                "nope", "--url", server.url], capture_output=True, text=True,
                               timeout=60, cwd=REPO)
        assert shown.returncode == 2 and "'nope' is not served here" in shown.stderr
