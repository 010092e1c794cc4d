"""A stage slowed by a cgroup's CPU quota, greedy streams against it, and the cluster status
the rebalancer acts on."""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

# The local nodes differ a little by themselves on a shared machine (the last stage also runs
# the head): a threshold of 30% leaves that alone and moves for the throttle only.
LIVE_FLAGS = ("--nodes", "3", "--rebalance", "auto", "--rebalance-window", "6",
              "--rebalance-threshold", "0.3", "--rebalance-cooldown", "600")
CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
MAX_TOKENS = 1000
STREAMS = 8


@contextmanager
def cpu_quota(pids: list[int], share: float):
    """`pids` (whole processes, and the children they start later) limited to `share` of one
    CPU by a cgroup v1 quota, for the duration; the cgroup is removed after."""
    group = CGROUP_CPU / f"omlx-rebalance-test-{os.getpid()}"
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text(str(int(100000 * share)))
        for pid in pids:
            (group / "cgroup.procs").write_text(str(pid))
        yield group
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            try:
                (CGROUP_CPU / "cgroup.procs").write_text(pid)
            except ProcessLookupError:  # it exited meanwhile
                pass
        group.rmdir()


def cgroup_unavailable() -> str | None:
    """Why a cgroup v1 CPU quota cannot be set here, or None."""
    if not (CGROUP_CPU / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu controller at {CGROUP_CPU}"
    if not os.access(CGROUP_CPU, os.W_OK):
        return f"{CGROUP_CPU} is not writable (needs root)"
    return None


def references(url: str, model: str) -> list[str]:
    out: list = [None] * STREAMS

    def one(i: int) -> None:
        out[i] = httpx.post(url + "/v1/completions", json=body(model, i, False),
                            timeout=300).json()["choices"][0]["text"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return out


class Streams:
    """STREAMS greedy streams at once; every token's arrival time is kept (for tok/s)."""

    def __init__(self, url: str, model: str, headers: dict | None = None):
        self.headers = headers or {}
        self.texts: list = [None] * STREAMS
        self.errors: list[str] = []
        self.times: list[float] = []  # one per token, every stream
        self.progress = [0] * STREAMS
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._one, args=(url, model, i))
                        for i in range(STREAMS)]
        for t in self.threads:
            t.start()

    def _one(self, url: str, model: str, i: int) -> None:
        text = ""
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body(model, i, True),
                              headers=self.headers, timeout=300) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    d = json.loads(line[6:])
                    if "error" in d:
                        self.errors.append(str(d["error"]))
                    elif d.get("choices"):
                        text += d["choices"][0]["text"]
                        n = len((d["choices"][0].get("logprobs") or {}).get("tokens", []))
                        with self._lock:
                            self.progress[i] += n
                            self.times += [time.monotonic()] * n
        except httpx.HTTPError as e:
            self.errors.append(repr(e))
        self.texts[i] = text

    def join(self) -> None:
        for t in self.threads:
            t.join(300)

    def rate(self, start: float, end: float) -> float:
        """Tokens per second of every stream together between two instants."""
        with self._lock:
            n = sum(start <= t < end for t in self.times)
        return n / (end - start) if end > start else 0.0


def status(url: str) -> dict:
    return httpx.get(url + "/cluster/status", timeout=10).json()


def body(model: str, i: int, stream: bool) -> dict:
    # logprobs 0: each event lists its tokens. An event carries every token made since the last
    # one (a node's stream interval), so events are not tokens: a fast stream sends fewer.
    return {"model": model, "prompt": [5 + i, 6, 7 + i, 8, 9, 10 + 2 * i],
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": stream,
            "logprobs": 0}
