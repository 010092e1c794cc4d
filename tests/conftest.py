pytest_plugins = ["tests.conftest_models"]

# Live-server fixtures: tiny random models and real `omlx-cluster serve` subprocesses.
#
# `server` (session) is one server on a tiny llama shared by the end-to-end tests; `start_server`
# starts another with its own model and flags (a context manager). Every wait is bounded, and a
# server's teardown checks that its node child process went away with it.

import os
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from omlx_node.metrics import IDENTITY_LABELS
from tests.tiny_models import build_model

REPO = Path(__file__).resolve().parent.parent
SERVER_START_TIMEOUT = 120.0  # seconds until GET /health answers 200
SERVER_STOP_TIMEOUT = 20.0  # seconds after SIGTERM before SIGKILL
CHILD_EXIT_TIMEOUT = 15.0  # seconds the node child may outlive its server


@pytest.fixture(scope="session", autouse=True)
def _own_home(tmp_path_factory) -> None:
    """No test writes into the user's real ~/.omlx-cluster: the whole session (and every
    process it starts) gets a temporary home unless a test sets its own."""
    os.environ["OMLX_CLUSTER_HOME"] = str(tmp_path_factory.mktemp("omlx-cluster-home"))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a live process, None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # the command name may contain spaces
    return fields[0], int(fields[1])


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (read from /proc, no psutil here)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            st = _proc_stat(int(entry.name))
            if st is not None:
                children.setdefault(st[1], []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in found:
                found.add(c)
                todo.append(c)
    return found


def alive(pid: int) -> bool:
    st = _proc_stat(pid)
    return st is not None and st[0] not in ("Z", "X")


@dataclass
class Server:
    """A running `omlx-cluster serve`."""

    url: str  # http://127.0.0.1:PORT
    model_id: str
    model_path: Path
    proc: subprocess.Popen
    log_path: Path
    node_metrics_url: str | None = None
    node_pids: set[int] = field(default_factory=set)

    @property
    def base_url(self) -> str:
        """What the openai client takes: the /v1 root."""
        return self.url + "/v1"

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def metrics(self) -> dict[str, float]:
        """The gateway's /metrics as {'name{label="v",...}': value} (parse_metrics)."""
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=10).text)

    def node_metrics(self) -> dict[str, float]:
        assert self.node_metrics_url, "start the server with node_metrics=True"
        return parse_metrics(httpx.get(self.node_metrics_url, timeout=10).text)


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[str, float]:
    """{'name{label="v",...}': value}, without the labels that name the model and the stage
    (IDENTITY_LABELS): one endpoint exports one stage of one model, and tests/test_deploy.py
    checks those labels in a real Prometheus."""
    out = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.groups()
        pairs = sorted(p for p in _LABEL.findall(labels or "") if p[0] not in IDENTITY_LABELS)
        if pairs:
            name += "{" + ",".join(f'{k}="{v}"' for k, v in pairs) + "}"
        out[name] = float(value)
    return out


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(SERVER_STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _kill_leftovers(pids: set[int]) -> set[int]:
    """Waits (bounded) for `pids` to exit; kills and returns those that did not."""
    deadline = time.monotonic() + CHILD_EXIT_TIMEOUT
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    left = {p for p in pids if alive(p)}
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


@contextmanager
def start_server(model_path: Path, *flags: str, home: Path, node_metrics: bool = False,
                 keepalive: float | None = 0.5, timeout: float = SERVER_START_TIMEOUT,
                 attempts: int = 3, scheme: str = "http"):
    """Starts `omlx-cluster serve --model model_path` on a free loopback port, waits until
    /health is 200, yields a Server; on exit stops it (SIGTERM, then SIGKILL) and asserts that no
    child process of it is left behind."""
    home.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMLX_CLUSTER_HOME=str(home), PYTHONUNBUFFERED="1")
    server = None
    for attempt in range(attempts):  # a free port can be taken before the server binds it
        port = free_port()
        cmd = [sys.executable, "-m", "omlx_cluster", "serve", "--model", str(model_path),
               "--port", str(port)]
        if keepalive is not None:
            cmd += ["--keepalive", str(keepalive)]
        node_url = None
        if node_metrics:
            node_port = free_port()
            cmd += ["--node-metrics-port", str(node_port)]
            node_url = f"http://127.0.0.1:{node_port}/metrics"
        cmd += list(flags)
        log_path = home / f"server-{port}.log"
        log = open(log_path, "wb")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        log.close()
        server = Server(f"{scheme}://127.0.0.1:{port}", model_path.name, model_path, proc,
                        log_path, node_url)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            try:  # (an https server's certificate is the test's to check)
                if httpx.get(server.url + "/health", timeout=2,
                             verify=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        if proc.poll() is None and time.monotonic() < deadline:
            break
        tail = server.log_tail()
        _stop(proc)
        _kill_leftovers(descendants(proc.pid))
        if "address already in use" in tail.lower() and attempt + 1 < attempts:
            continue
        pytest.fail(f"the server did not become healthy within {timeout:.0f}s "
                    f"(exit code {proc.poll()}):\n{tail}")
    assert server is not None
    server.node_pids = descendants(server.proc.pid)
    assert server.node_pids, "serve started no node child process"
    try:
        yield server
    finally:
        _stop(server.proc)
        left = _kill_leftovers(server.node_pids | descendants(server.proc.pid))
        assert not left, (f"processes {sorted(left)} outlived their server:\n"
                          f"{server.log_tail()}")


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> Path:
    """A tiny random llama (4 layers, hidden 64, ChatML tokenizer, context 2048)."""
    return build_model(tmp_path_factory.mktemp("models") / "tiny-llama", "llama", num_layers=4,
                       hidden_size=64, seed=0)


@pytest.fixture(scope="session")
def llama_2_layers(tmp_path_factory) -> Path:
    """The tiny llama with 2 layers (hidden 64, ChatML tokenizer, context 2048), built once a
    session."""
    return build_model(tmp_path_factory.mktemp("models") / "tiny-llama-2", "llama",
                       num_layers=2)


@pytest.fixture(scope="module")
def stage(tiny_model_path: Path):
    """The tiny llama as one stage of every layer (omlx_node.stage.StageRunner), one a module:
    what the KV cache tests prefill and decode with."""
    from omlx_node.stage import StageRunner

    return StageRunner(tiny_model_path)


@pytest.fixture(scope="module")
def vocab(stage) -> int:
    """The rows of `stage`'s embedding."""
    return stage.embed_tokens.weight.shape[0]


@pytest.fixture(scope="session")
def model(tiny_model_path: Path) -> Path:
    """The model a test runs unless its module defines a `model` of its own: the tiny llama,
    built once a session."""
    return tiny_model_path


@pytest.fixture(scope="session")
def server_home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("omlx-home")


@pytest.fixture(scope="session")
def server(tiny_model_path: Path, server_home: Path):
    """One live server on the tiny llama, shared by the session (node metrics exported)."""
    with start_server(tiny_model_path, home=server_home, node_metrics=True) as s:
        yield s


@pytest.fixture(scope="session")
def server_url(server: Server) -> str:
    """The shared server's base URL (http://127.0.0.1:PORT)."""
    return server.url
