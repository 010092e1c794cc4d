"""A chaos soak: a mixed load against a cluster while a fault injector breaks it (issue 46, 5).

A `coordinator` with two `join` nodes (each process its own OMLX_CLUSTER_HOME, the tests'
cluster secret, an admin API key) serves two tiny random models, the main one a 2-stage
pipeline over both nodes. Node b runs in a network namespace of its own, joined to the hub's
(the coordinator's, node a's and this script's threads') by a veth pair (bench/soak_network.py,
tests/netns.py); where namespaces cannot be made (not root, no `ip` or `tc`) all of it runs on
loopback and no link is dropped. For `--minutes`:

- a bounded pool of client threads sends a mixed load: both APIs, streaming and not, long and
  short prompts, `n = 4`, a tool-call request, cancels (a stream closed after a few chunks),
  disconnects (a socket reset mid-stream), a slow reader; greedy requests are compared with
  references computed fault-free at the start;
- a seeded fault injector, every 20-60 s (every kind once a round, in a random order): SIGKILL
  a random shard worker, SIGKILL a join agent (started again with the same flags and home),
  SIGKILL the coordinator (started again), SIGSTOP a worker or agent for 5-15 s, fill a
  node's cache disk for 10-20 s (each node's SSD KV tier is on a tmpfs of its own, as root;
  a file takes it to 16 MiB from full, then goes), or drop b's link for 5-20 s (tc drops
  every packet on it: past the heartbeat's bound b is lost and main planned on a alone; once
  healed b joins again). Each fault's pause is the time until /health is 200 and a greedy
  request succeeds again;
- every 5 s, each process's RSS, open fds and threads from /proc, summed per role.

Writes soak-cpu.md, soak-cpu.svg and soak-cpu.json under --out. Not part of the test suite.

    python -m bench.soak --minutes 30 [--clients 4] [--seed 1] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import tempfile
import threading
import time
import traceback
from concurrent.futures import wait
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from bench.common import REPO, RESULTS
from bench.soak_network import Network, network
from bench.soak_report import (FAULTS, HOT_CACHE, RECOVERY_LIMIT, SAMPLE_EVERY, STAGE_GAUGES, Fault,
                               Outcome, report, report_again)
from tests.conftest import descendants, free_port
from tests.helpers.disks import fill, tmpfs, tmpfs_unavailable
from tests.helpers.processes import launch
from tests.helpers.waiting import wait_for
from tests.tiny_models import QWEN_TEMPLATE, build_model

KEY = "soak-" + secrets.token_urlsafe(24)
AUTH = {"Authorization": f"Bearer {KEY}"}
MODELS = ("main", "side")
SHORT = "Hello world! How are you today?"
LONG = " ".join(["The capital of France is Paris. A pipeline splits the layers of a model "
                 "across several machines."] * 40)
PROMPTS = {"short": SHORT, "long": LONG}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
GREEDY_TOKENS = 16
# A node's cache disk: the SSD tier keeps max(1 GiB, 5%) free, so a little more than that
# leaves it room until the fault's file takes it (a tmpfs holds memory only for what is in it).
CACHE_DISK = "1100m"
FULL_LEFT = 16 << 20  # bytes the fault leaves free: far inside the tier's reserve



@dataclass
class Cluster:
    root: Path
    port: int
    net: Network
    coordinator_args: list[str]
    node_args: dict[str, list[str]]
    coordinator: subprocess.Popen | None = None
    agents: dict[str, subprocess.Popen] = field(default_factory=dict)
    started: list[subprocess.Popen] = field(default_factory=list)
    seen_workers: set[int] = field(default_factory=set)
    restarts: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.net.host_of('coordinator')}:{self.port}"

    def start_coordinator(self) -> None:
        self.restarts += 1
        self.coordinator = launch(self.coordinator_args, self.root / "home-coordinator",
                                  self.root / f"coordinator-{self.restarts}.log",
                                  self.net.namespace_of("coordinator"))
        self.started.append(self.coordinator)

    def start_agent(self, name: str) -> None:
        n = sum(1 for p in self.root.glob(f"{name}-*.log")) + 1
        p = launch(self.node_args[name], self.root / f"home-{name}", self.root / f"{name}-{n}.log",
                   self.net.namespace_of(name))
        self.agents[name] = p
        self.started.append(p)

    def cache_dir(self, name: str) -> Path:
        """Node `name`'s SSD KV tier: a tmpfs of its own (`main`)."""
        return self.root / f"cache-{name}"

    def status(self) -> dict:
        try:
            r = httpx.get(f"{self.url}/cluster/status", headers=AUTH, timeout=5)
            return r.json() if r.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            return {}

    def workers(self) -> dict[str, list[int]]:
        """Each agent's processes below it (its shard workers), read from /proc: the
        coordinator may be down."""
        out = {}
        for name, p in self.agents.items():
            pids = sorted(descendants(p.pid)) if p.poll() is None else []
            self.seen_workers.update(pids)
            out[name] = pids
        return out

    def stop(self) -> None:
        for p in self.started:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.send_signal(signal.SIGTERM)
        for p in self.started:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        # Workers of agents killed with SIGKILL outlive them only when something is wrong;
        # ours alone (an omlx command line), never anything else.
        for pid in sorted(self.seen_workers):
            if ours(pid, self.root):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass


# A shard worker's command lines (worker_config.worker_process): imports at a load's priority
# (a standby, a fresh worker for a niced load) or not.
WORKER_COMMANDS = (b"-m\x00omlx_node.worker\x00", b"-m\x00omlx_node.standby\x00")


def ours(pid: int, root: Path) -> bool:
    """Whether `pid` is still one of this soak's workers (its home under `root`), not a
    process that reused its number."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
        return (any(c in command for c in WORKER_COMMANDS)
                and str(root).encode() in Path(f"/proc/{pid}/environ").read_bytes())
    except OSError:
        return False


def main_stages(status: dict) -> set[str]:
    """The live nodes with a stage of main's plan, while it is ready."""
    if status.get("ready") is not True:
        return set()
    return {n["id"] for n in status.get("nodes") or [] if n["alive"] and n["layers"]}


def alive(status: dict, node: str) -> bool | None:
    """Whether the coordinator counts `node` alive; None when it does not say."""
    return next((n["alive"] for n in status.get("nodes") or [] if n["id"] == node), None)


def planned(cluster: Cluster) -> bool:
    s = cluster.status()
    nodes = s.get("nodes") or []
    return (s.get("ready") is True and {n["id"] for n in nodes if n["alive"]} == {"a", "b"}
            and all(any(w["model"] == "main" for w in n["workers"]) for n in nodes))


# --- requests ------------------------------------------------------------------------------

def chat_body(model: str, prompt: str, greedy: bool, **extra) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": GREEDY_TOKENS}
    if greedy:
        body.update(temperature=0, ignore_eos=True)
    else:
        body.update(temperature=0.8)
    return {**body, **extra}


def messages_body(model: str, prompt: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": GREEDY_TOKENS, "temperature": 0, **extra}


def error_of(r: httpx.Response) -> str | None:
    """The error a 4xx/5xx body states, or None when it states none."""
    try:
        err = r.json().get("error")
    except (ValueError, AttributeError):
        return None
    if isinstance(err, dict):
        return f"{r.status_code} {err.get('type')}: {str(err.get('message'))[:160]}"
    return None


class StreamError(Exception):
    """A stream that ended with an error event."""


def sse_lines(r: httpx.Response):
    """A stream's lines as SSE defines them (CR, LF or CRLF ends one). Not httpx's
    iter_lines: it splits on U+2028, U+0085 and the like too, which orjson leaves raw inside
    JSON strings, so a random model's text would cut an event in two."""
    buf = b""
    for chunk in r.iter_bytes():
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode()
    if buf:
        yield buf.decode()


def read_stream(r: httpx.Response, api: str, t0: float, stop_after: int | None,
                slow: float, deadline: float) -> tuple[str, float | None, bool]:
    """(text, ttft, finished) of an SSE stream; raises StreamError on an error event and
    TimeoutError past the deadline."""
    text, ttft, chunks, finished = [], None, 0, False
    for line in sse_lines(r):
        if time.monotonic() > deadline:
            raise TimeoutError("past the request's deadline")
        if line.startswith("event: error"):
            raise StreamError(line)
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            finished = True
            break
        d = json.loads(data)
        if "error" in d or d.get("type") == "error":
            raise StreamError(json.dumps(d)[:200])
        piece = ""
        if api == "openai":
            for c in d.get("choices") or []:
                piece += (c.get("delta") or {}).get("content") or ""
        else:
            if d.get("type") == "content_block_delta":
                piece = d["delta"].get("text", "")
            if d.get("type") == "message_stop":
                finished = True
                break
        if piece:
            if ttft is None:
                ttft = time.monotonic() - t0
            text.append(piece)
            chunks += 1
            if stop_after is not None and chunks >= stop_after:
                return "".join(text), ttft, False
            if slow:
                time.sleep(slow)
    return "".join(text), ttft, finished


def disconnect_mid_stream(url: str, body: dict, deadline: float) -> str:
    """Sends a streaming request on a bare socket, reads a little, then resets the
    connection (SO_LINGER 0): a client that vanishes, not one that says goodbye."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    timeout = max(1.0, deadline - time.monotonic())
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                  b"Content-Type: application/json\r\nContent-Length: "
                  + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        got = b""
        while got.count(b"data: ") < 3 and time.monotonic() < deadline:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            chunk = s.recv(4096)
            if not chunk:
                break
            got += chunk
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        head = got.split(b"\r\n", 1)[0].decode(errors="replace")
    return head


KINDS = ("greedy_chat", "greedy_chat_stream", "greedy_messages", "greedy_messages_stream",
         "greedy_side", "sampled_stream", "n4", "tools", "cancel", "disconnect", "slow_reader")


def greedy_spec(kind: str, prompt: str) -> tuple[str, str, dict]:
    """(api, path, body) of a greedy kind, without `stream`."""
    if kind.startswith("greedy_messages"):
        return "anthropic", "/v1/messages", messages_body("main", PROMPTS[prompt])
    model = "side" if kind == "greedy_side" else "main"
    return "openai", "/v1/chat/completions", chat_body(model, PROMPTS[prompt], True)


def reference_key(kind: str, prompt: str) -> str:
    api, _, body = greedy_spec(kind, prompt)
    return f"{api}:{body['model']}:{prompt}"


def text_of(api: str, d: dict) -> str:
    if api == "openai":
        return d["choices"][0]["message"]["content"] or ""
    return "".join(b.get("text", "") for b in d["content"] if b.get("type") == "text")


def one_request(url: str, kind: str, prompt: str, refs: dict[str, str], limit: float,
                rng: random.Random) -> Outcome:
    t0 = time.monotonic()
    deadline = t0 + limit
    timeout = httpx.Timeout(limit, connect=10)
    o = Outcome(kind=f"{kind}/{prompt}", outcome="", start=t0, end=t0)
    try:
        if kind == "disconnect":
            body = chat_body("main", PROMPTS[prompt], False, max_tokens=64, stream=True)
            head = disconnect_mid_stream(url, body, deadline)
            o.outcome, o.detail = "cancelled", head
        elif kind.startswith("greedy"):
            api, path, body = greedy_spec(kind, prompt)
            ref = refs[reference_key(kind, prompt)]
            if kind.endswith("_stream"):
                with httpx.stream("POST", url + path, json={**body, "stream": True},
                                  headers=AUTH, timeout=timeout) as r:
                    if r.status_code != 200:
                        r.read()
                        return failed(o, r)
                    text, o.ttft, finished = read_stream(r, api, t0, None, 0, deadline)
                if not finished:
                    o.outcome, o.detail = "truncated", text[:80]
                else:
                    o.outcome = "identical" if text == ref else "different"
                    o.detail = "" if text == ref else f"got {text!r} want {ref!r}"
            else:
                r = httpx.post(url + path, json=body, headers=AUTH, timeout=timeout)
                if r.status_code != 200:
                    return failed(o, r)
                text = text_of(api, r.json())
                o.outcome = "identical" if text == ref else "different"
                o.detail = "" if text == ref else f"got {text!r} want {ref!r}"
        elif kind in ("n4", "tools"):
            extra = {"n": 4} if kind == "n4" else {"tools": TOOLS, "tool_choice": "auto"}
            body = chat_body("main", PROMPTS[prompt], False, **extra)
            r = httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH,
                           timeout=timeout)
            if r.status_code != 200:
                return failed(o, r)
            n = len(r.json()["choices"])
            o.outcome = "completed" if n == (4 if kind == "n4" else 1) else "malformed"
            o.detail = f"{n} choices"
        else:  # sampled_stream, cancel, slow_reader
            body = chat_body("side" if kind == "sampled_stream" and rng.random() < 0.3
                             else "main", PROMPTS[prompt], False, stream=True,
                             max_tokens=64 if kind == "cancel" else GREEDY_TOKENS)
            stop_after = 3 if kind == "cancel" else None
            slow = 0.5 if kind == "slow_reader" else 0
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=AUTH,
                              timeout=timeout) as r:
                if r.status_code != 200:
                    r.read()
                    return failed(o, r)
                text, o.ttft, finished = read_stream(r, "openai", t0, stop_after, slow,
                                                     deadline)
            if kind == "cancel":
                o.outcome = "cancelled" if not finished else "completed"
            else:
                o.outcome = "completed" if finished else "truncated"
    except StreamError as e:
        o.outcome, o.detail = "failed_clear", f"error event {e}"[:200]
    except (httpx.TimeoutException, TimeoutError, socket.timeout) as e:
        o.outcome, o.detail = "lost", f"{type(e).__name__} after {time.monotonic() - t0:.0f}s"
    except (httpx.TransportError, OSError) as e:
        o.outcome, o.detail = "connection_closed", f"{type(e).__name__}: {e}"[:200]
    except (ValueError, KeyError) as e:
        o.outcome, o.detail = "malformed", f"{type(e).__name__}: {e}"[:200]
    o.end = time.monotonic()
    return o


def failed(o: Outcome, r: httpx.Response) -> Outcome:
    err = error_of(r)
    o.outcome = "failed_clear" if err else "failed_unclear"
    o.detail = err or f"{r.status_code} {r.text[:160]!r}"
    o.end = time.monotonic()
    return o


def references(url: str) -> dict[str, str]:
    refs = {}
    for kind in ("greedy_chat", "greedy_messages", "greedy_side"):
        for prompt in PROMPTS:
            api, path, body = greedy_spec(kind, prompt)
            r = httpx.post(url + path, json=body, headers=AUTH, timeout=300)
            r.raise_for_status()
            refs[reference_key(kind, prompt)] = text_of(api, r.json())
    return refs


# --- faults ------------------------------------------------------------------------------



def recovered(cluster: Cluster, refs: dict[str, str], t_fault: float, f: Fault,
              stop: threading.Event) -> None:
    """Measures the pause: /health 200, then a greedy request answered identically."""
    limit = t_fault + RECOVERY_LIMIT
    ref = refs[reference_key("greedy_chat", "short")]
    _, path, body = greedy_spec("greedy_chat", "short")
    while time.monotonic() < limit and not stop.is_set():
        try:
            if httpx.get(cluster.url + "/health", timeout=5).status_code == 200:
                if f.health_after is None:
                    f.health_after = time.monotonic() - t_fault
                r = httpx.post(cluster.url + path, json=body, headers=AUTH, timeout=60)
                if r.status_code == 200 and text_of("openai", r.json()) == ref:
                    f.pause = time.monotonic() - t_fault
                    return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    f.detail += " never recovered within the limit"


def inject(cluster: Cluster, kind: str, rng: random.Random, stop: threading.Event) -> Fault:
    now = time.monotonic()
    if kind in ("kill_worker", "stop_worker"):
        pids = [(name, w["pid"]) for n in cluster.status().get("nodes") or []
                for name in [n["id"]] for w in n["workers"] if w.get("pid")]
        if not pids:  # the coordinator is down or no worker is known: read /proc instead
            pids = [(name, pid) for name, ps in cluster.workers().items() for pid in ps]
        if not pids:
            return Fault(kind, "none", now, detail="no worker to hit")
        name, pid = rng.choice(pids)
        target = f"worker {pid} on {name}"
        if kind == "kill_worker":
            os.kill(pid, signal.SIGKILL)
            return Fault(kind, target, now)
        return pause_process(pid, target, kind, rng, stop)
    if kind == "fill_disk":
        return fill_disk(cluster, rng, stop)
    if kind == "drop_link":
        return drop_link(cluster, rng, stop)
    if kind in ("kill_agent", "stop_agent"):
        name = rng.choice(sorted(cluster.agents))
        p = cluster.agents[name]
        if kind == "stop_agent":
            return pause_process(p.pid, f"agent {name}", kind, rng, stop)
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        time.sleep(1)  # as a person would: notice, then start it again
        cluster.start_agent(name)
        return Fault(kind, f"agent {name}", now)
    cluster.coordinator.send_signal(signal.SIGKILL)
    cluster.coordinator.wait(10)
    time.sleep(1)
    cluster.start_coordinator()
    return Fault(kind, "coordinator", now)


def pause_process(pid: int, target: str, kind: str, rng: random.Random,
                  stop: threading.Event) -> Fault:
    now = time.monotonic()
    length = rng.uniform(5, 15)
    os.kill(pid, signal.SIGSTOP)
    try:
        stop.wait(length)
    finally:
        os.kill(pid, signal.SIGCONT)
    return Fault(kind, target, now, detail=f"stopped {length:.1f}s")


def fill_disk(cluster: Cluster, rng: random.Random, stop: threading.Event) -> Fault:
    """A node's cache disk full for 10-20 s, then its space back."""
    now = time.monotonic()
    name = rng.choice(sorted(cluster.agents))
    filler = cluster.cache_dir(name) / "filler"
    length = rng.uniform(10, 20)
    size = fill(filler, FULL_LEFT)
    try:
        stop.wait(length)
    finally:
        filler.unlink()
    return Fault("fill_disk", f"cache disk of {name}", now,
                 detail=f"{size >> 20} MiB taken for {length:.1f}s")


def drop_link(cluster: Cluster, rng: random.Random, stop: threading.Event) -> Fault:
    """Node b's link cut for 5-20 s, then healed: every packet dropped, no RST, so its calls
    and streams only time out. Notes when the coordinator declared b lost and, when b had a
    stage of main, when main ran on a alone (a cut past the heartbeat's bound has b lost and
    main planned again without it)."""
    before = sorted(main_stages(cluster.status()))
    now = time.monotonic()
    length = rng.uniform(5, 20)
    seen: dict[str, float] = {}
    cluster.net.cut()
    try:
        while (left := now + length - time.monotonic()) > 0 and not stop.is_set():
            s = cluster.status()
            if alive(s, "b") is False:
                seen.setdefault("b lost", time.monotonic() - now)
            if "b" in before and main_stages(s) == {"a"}:
                seen.setdefault("main on a alone", time.monotonic() - now)
            stop.wait(min(1.0, left))
    finally:
        cluster.net.heal()
    cut_for = time.monotonic() - now
    notes = ", ".join(f"{what} after {t:.1f}s" for what, t in seen.items())
    return Fault("drop_link", "link of b", now, main_before=before,
                 detail=f"main on {'+'.join(before) or 'no ready plan'}; cut {cut_for:.1f}s: "
                        f"{notes or 'b never declared lost'}")


def rejoined(cluster: Cluster, f: Fault, stop: threading.Event) -> None:
    """After a dropped link: notes when b was alive again and, when it had a stage of main at
    the cut, when it had one again (a join keeps a plan that did not lose b: nothing to wait
    for then)."""
    back, replan = None, "b" in (f.main_before or [])
    while time.monotonic() < f.at + RECOVERY_LIMIT and not stop.is_set():
        s = cluster.status()
        if alive(s, "b"):
            if back is None:
                back = time.monotonic() - f.at
                f.detail += f"; b back after {back:.1f}s"
            if not replan:
                return
            if "b" in main_stages(s):
                f.detail += f", in main's plan after {time.monotonic() - f.at:.1f}s"
                return
        stop.wait(1)
    f.detail += "; b not back" if back is None else ", not in main's plan"
    f.detail += f" within {RECOVERY_LIMIT:.0f}s"


def injector(cluster: Cluster, refs: dict[str, str], rng: random.Random, end: float,
             faults: list[Fault], stop: threading.Event, gap: tuple[float, float]) -> None:
    next_at = time.monotonic() + rng.uniform(*gap)
    kinds = [k for k in FAULTS if k != "drop_link" or cluster.net.wire is not None]
    queue: list[str] = []
    while not stop.is_set() and time.monotonic() < end:
        if stop.wait(max(0.0, min(next_at, end) - time.monotonic())) or time.monotonic() >= end:
            return
        if not queue:  # every kind once a round, in a seeded order: short runs see them all
            queue = rng.sample(kinds, len(kinds))
        kind = queue.pop()
        try:
            f = inject(cluster, kind, rng, stop)
        except (OSError, subprocess.TimeoutExpired) as e:
            f = Fault(kind, "?", time.monotonic(), detail=f"{type(e).__name__}: {e}")
        faults.append(f)
        print(f"[{time.strftime('%H:%M:%S')}] fault {f.kind} {f.target} {f.detail}", flush=True)
        recovered(cluster, refs, f.at, f, stop)
        if f.kind == "drop_link":
            rejoined(cluster, f, stop)
        print(f"    pause {f.pause} {f.detail if f.kind == 'drop_link' else ''}", flush=True)
        next_at = f.at + rng.uniform(*gap)


# --- resources ---------------------------------------------------------------------------

def proc_stats(pid: int) -> tuple[int, int, int] | None:
    """(rss bytes, open fds, threads) of a live process."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    rss = int(fields.get("VmRSS", "0 kB").split()[0]) * 1024
    return rss, fds, int(fields["Threads"])




def stage_gauges(address: str) -> dict[str, float]:
    """STAGE_GAUGES read from a worker's metrics endpoint (host:port); {} when it does not
    answer (stopped, killed, loading)."""
    try:
        text = httpx.get(f"http://{address}/metrics", timeout=2).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        name, _, labels = series.partition("{")
        for (wanted, label), key in STAGE_GAUGES.items():
            if name == wanted and label in labels:
                out[key] = out.get(key, 0) + float(value)
    return out


def sample(cluster: Cluster, t0: float, metrics_of: dict[int, str]) -> dict:
    """Each role's sums, and each process's own (rss, fds, threads) under "procs", with a
    worker's STAGE_GAUGES under "stages" (`metrics_of`: worker pid -> its metrics endpoint,
    kept from /cluster/status while the coordinator is down)."""
    for n in cluster.status().get("nodes") or []:
        for w in n["workers"]:
            if w.get("pid") and w.get("metrics"):
                metrics_of[w["pid"]] = w["metrics"]
    roles: dict[str, list[int]] = {"coordinator": [cluster.coordinator.pid]}
    for name, p in cluster.agents.items():
        roles[f"agent {name}"] = [p.pid]
    current = cluster.workers()
    for name, pids in current.items():
        roles[f"workers {name}"] = pids
    # Workers of a killed agent still running: a leak (they should follow their agent).
    below = {pid for pids in current.values() for pid in pids}
    roles["orphaned workers"] = [pid for pid in cluster.seen_workers - below
                                 if ours(pid, cluster.root)]
    out: dict = {"t": round(time.monotonic() - t0, 1), "load": os.getloadavg()[0],
                 "procs": {}, "stages": {}}
    every: list[tuple[int, int, int]] = []
    for role, pids in roles.items():
        stats = []
        for pid in pids:
            if (st := proc_stats(pid)) is not None:
                stats.append(st)
                out["procs"][str(pid)] = [role, *st]
                if pid in metrics_of and (g := stage_gauges(metrics_of[pid])):
                    out["stages"][str(pid)] = g
        if role.startswith("workers"):
            every += stats
        out[role] = sums(stats)
    # Ranks move between the nodes on a re-plan: the workers' total is what compares over time.
    out["workers (all)"] = sums(every)
    return out


def sums(stats: list[tuple[int, int, int]]) -> dict[str, int]:
    return {"rss": sum(s[0] for s in stats), "fds": sum(s[1] for s in stats),
            "threads": sum(s[2] for s in stats), "procs": len(stats)}


def sampler(cluster: Cluster, t0: float, samples: list[dict], stop: threading.Event,
            end: float) -> None:
    metrics_of: dict[int, str] = {}
    while not stop.is_set() and time.monotonic() < end + 5:
        samples.append(sample(cluster, t0, metrics_of))
        stop.wait(SAMPLE_EVERY)


# --- load --------------------------------------------------------------------------------

def client(url: str, refs: dict[str, str], seed: int, end: float, limit: float,
           outcomes: list[Outcome], stop: threading.Event) -> None:
    rng = random.Random(seed)
    while not stop.is_set() and time.monotonic() < end:
        kind = rng.choice(KINDS)
        prompt = "long" if rng.random() < 0.25 else "short"
        outcomes.append(one_request(url, kind, prompt, refs, limit, rng))
        stop.wait(rng.uniform(0, 0.5))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--clients", type=int, default=4, help="client threads")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--deadline", type=float, default=180, help="seconds a request may take")
    ap.add_argument("--gap-min", type=float, default=20)
    ap.add_argument("--gap-max", type=float, default=60)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--machine-note", default="shared with other engineers' builds and tests",
                    help="what else ran on the machine, for the report")
    ap.add_argument("--report-from", type=Path, metavar="JSON",
                    help="write the report again from a run's soak-cpu.json (no run)")
    args = ap.parse_args()
    if args.report_from:
        report_again(args.report_from, args.out)
        return

    if (why := tmpfs_unavailable()) is not None:
        raise SystemExit(f"the soak fills the nodes' cache disks: {why}")
    root = Path(tempfile.mkdtemp(prefix="omlx-soak-"))
    print(f"logs and homes under {root}", flush=True)
    # Qwen's template: its tool-call markup lets the tool-call requests through.
    models = {name: build_model(root / name, "llama", num_layers=4, seed=i,
                                chat_template=QWEN_TEMPLATE)
              for i, name in enumerate(MODELS)}
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    outcomes: list[Outcome] = []
    faults: list[Fault] = []
    samples: list[dict] = []
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()
    t_start = time.monotonic()
    with network() as net, ExitStack() as disks:
        if net.wire is None:
            print(f"no link is dropped: {net.reason}", flush=True)
        cluster = make_cluster(root, models, net)
        # The soak's own threads run in the hub, where they reach the gateway.
        with net.threads(args.clients + 2) as pool:
            try:
                for name in cluster.node_args:
                    disks.enter_context(tmpfs(cluster.cache_dir(name), CACHE_DISK))
                    cluster.start_agent(name)
                cluster.start_coordinator()
                refs = pool.submit(prepare, cluster, stop).result()
                t_start = time.monotonic()
                end = t_start + args.minutes * 60
                rng = random.Random(args.seed)
                tasks = [pool.submit(client, cluster.url, refs, args.seed * 100 + i, end,
                                     args.deadline, outcomes, stop) for i in range(args.clients)]
                tasks.append(pool.submit(sampler, cluster, t_start, samples, stop, end))
                tasks.append(pool.submit(injector, cluster, refs, rng, end, faults, stop,
                                         (args.gap_min, args.gap_max)))
                # Clients finish their request in flight: at most the deadline past the end.
                done, _ = wait(tasks, max(0.0, end + args.deadline + RECOVERY_LIMIT
                                          - time.monotonic()))
                for t in done:
                    if t.exception() is not None:
                        print("a soak thread failed:", flush=True)
                        traceback.print_exception(t.exception())
            except KeyboardInterrupt:
                print("interrupted: cleaning up", flush=True)
            finally:
                stop.set()
                duration = time.monotonic() - t_start
                cluster.stop()
    no_link_drops = (None if net.wire is not None else "node b needs a network namespace of "
                     f"its own, and none could be made here: {net.reason}")
    # What the report is made from, first: should the analysis fail, --report-from remakes it.
    raw = root / "soak-raw.json"
    raw.write_text(json.dumps({
        "args": vars(args), "requests": [asdict(o) for o in outcomes],
        "faults": [asdict(f) for f in faults], "samples": samples,
        "duration_s": round(duration, 1), "commit": commit, "logs": str(root),
        "no_link_drops": no_link_drops}, default=str))
    print(f"raw results in {raw}", flush=True)
    report(args.out, args, outcomes, faults, samples, duration, commit, root, no_link_drops)
    print((args.out / "soak-cpu.md").read_text())


def make_cluster(root: Path, models: dict[str, Path], net: Network) -> Cluster:
    """Two join nodes and a coordinator over them, each listening where `net` puts it."""
    port = free_port()  # the hub's ports are all free: the host's free one is too
    at = f"{net.host_of('coordinator')}:{port}"
    return Cluster(
        root=root, port=port, net=net,
        coordinator_args=["coordinator", "--host", net.host_of("coordinator"), "--port",
                          str(port), "--no-discovery", "--os-reserve", "1GiB", "--api-key", KEY,
                          *(f for n, p in models.items() for f in ("--model", f"{n}={p}"))],
        node_args={name: ["join", "--name", name, "--host", net.host_of(name), "--port",
                          str(free_port()), "--no-announce", "--coordinator", at,
                          "--hot-cache-max-size", HOT_CACHE, "--orphan-grace", "120",
                          "--paged-ssd-cache-dir", str(root / f"cache-{name}")]
                   for name in ("a", "b")})


def prepare(cluster: Cluster, stop: threading.Event) -> dict[str, str]:
    """Waits for main's plan over both nodes; the greedy references, computed fault-free ({}
    when the soak was stopped meanwhile: Ctrl-C does not reach this thread)."""
    wait_for(lambda: stop.is_set() or planned(cluster), 180, "main planned over both nodes")
    if stop.is_set():
        return {}
    refs = references(cluster.url)
    print(f"references: {refs}", flush=True)
    layers = {n["id"]: [w["layers"] for w in n["workers"]] for n in cluster.status()["nodes"]}
    print(f"layers per node: {layers}", flush=True)
    return refs


if __name__ == "__main__":
    main()
