"""Partitions between the coordinator and a `join` node, made with network namespaces: node b
lives in a namespace of its own, joined to the coordinator's (and node a's) by a veth pair, and
`tc` on that pair slows or drops every packet while a greedy stream runs over a 2-stage
pipeline. A slow link loses nobody and changes no token, nor does a link dropped for a few
seconds (lost or not, b serves again); a cut one has b declared lost within
the heartbeat bound, the stream resumed on a alone with the same tokens, and once the link
heals b joins again: one plan over both, its old worker replaced (none left of the stale plan),
the same output."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest

from omlx_coordinator.nodes.cluster import (
    HEARTBEAT_SECONDS,
    NODE_LOST_SECONDS,
    Cluster,
    ClusterOptions,
)
from omlx_shared.child import omlx_command
from tests.cluster_secret import SECRET
from tests.conftest import descendants
from tests.helpers.processes import settled_count
from tests.helpers.waiting import wait_for
from tests.helpers.weights import agent_process
from tests.netns import (
    CUT,
    forward,
    in_namespace,
    link,
    namespace,
    netns_popen,
    route,
    shape,
    skip_unless_netns,
)
from tests.netns import slow as slow_link
from tests.tiny_models import build_model

pytestmark = pytest.mark.slow

KEY = "partition-test-key-2f7c1d9a4b6e8f03"  # the gateway listens off loopback: keyed
PORT, AGENT_PORT = 8000, 7100  # fresh namespaces: every port is free
TOKENS = 3000  # long enough that the cut lands mid-stream (a tiny model decodes fast)
PROMPT = [5, 6, 7, 8]
# Lost within this of the cut: the heartbeat's bound (a call times out after two beats, and a
# node is lost once silent NODE_LOST_SECONDS), with room for a machine shared with other work.
LOST_BOUND_SECONDS = NODE_LOST_SECONDS + 4 * HEARTBEAT_SECONDS + 5.0
DROP_SECONDS = 3.0  # a dropped link's time: a node may or may not be lost for it


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("partition")
    return {name: build_model(root / name, "llama", num_layers=4, seed=i)
            for i, name in enumerate(("main", "side"))}


class Api:
    """The gateway, called from threads inside its namespace."""

    def __init__(self, pool: ThreadPoolExecutor, url: str):
        self.pool, self.url = pool, url
        self.headers = {"Authorization": f"Bearer {KEY}"}

    def status(self) -> dict:
        def get() -> dict:
            try:
                r = httpx.get(f"{self.url}/cluster/status", headers=self.headers, timeout=5)
                return r.json() if r.status_code == 200 else {}
            except httpx.HTTPError:
                return {}
        return self.pool.submit(get).result(timeout=30)

    def complete(self, model: str = "main") -> str:
        def post() -> str:
            r = httpx.post(f"{self.url}/v1/completions", headers=self.headers, timeout=120,
                           json={"model": model, "prompt": PROMPT, "max_tokens": TOKENS,
                                 "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        return self.pool.submit(post).result(timeout=150)

    def stream(self, received: list[str]) -> Future:
        """A greedy stream; `received` grows by each chunk's text as it arrives. The future's
        result: the whole text, or the error event's message."""
        def run() -> str:
            body = {"model": "main", "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{self.url}/v1/completions", headers=self.headers,
                              json=body, timeout=httpx.Timeout(120, read=60)) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        return f"error: {event['error']}"
                    received.append(event["choices"][0]["text"])
            return "".join(received)
        return self.pool.submit(run)

    def unload(self, model: str) -> None:
        def post() -> None:
            r = httpx.post(f"{self.url}/cluster/models/{model}/unload", headers=self.headers,
                           timeout=60)
            assert r.status_code == 200, r.text
        self.pool.submit(post).result(timeout=90)

    def nodes(self) -> dict[str, dict]:
        return {n["id"]: n for n in self.status().get("nodes") or []}

    def planned_over(self, names: set[str]) -> bool:
        s = self.status()
        stages = {n["id"] for n in s.get("nodes") or [] if n["alive"] and n["layers"]}
        return s.get("ready") is True and stages == names


    def replicas_ready(self, model: str) -> list[bool]:
        return [r["ready"] for m in self.status().get("models") or [] if m["id"] == model
                for r in m["replicas"]]


def workers_of(api: Api, node: str, model: str = "main") -> list[dict]:
    return [w for w in api.nodes().get(node, {}).get("workers") or [] if w["model"] == model]


class Processes:
    """The cluster's processes, each started inside its namespace; all stopped on exit."""

    def __init__(self, tmp_path: Path, coordinator_at: str):
        self.tmp_path, self.coordinator_at = tmp_path, coordinator_at
        self.env = dict(os.environ, OMLX_CLUSTER_SECRET=SECRET, OMLX_CLUSTER_API_KEY=KEY)
        self.procs: list[subprocess.Popen] = []

    def launch(self, ns: str, name: str, *args: str) -> subprocess.Popen:
        p = netns_popen(ns, omlx_command(*args),
                        stdout=open(self.tmp_path / f"{name}.log", "wb"),
                        stderr=subprocess.STDOUT,
                        env=dict(self.env, OMLX_CLUSTER_HOME=str(self.tmp_path / f"home-{name}")))
        self.procs.append(p)
        return p

    def coordinator(self, ns: str, host: str, models: dict[str, Path], *flags: str) -> None:
        # Rebalancing off: a plan taking b back then splits by the nodes' calibrated speeds.
        # Measured on a loaded machine (a node timed while resumed streams prefill on it), they
        # once put main on b alone when b came back, no plan over a and b.
        self.launch(ns, "coordinator", "coordinator", "--host", host, "--port", str(PORT),
                    "--no-discovery", "--no-link-probe", "--os-reserve", "1GiB", "--rebalance",
                    "off", *flags,
                    *(f for name, path in models.items() for f in ("--model", f"{name}={path}")))

    def join(self, ns: str, name: str, host: str, coordinator_at: str = "") -> subprocess.Popen:
        return self.launch(ns, name, "join", "--name", name, "--host", host, "--port",
                           str(AGENT_PORT), "--no-announce", "--coordinator",
                           coordinator_at or self.coordinator_at, "--speed", "1",
                           "--hot-cache-max-size", "64MiB")

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *_) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def test_a_cut_node_is_lost_replanned_around_and_rejoins(models, tmp_path):
    skip_unless_netns()
    with namespace("omlx-hub") as hub, namespace("omlx-b") as nb:
        lk = link(hub, nb)
        coordinator_at = f"{lk.a_ip}:{PORT}"
        with Processes(tmp_path, coordinator_at) as cluster:
            cluster.coordinator(hub, lk.a_ip, models, "--replicas", "side=2")
            cluster.join(hub, "a", lk.a_ip)
            b = cluster.join(nb, "b", lk.b_ip)
            with in_namespace(hub) as pool:
                api = Api(pool, f"http://{coordinator_at}")
                wait_for(lambda: api.planned_over({"a", "b"}), 180, "a plan over a and b")
                reference = api.complete()
                # Two replicas of side, one a node: b's is lost with it, and comes back.
                side = api.complete("side")
                assert api.replicas_ready("side") == [True, True]
                assert len(workers_of(api, "b", "side")) == 1
                processes_b = settled_count(b.pid)

                # A slow link: heartbeats and tokens wait in a queue, nobody is lost.
                received: list[str] = []
                shape(lk, *slow_link("2mbit"))
                assert api.stream(received).result(timeout=180) == reference
                shape(lk)
                assert all(n["alive"] for n in api.nodes().values())

                # Dropped for a few seconds mid-stream, about the loss bound: whether b is lost
                # (its retransmits wait out TCP's backoff) or not, the stream ends identical,
                # and b serves in the plan again.
                received = []
                streamed = api.stream(received)
                wait_for(lambda: len(received) >= 1, 60, "the stream's first tokens")
                shape(lk, *CUT)
                time.sleep(DROP_SECONDS)
                shape(lk)
                assert streamed.result(timeout=180) == reference
                wait_for(lambda: api.planned_over({"a", "b"}), 120, "a plan over a and b again")
                assert api.complete() == reference

                # Cut mid-stream: b is lost within the bound, the stream resumes on a alone.
                stale = {w["pid"] for m in ("main", "side") for w in workers_of(api, "b", m)}
                received = []
                streamed = api.stream(received)
                wait_for(lambda: len(received) >= 1, 60, "the stream's first tokens")
                shape(lk, *CUT)
                cut_at, at_cut = time.monotonic(), len(received)
                wait_for(lambda: not api.nodes()["b"]["alive"], LOST_BOUND_SECONDS,
                         "b declared lost")
                assert time.monotonic() - cut_at < LOST_BOUND_SECONDS
                assert streamed.result(timeout=180) == reference
                assert len(received) > at_cut, "the stream had ended before the cut"
                assert api.planned_over({"a"})
                assert api.complete() == reference
                assert api.replicas_ready("side").count(True) == 1
                assert api.complete("side") == side

                # Healed: b registers again, one plan over both, its stale worker replaced.
                shape(lk)
                wait_for(lambda: api.planned_over({"a", "b"}), 120, "a plan over a and b again")
                assert api.complete() == reference
                wait_for(lambda: api.replicas_ready("side") == [True, True], 60,
                         "side's replica on b again")
                assert api.complete("side") == side
                assert settled_count(b.pid) == processes_b
                now = workers_of(api, "b") + workers_of(api, "b", "side")
                assert len(now) == 2 and not stale & {w["pid"] for w in now}, (stale, now)
                assert not stale & descendants(b.pid), "a worker of the stale plan lives on"

                # Unloaded while b is cut off: b's worker of it goes once b is back.
                shape(lk, *CUT)
                wait_for(lambda: not api.nodes()["b"]["alive"], LOST_BOUND_SECONDS,
                         "b declared lost")
                api.unload("side")
                shape(lk)
                wait_for(lambda: api.planned_over({"a", "b"}), 120, "a plan over a and b again")
                wait_for(lambda: not workers_of(api, "b", "side"), 30, "b's side worker gone")
                assert api.complete("side") == side


def test_a_client_replaced_on_readmission_fails_as_a_lost_node_does(tmp_path):
    """A node admitted again (back from a partition, or restarted on the same address) gets a
    new client; a recovery still holding the old one must see an RPC error it retries, not
    grpc's UsageError for a closed channel (the soak's "a recovery failed ... Channel is
    closed")."""
    with agent_process(tmp_path / "a", "mac-a") as (_, address):
        async def main() -> BaseException | None:
            cluster = Cluster(ClusterOptions(nodes=0, secret=SECRET))
            try:
                member = await cluster.add_remote(address, "mac-a")
                old = member.agent
                member.alive = False  # as the heartbeat leaves a node it lost
                assert await cluster.add_remote(address, "mac-a") is member
                assert member.agent is not old and member.alive
                try:
                    await old.health()
                except Exception as e:  # noqa: BLE001 - which error is the point
                    return e
                return None
            finally:
                await cluster.stop()

        error = asyncio.run(main())
    # Its session was replaced by the new admission: refused, as a lost node's call fails.
    assert isinstance(error, grpc.aio.AioRpcError), repr(error)
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED


DATA_CUT_SECONDS = 8.0  # longer than a node may be silent: the control plane must say it is not
STALL_TIMEOUT = 10  # seconds: a plan silent this long with requests is re-planned


def test_a_cut_between_stages_stalls_the_stream_which_ends_identical(models, tmp_path):
    """The data plane between a and b cut, the control plane up: a and b each reach the
    coordinator through the hub, and each other over a link of their own. Nobody is lost (both
    answer every heartbeat); the pipeline stays wedged after the heal (found here: it did until
    the request timed out, and so did every later request) until --stall-timeout re-plans it,
    and the stream ends with the reference's tokens."""
    skip_unless_netns()
    with namespace("omlx-hub") as hub, namespace("omlx-a") as na, namespace("omlx-b") as nb:
        to_a, to_b, direct = link(hub, na, "10.231.1"), link(hub, nb, "10.231.2"), link(
            na, nb, "10.231.3")
        forward(hub)
        route(na, "default", to_a.a_ip)
        route(nb, "default", to_b.a_ip)
        route(na, to_b.b_ip, direct.b_ip)  # a and b: over their own link, not the hub
        route(nb, to_a.b_ip, direct.a_ip)
        with Processes(tmp_path, f"{to_a.a_ip}:{PORT}") as cluster:
            cluster.coordinator(hub, "0.0.0.0", {"main": models["main"]}, "--stall-timeout",
                                str(STALL_TIMEOUT))
            cluster.join(na, "a", to_a.b_ip)
            cluster.join(nb, "b", to_b.b_ip, f"{to_b.a_ip}:{PORT}")
            with in_namespace(hub) as pool:
                api = Api(pool, f"http://{to_a.a_ip}:{PORT}")
                wait_for(lambda: api.planned_over({"a", "b"}), 180, "a plan over a and b")
                reference = api.complete()
                received: list[str] = []
                streamed = api.stream(received)
                wait_for(lambda: len(received) >= 1, 60, "the stream's first tokens")
                shape(direct, *CUT)
                cut_at = time.monotonic()
                while time.monotonic() - cut_at < DATA_CUT_SECONDS:
                    assert all(n["alive"] for n in api.nodes().values())
                    time.sleep(0.5)
                at_heal = len(received)
                shape(direct)
                # Wedged (a ring whose peer went silent does not resume by itself): re-planned
                # once silent past --stall-timeout, the stream resumed with the same tokens.
                assert streamed.result(timeout=120) == reference
                assert len(received) > at_heal, "the stream had ended before the heal"
                assert all(n["alive"] for n in api.nodes().values())
                assert api.complete() == reference
