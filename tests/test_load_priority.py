"""A worker's load runs on a thread of its own (Linux) at the nice value its reason sets: 19
where nobody waits for it (and in the SCHED_IDLE class), 10 where requests do; and the caller's
priority, on which the worker serves, is never lowered. Each thread's class and nice value are
read from /proc (the kernel's own account)."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import pytest

from omlx_node.load_priority import (
    BACKGROUND_LOAD_NICE,
    LOAD_NICE,
    at_low_priority,
    encode_nice,
    load_idle,
    load_nice,
    thread_idle,
    thread_nice,
)
from proto import omlx_pb2 as pb

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="a nice value is a thread's only on Linux")


# What each reason is for: whether requests wait for its load.
NOBODY_WAITS = {"LOAD_PRELOAD", "LOAD_REPLICA", "LOAD_MOVE"}
REQUESTS_WAIT = {"LOAD_REASON_UNSPECIFIED", "LOAD_REQUESTED", "LOAD_RECOVERY"}


def nice_of_this_thread() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def threads_of(pid: int | str = "self") -> dict[int, tuple[int, int, int]]:
    """Each thread of `pid`: its scheduling policy, nice value and CPU ticks so far, as
    /proc/PID/task/TID/stat says (fields 41, 19, 14 + 15)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            text = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except FileNotFoundError:  # ended meanwhile
            continue
        fields = text.rsplit(")", 1)[1].split()  # from field 3 on: a name may hold spaces
        out[int(tid)] = (int(fields[38]), int(fields[16]), int(fields[11]) + int(fields[12]))
    return out


def this_thread() -> tuple[int, int]:
    """The calling thread's (policy, nice value), from /proc."""
    return threads_of()[threading.get_native_id()][:2]


@pytest.fixture(autouse=True)
def default_classes(monkeypatch):
    """SCHED_IDLE as shipped, unless a test turns it off."""
    monkeypatch.delenv("OMLX_LOAD_IDLE", raising=False)


def test_each_reason_maps_to_its_priority(monkeypatch):
    monkeypatch.delenv("OMLX_LOAD_NICE", raising=False)
    monkeypatch.delenv("OMLX_BACKGROUND_LOAD_NICE", raising=False)
    assert set(pb.LoadReason.keys()) == NOBODY_WAITS | REQUESTS_WAIT  # a new one is placed
    assert {r: load_nice(pb.LoadReason.Value(r)) for r in pb.LoadReason.keys()} == {
        **{r: BACKGROUND_LOAD_NICE for r in NOBODY_WAITS}, **{r: LOAD_NICE for r in REQUESTS_WAIT}}
    assert (BACKGROUND_LOAD_NICE, LOAD_NICE) == (19, 10)
    assert load_nice(99) == LOAD_NICE  # a newer coordinator's reason: as if requests wait
    assert load_nice() == LOAD_NICE
    monkeypatch.setenv("OMLX_BACKGROUND_LOAD_NICE", "15")
    monkeypatch.setenv("OMLX_LOAD_NICE", "0")
    assert (load_nice(pb.LOAD_MOVE), load_nice(pb.LOAD_RECOVERY)) == (15, 0)


@pytest.mark.parametrize("reason", sorted(NOBODY_WAITS | REQUESTS_WAIT))
def test_the_loading_thread_runs_at_its_reasons_nice(monkeypatch, reason):
    monkeypatch.delenv("OMLX_LOAD_NICE", raising=False)
    monkeypatch.delenv("OMLX_BACKGROUND_LOAD_NICE", raising=False)
    mine = thread_nice()
    assert this_thread() == (os.SCHED_OTHER, mine)
    seen = at_low_priority(this_thread, nice=load_nice(pb.LoadReason.Value(reason)))
    # The idle class only where nobody waits: a failover's reload must not crawl.
    assert seen == ((os.SCHED_IDLE, max(mine, BACKGROUND_LOAD_NICE)) if reason in NOBODY_WAITS
                    else (os.SCHED_OTHER, max(mine, LOAD_NICE)))
    assert this_thread() == (os.SCHED_OTHER, mine) and thread_nice() == mine
    assert not thread_idle()


def test_sched_idle_off_or_refused_leaves_the_nice_value(monkeypatch, caplog):
    """OMLX_LOAD_IDLE=0: a load at its nice value only, as before; a kernel that refuses the
    class (a seccomp profile, here the refusal it would raise) logs it and keeps the nice."""
    mine = thread_nice()
    assert load_idle()
    monkeypatch.setenv("OMLX_LOAD_IDLE", "0")
    assert not load_idle()
    background = (os.SCHED_OTHER, max(mine, BACKGROUND_LOAD_NICE))
    assert at_low_priority(this_thread, nice=BACKGROUND_LOAD_NICE) == background
    monkeypatch.delenv("OMLX_LOAD_IDLE")

    def refused(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refused)
    assert at_low_priority(this_thread, nice=BACKGROUND_LOAD_NICE) == background
    assert "SCHED_IDLE refused" in caplog.text


def test_nothing_is_lowered_where_mlx_computes_on_a_gpu(monkeypatch):
    """On a GPU the first thread to use the device starts the device's own threads (the
    driver's, a stream's completion worker), which keep its class and nice value: a load there
    runs at the worker's priority, or every later decode step would wait on idle-class
    threads. Whether the GPU build is installed is the one thing faked here."""
    import omlx_node.load_priority as load_priority

    monkeypatch.setattr(load_priority, "mlx_on_cpu", lambda: False)
    monkeypatch.setenv("OMLX_BACKGROUND_LOAD_NICE", "19")
    mine = this_thread()
    assert {load_nice(r) for r in pb.LoadReason.values()} == {0} and encode_nice() == 0
    ran_on: list[int] = []

    def load() -> tuple[int, int]:
        ran_on.append(threading.get_native_id())
        return this_thread()

    assert at_low_priority(load, nice=load_nice(pb.LOAD_PRELOAD)) == mine
    assert ran_on == [threading.get_native_id()]


def test_the_load_runs_niced_and_the_caller_keeps_its_priority(monkeypatch):
    monkeypatch.delenv("OMLX_BACKGROUND_LOAD_NICE", raising=False)
    mine = nice_of_this_thread()
    seen: dict[str, object] = {}

    def load() -> mx.array:
        seen["nice"] = nice_of_this_thread()
        seen["thread"] = threading.get_native_id()
        weights = mx.arange(1000, dtype=mx.float32) * 2
        mx.eval(weights)
        return weights

    before = set(threads_of())
    weights = at_low_priority(load, nice=BACKGROUND_LOAD_NICE)
    assert seen["nice"] == max(mine, BACKGROUND_LOAD_NICE) and seen["thread"] != threading.get_native_id()
    assert nice_of_this_thread() == mine
    # The MLX stream it evaluated on: a thread it started, which inherited its class.
    started = {t: threads_of()[t][:2] for t in set(threads_of()) - before}
    assert started and set(started.values()) == {(os.SCHED_IDLE, max(mine, BACKGROUND_LOAD_NICE))}
    assert (weights + 1).sum().item() == sum(2 * i + 1 for i in range(1000))  # used here

    with pytest.raises(ValueError, match="no such weights"):
        at_low_priority(lambda: (_ for _ in ()).throw(ValueError("no such weights")))


def test_off_and_bad_settings(monkeypatch, caplog):
    monkeypatch.setenv("OMLX_LOAD_NICE", "0")
    assert load_nice() == 0
    here = threading.get_native_id()
    assert at_low_priority(threading.get_native_id) == here  # in place, as before
    assert at_low_priority(threading.get_native_id, elsewhere=False) == here
    monkeypatch.setenv("OMLX_LOAD_NICE", "7")
    assert load_nice() == 7
    monkeypatch.setenv("OMLX_LOAD_NICE", "low")
    assert load_nice() == LOAD_NICE and "OMLX_LOAD_NICE" in caplog.text
    monkeypatch.delenv("OMLX_ENCODE_NICE", raising=False)
    assert encode_nice() == 10
    seen = at_low_priority(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()),
                           nice=encode_nice())
    assert seen == max(10, nice_of_this_thread())


def test_a_whole_process_lowered_threads_and_all():
    """What an encoder worker does at its start: every thread, those started before too."""
    import subprocess

    script = (
        "import os, threading, time\n"
        "from omlx_node.load_priority import lower_this_process\n"
        "stop = threading.Event()\n"
        "early = threading.Thread(target=stop.wait); early.start()\n"
        "lower_this_process(10)\n"
        "late = threading.Thread(target=stop.wait); late.start()\n"
        "print(sorted({os.getpriority(os.PRIO_PROCESS, int(t))\n"
        "              for t in os.listdir('/proc/self/task')}))\n"
        "stop.set()\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.stdout.strip() == f"[{max(10, nice_of_this_thread())}]", out.stderr


def test_models_loaded_there_run_here(tmp_path, monkeypatch):
    """A cross-encoder (a head beside mlx-embeddings' model) and Whisper (private position
    tables) loaded on the niced thread answer on this one, as when loaded here: nothing is left
    lazy on the loading thread's stream."""
    import numpy as np

    from omlx_node.encoders import Encoder
    from omlx_node.transcriber import Transcriber
    from tests.tiny_encoders import build_encoder, build_whisper, tone_wav

    monkeypatch.delenv("OMLX_LOAD_NICE", raising=False)
    ce = build_encoder(tmp_path / "ce", "xlm-roberta", classifier=True)
    ids = [[5, 6, 7, 8], [9, 10]]
    np.testing.assert_allclose(at_low_priority(lambda: Encoder(ce)).run(ids),
                               Encoder(ce).run(ids), atol=1e-6)
    whisper = build_whisper(tmp_path / "whisper")
    audio = tone_wav(1.0)
    there = at_low_priority(lambda: Transcriber(whisper)).run(audio, language="en",
                                                             temperature=0.0)
    assert there.text == Transcriber(whisper).run(audio, language="en", temperature=0.0).text


def spy_nice(monkeypatch, owner, name: str, seen: list, read=thread_nice) -> None:
    """`owner.name` (the real function, for this test) records the nice value (or what `read`
    reads) of each thread it runs on."""
    real = getattr(owner, name)

    def spied(*args, **kwargs):
        seen.append(read())
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, spied)


@pytest.mark.parametrize("reason", [pb.LOAD_PRELOAD, pb.LOAD_REQUESTED])
def test_the_engines_calibration_runs_at_the_loads_nice(tmp_path, monkeypatch, reason):
    """Speculation's cost curve (a second of MLP timings) is measured on the loading thread at
    the load's nice value, and the engine that then serves on this thread measures nothing
    more; so does a pipeline head's curve by rows, which its micro-batches follow."""
    from omlx_node import calibrate, speculation
    from omlx_node.batcher import Batcher
    from omlx_node.constraints import Grammars
    from omlx_node.metrics import NodeMetrics
    from omlx_node.stage import StageRunner
    from omlx_node.worker import finish_load
    from omlx_node.worker_config import WorkerConfig
    from tests.tiny_models import build_model

    monkeypatch.delenv("OMLX_LOAD_NICE", raising=False)
    monkeypatch.delenv("OMLX_BACKGROUND_LOAD_NICE", raising=False)
    mine = thread_nice()
    expected = max(mine, BACKGROUND_LOAD_NICE if reason == pb.LOAD_PRELOAD else LOAD_NICE)
    path = build_model(tmp_path / "m", "llama", num_layers=2)
    stage = StageRunner(path)
    seen: list[int] = []
    built: list[int] = []
    spy_nice(monkeypatch, speculation, "row_costs", seen)
    spy_nice(monkeypatch, Grammars, "_build", built)
    config = WorkerConfig(path, "m", 0, None, load_reason=reason)
    assert config.engine.speculative == "auto"
    _, niced, by_rows = finish_load(config, stage, Grammars(path))
    assert (niced, seen, by_rows) == (expected, [expected], None)
    assert built == [expected]  # before the curve, which counts the process's CPU time
    batcher = Batcher(stage, NodeMetrics(), speculative="auto")
    assert seen == [expected] and batcher.speculator is not None
    assert thread_nice() == mine

    spy_nice(monkeypatch, calibrate, "row_costs", seen)
    head = WorkerConfig(path, "m", 0, 1, peers=("a:1", "b:2"), load_reason=reason)
    _, _, by_rows = finish_load(head, StageRunner(path, 0, 1), Grammars(path))
    assert seen == [expected] * 3 and len(by_rows) >= 2  # speculation's, then the rows'


def test_a_draft_model_loads_with_its_target_at_the_loads_priority(tmp_path, monkeypatch):
    """A `draft=PATH` engine's draft model (its tokenizer's check, its weights) loads on the
    loading thread, in the load's class and at its nice value; the engine that then serves on
    this thread takes that one and drafts with it here."""
    from omlx_node import draft_model
    from omlx_node.batcher import Batcher
    from omlx_node.constraints import Grammars
    from omlx_node.metrics import NodeMetrics
    from omlx_node.sequence import SeqRequest
    from omlx_node.stage import StageRunner
    from omlx_node.worker import finish_load
    from omlx_node.worker_config import WorkerConfig
    from omlx_shared.engine_config import EngineConfig
    from tests.helpers.speculation import run_one
    from tests.tiny_models import build_model

    monkeypatch.delenv("OMLX_BACKGROUND_LOAD_NICE", raising=False)
    mine = thread_nice()
    path = build_model(tmp_path / "m", "llama", num_layers=2)
    mode = f"draft={path}"  # itself: every draft token stands
    stage = StageRunner(path)
    seen: list[tuple[int, int]] = []
    spy_nice(monkeypatch, draft_model, "check_same_tokenizer", seen, this_thread)
    config = WorkerConfig(path, "m", 0, None, load_reason=pb.LOAD_PRELOAD,
                          engine=EngineConfig(speculative=mode))
    finish_load(config, stage, Grammars(path))
    assert seen == [(os.SCHED_IDLE, max(mine, BACKGROUND_LOAD_NICE))]
    batcher = Batcher(stage, NodeMetrics(), speculative=mode)
    assert len(seen) == 1 and batcher.speculator.drafter is not None
    tokens, reason, seq = run_one(batcher, SeqRequest("a", [5, 6, 7, 8], 16))
    assert (len(tokens), reason) == (16, "length")
    assert seq.spec.accepted == seq.spec.drafted > 0
    assert this_thread() == (os.SCHED_OTHER, mine)


def test_calibration_on_a_cpu_does_not_count_waiting_as_cost():
    """A load's calibration waits for the cores beside busy workers; row_costs times its calls
    (and its budget) in the process's CPU seconds, so waiting reads as no cost: a call that
    sleeps 20 ms costs far less, and a 50 ms budget still holds every row count."""
    from omlx_node.calibrate import row_costs

    if mx.default_device() != mx.cpu:
        pytest.skip("a GPU's calls are timed on the wall clock")

    def waits(x: mx.array) -> mx.array:
        time.sleep(0.02)
        return x + 1

    rows = (1, 2, 4, 8)
    costs = row_costs(waits, 16, "float32", rows=rows, repeats=3, budget_seconds=0.05)
    assert tuple(costs) == rows
    assert max(costs.values()) < 0.01


def test_the_grammar_tokenizer_builds_at_the_loads_nice(tmp_path, monkeypatch):
    """A worker's grammar tokenizer (built while its weights load) is built at the load's nice
    value, once: the first grammar then finds it."""
    from omlx_node.constraints import Grammars
    from tests.tiny_models import build_model

    seen: list[int] = []
    spy_nice(monkeypatch, Grammars, "_build", seen)
    grammars = Grammars(build_model(tmp_path / "m", "llama", num_layers=1))
    grammars.warm(BACKGROUND_LOAD_NICE)
    deadline = time.monotonic() + 60
    while not seen:
        assert time.monotonic() < deadline, "the tokenizer was never built"
        time.sleep(0.01)
    assert not grammars.matcher('{"grammars": [{"lark_grammar": "start: \\"a\\""}]}').error
    assert seen == [max(thread_nice(), BACKGROUND_LOAD_NICE)]


def test_a_pipeline_tail_builds_its_grammar_tokenizer_as_it_loads(tmp_path, monkeypatch):
    """A pipeline's tail applies grammars: its tokenizer is built as part of its load, on the
    loading thread in the load's class, not left to a thread that the first request to need
    it would wait for."""
    from omlx_node.constraints import Grammars
    from omlx_node.stage import StageRunner
    from omlx_node.worker import finish_load
    from omlx_node.worker_config import WorkerConfig
    from tests.tiny_models import build_model

    monkeypatch.delenv("OMLX_BACKGROUND_LOAD_NICE", raising=False)
    path = build_model(tmp_path / "m", "llama", num_layers=2)
    built: list[tuple[int, int]] = []
    spy_nice(monkeypatch, Grammars, "_build", built, this_thread)
    tail = WorkerConfig(path, "m", 1, 2, rank=1, peers=("a:1", "b:2"),
                        load_reason=pb.LOAD_REPLICA)
    finish_load(tail, StageRunner(path, 1, 2), Grammars(path))
    assert built == [(os.SCHED_IDLE, max(thread_nice(), BACKGROUND_LOAD_NICE))]


def wait_imported(standby, timeout: float = 120.0) -> dict:
    """What a standby worker wrote once it imported the worker's modules."""
    import json

    from omlx_node.standby import IMPORTED, imported

    deadline = time.monotonic() + timeout
    while not imported(standby.ready_file):
        assert standby.alive(), standby.log_tail()
        assert time.monotonic() < deadline, "the standby did not import in time"
        time.sleep(0.05)
    return json.loads(standby.ready_file.with_name(IMPORTED).read_text())


@pytest.mark.slow  # a worker process that loads a model and serves
@pytest.mark.parametrize("standby", [True, False], ids=["standby", "fresh"])
def test_a_worker_imports_and_loads_idle_and_serves_at_its_own_priority(tmp_path, monkeypatch,
                                                                        standby):
    """A worker imports MLX and mlx-lm on a thread of its own in the SCHED_IDLE class: the
    agent's standby at a background load's nice value, a worker started fresh for a job at
    that job's load's; its main thread keeps the agent's priority, and no thread is left at
    the imports'. The job loads at its reason's nice, and every thread that then serves (those
    whose CPU time grows while it decodes) runs at the agent's priority in the normal class."""
    import grpc

    from omlx_node.worker_config import WorkerConfig, WorkerJob, start_worker, worker_process
    from proto import omlx_pb2_grpc as pb_grpc
    from tests.helpers.session import generate_chunks
    from tests.tiny_models import build_model

    for var in ("OMLX_LOAD_NICE", "OMLX_BACKGROUND_LOAD_NICE"):
        monkeypatch.delenv(var, raising=False)
    mine = thread_nice()
    normal = (os.SCHED_OTHER, mine)
    path = build_model(tmp_path / "m", "llama", num_layers=2)
    job = WorkerJob(WorkerConfig(path, "m", 0, None, load_reason=pb.LOAD_REQUESTED))
    worker = (worker_process("a standby shard worker", standby=True) if standby
              else start_worker(job, "a fresh shard worker"))
    try:
        imported = wait_imported(worker)
        # The standby's imports nobody waits for; a fresh worker's, its requested load's.
        assert (imported["nice"], imported["idle"]) == (
            (max(mine, BACKGROUND_LOAD_NICE), True) if standby else (max(mine, LOAD_NICE), False))
        if standby:
            assert {t[:2] for t in threads_of(worker.pid).values()} == {normal}
            worker.send_line(job.to_json())
        ready = worker.wait_ready(180)
        assert ready["load_nice"] == max(mine, LOAD_NICE)
        before = threads_of(ready["pid"])
        with grpc.insecure_channel(f"127.0.0.1:{ready['port']}") as channel:
            chunks = generate_chunks(pb_grpc.ShardWorkerStub(channel), pb.GenerateRequest(
                request_id="r", prompt_tokens=[5, 6, 7], max_tokens=256, ignore_eos=True))
        assert sum(len(c.tokens) for c in chunks) == 256
        after = threads_of(ready["pid"])
        served = {after[t][:2] for t in after if after[t][2] > before.get(t, (0, 0, 0))[2]}
        assert served == {normal}, (before, after)
        # The load's: its MLX stream, idle from now on (a requested load's: niced only).
        assert (os.SCHED_OTHER, max(mine, LOAD_NICE)) in {t[:2] for t in after.values()}
    finally:
        worker.stop()


@pytest.mark.slow  # a standby worker process
def test_a_load_requests_wait_for_does_not_wait_for_a_standby_importing_below_it(monkeypatch):
    """A standby still importing at the background priority is taken by a load nobody waits
    for, not by one that requests wait for (a fresh worker imports at its own priority; the
    standby stays for the next load), nor by a load at nice 0; once imported, any load takes
    it."""
    import signal

    from omlx_node.agent import NodeAgent
    from omlx_node.worker_config import worker_process

    for var in ("OMLX_LOAD_NICE", "OMLX_BACKGROUND_LOAD_NICE"):
        monkeypatch.delenv(var, raising=False)
    agent = NodeAgent(secret=None, node_id="standby-test", standby=False)
    agent.server.stop(None)
    standby = worker_process("a standby shard worker", standby=True)
    try:
        os.kill(standby.pid, signal.SIGSTOP)  # caught importing: stopped before it could end
        assert not (standby.ready_file.parent / "imported.json").exists()
        agent._standby = standby
        assert agent._take_standby(load_nice(pb.LOAD_REQUESTED)) is None
        assert agent._take_standby(load_nice(pb.LOAD_RECOVERY)) is None
        assert agent._standby is standby  # kept for the next load
        assert agent._take_standby(load_nice(pb.LOAD_PRELOAD)) is standby
        assert agent._standby is None
        agent._standby = standby
        assert agent._take_standby(0) is None  # a load at the worker's own priority
        os.kill(standby.pid, signal.SIGCONT)
        wait_imported(standby)
        agent._standby = standby
        assert agent._take_standby(load_nice(pb.LOAD_REQUESTED)) is standby
    finally:
        os.kill(standby.pid, signal.SIGCONT)
        standby.stop()


@pytest.mark.slow  # a node agent starting real shard workers
def test_a_worker_loads_at_its_reasons_nice(tmp_path, monkeypatch):
    """Through the contract: LoadShardRequest.load_reason reaches the worker process, whose
    loading thread reads its own nice value (LoadShardReply.load_nice); the worker serves on
    at the priority it started with."""
    from tests.helpers.node import running_node
    from tests.tiny_encoders import build_encoder
    from tests.tiny_models import build_model

    for var in ("OMLX_LOAD_NICE", "OMLX_BACKGROUND_LOAD_NICE", "OMLX_ENCODE_NICE"):
        monkeypatch.delenv(var, raising=False)
    chat = build_model(tmp_path / "chat", "llama", num_layers=2)
    embed = build_encoder(tmp_path / "embed", "bert")
    mine = thread_nice()
    (tmp_path / "node").mkdir()
    with running_node(tmp_path / "node") as (_, agent):
        def load(path, name: str, reason: int, kind: str = "") -> pb.LoadShardReply:
            return agent.LoadShard(pb.LoadShardRequest(model_path=str(path), model_id=name,
                                                       kind=kind, load_reason=reason),
                                   timeout=180)

        preloaded = load(chat, "chat", pb.LOAD_PRELOAD)
        assert preloaded.load_nice == max(mine, BACKGROUND_LOAD_NICE)
        assert os.getpriority(os.PRIO_PROCESS, preloaded.worker_pid) == mine  # serves at it
        assert load(chat, "chat", pb.LOAD_RECOVERY).load_nice == max(mine, LOAD_NICE)
        assert load(chat, "chat", 0).load_nice == max(mine, LOAD_NICE)  # an older coordinator
        # An encoder worker runs at nice 10 whole; a load nobody waits for lower still.
        assert load(embed, "e", pb.LOAD_REPLICA, "embed").load_nice == max(
            mine, BACKGROUND_LOAD_NICE)
        assert load(embed, "e", pb.LOAD_REQUESTED, "embed").load_nice == max(mine, LOAD_NICE)
