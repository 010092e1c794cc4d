"""A pipeline stops cleanly: on SIGTERM the head drains what it is owed and sends STOP, and every
rank exits 0, both as bare worker processes and as the grandchildren of a 2-node `serve` (whose
exit codes the kernel's process-event connector reports: they are the agents' children)."""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from contextlib import contextmanager

import httpx
import pytest

from proto import omlx_pb2 as pb
from tests.conftest import start_server
from tests.helpers.pipeline import pipeline
from tests.helpers.session import SessionClient

pytestmark = pytest.mark.slow  # real processes signalled

# linux/connector.h and linux/cn_proc.h
NETLINK_CONNECTOR, CN_IDX_PROC, CN_VAL_PROC = 11, 1, 1
SO_RCVBUFFORCE = 33  # asm-generic/socket.h (root may pass the rmem_max cap)
PROC_CN_MCAST_LISTEN, PROC_EVENT_EXIT = 1, 0x80000000
_NLMSG = "=IHHII"  # len, type, flags, seq, pid
_CN_MSG = "=IIIIHH"  # idx, val, seq, ack, len, flags
_EVENT_AT = struct.calcsize(_NLMSG) + struct.calcsize(_CN_MSG)  # what, cpu, timestamp, data


@contextmanager
def exit_codes():
    """Yields `collect(pids, timeout)`: the exit codes ({pid: code}, a signal's death as
    -signal) of those of `pids` that exited since the context began, waiting up to `timeout`
    for the others. A thread reads every process exit on the machine meanwhile."""
    if os.geteuid() != 0:
        pytest.skip("the process-event connector needs root")
    try:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_CONNECTOR)
        sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 16 << 20)  # the machine is busy
        sock.bind((0, CN_IDX_PROC))
        body = struct.pack(_CN_MSG, CN_IDX_PROC, CN_VAL_PROC, 0, 0, 4, 0)
        body += struct.pack("=I", PROC_CN_MCAST_LISTEN)
        sock.send(struct.pack(_NLMSG, struct.calcsize(_NLMSG) + len(body), 3, 0, 0, 0) + body)
    except OSError as e:
        pytest.skip(f"no process-event connector here: {e}")
    codes: dict[int, int] = {}
    lost: list[OSError] = []
    exited = threading.Condition()
    sock.settimeout(0.2)

    def read() -> None:
        while sock.fileno() >= 0:
            try:
                data = sock.recv(65536)
            except socket.timeout:
                continue
            except OSError as e:  # ENOBUFS: events were dropped; EBADF: closed
                if sock.fileno() >= 0:
                    lost.append(e)
                return
            what, = struct.unpack_from("=I", data, _EVENT_AT)
            if what == PROC_EVENT_EXIT:
                pid, tgid, status = struct.unpack_from("=III", data, _EVENT_AT + 16)
                if pid == tgid:  # the process, not one of its threads
                    with exited:
                        codes[pid] = status >> 8 if status & 0x7F == 0 else -(status & 0x7F)
                        exited.notify_all()

    def collect(pids: set[int], timeout: float) -> dict[int, int]:
        with exited:
            exited.wait_for(lambda: pids <= codes.keys() or lost, timeout)
            assert not lost, f"the connector dropped process events: {lost[0]}"
            return {p: codes[p] for p in pids if p in codes}

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield collect
    finally:
        sock.close()
        reader.join(5)


def test_sigterm_stops_every_rank_with_code_0(model):
    """Both ranks get SIGTERM at once, as their agents send it, one stream still running."""
    with pipeline(model, [2, 2]) as (stub, workers), SessionClient(stub) as session:
        assert len(list(session.generate(pb.GenerateRequest(
            request_id="a", prompt_tokens=[5, 6, 7], max_tokens=8), timeout=60))) >= 1
        running = session.generate(pb.GenerateRequest(request_id="b", prompt_tokens=[5, 6, 7],
                                                      max_tokens=1800), timeout=60)
        next(running)
        for w in workers:
            w.proc.send_signal(signal.SIGTERM)
        last = list(running)[-1]
        codes = [w.proc.wait(30) for w in workers]
    assert last.finish_reason == "aborted"
    assert codes == [0, 0], [w.log_tail() for w in workers]
    for w in workers:
        log = w.log_path.read_text()
        assert "Traceback" not in log and "connection to a peer was lost" not in log, log
        assert "exits with code 0" in log.splitlines()[-1]


def test_a_two_node_serve_stops_every_worker_with_code_0(model, tmp_path):
    with exit_codes() as collect:
        with start_server(model, "--nodes", "2", home=tmp_path / "h") as server:
            r = httpx.post(server.url + "/v1/completions", timeout=60, json={
                "model": model.name, "prompt": "Hello", "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            nodes = httpx.get(server.url + "/health", timeout=10).json()["nodes"]
            workers = {n["worker_pid"] for n in nodes}
            agents = {n["agent_pid"] for n in nodes}
            assert len(workers) == 2 and None not in workers
        codes = collect(workers | agents, timeout=30)  # the server stopped (SIGTERM) above
    assert codes == {pid: 0 for pid in workers | agents}, (codes, server.log_tail())


# The main thread holds a lock nearly all the time, as an engine's does a queue's at moments;
# `stop` takes that lock.
HOLDS_A_LOCK = """
import threading
from omlx_shared.child import on_stop_signals
lock, stopped = threading.Lock(), threading.Event()

def stop():
    with lock:
        stopped.set()

on_stop_signals(stop)
print("ready", flush=True)
while not stopped.is_set():
    with lock:
        sum(range(20000))
"""


def test_a_sigterm_stops_a_process_whose_main_thread_holds_the_stop_lock():
    """A SIGTERM's handler runs on the main thread between two bytecodes, maybe inside a `with
    lock`: a handler that took the lock itself waited for its own thread, and the worker hung
    until its SIGKILL (a tensor stage's rank 0, once in CI). The stop runs on a thread of its
    own, and the process exits."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDS_A_LOCK], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait()
