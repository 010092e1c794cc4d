"""A worker's load at a low CPU priority, so that the models a node serves keep their speed
while another one loads beside them; and an embedding, reranking or Whisper worker's passes
below a chat model's decode.

A load (reading and copying gigabytes of weights, then the warm-up's passes) competes for the cores
with the workers that decode: on a small CPU a neighbour's load cost a decoding model a large part
of its decode rate (bench/results/models-cpu.md). So the load runs on a thread of its own whose
nice value is raised, and so are the threads it starts (MLX's file readers, the stream its warm-up
runs on), which inherit it. How far depends on why it loads (LoadShardRequest.load_reason):

- a load nobody waits for (a model preloaded at start or by /load, a replica added while the
  others serve, make before break's next plan while the current one serves) runs at
  BACKGROUND_LOAD_NICE (19; env OMLX_BACKGROUND_LOAD_NICE);
- a load that requests wait for (a model a request named, a re-plan while the model serves
  nowhere, a coordinator that does not say) runs at LOAD_NICE (10; env OMLX_LOAD_NICE).

These nice values are what a load runs at where SCHED_IDLE is not (below, `load_idle`): beside
decoding workers a nice-19 load takes about a seventieth of the cores, a nice-10 one a tenth
(so that a failover's reload does not crawl behind them), and an idle node's cores all the same.

The load's last part runs on that thread too: the warm-up, the draft model of a `draft=PATH`
engine, and the curves its engine calibrates on (speculation's cost by positions, a pipeline
head's by rows: omlx_node.worker.finish_load), which on the serving thread took a large part
of a preload's window at nice 0. So do a worker's imports (MLX, mlx-lm, transformers; see
omlx_node/standby.py): a standby's, started after each load, at BACKGROUND_LOAD_NICE, and a
fresh worker's at its job's load's.

0 is the worker's own priority. The serving threads never had theirs lowered, so nothing needs
restoring once the load is done, which an unprivileged process could not do (lowering a nice
value needs CAP_SYS_NICE); for the same reason a load cannot be hurried once it started: a
request for a model that is being preloaded waits for the preload at its priority.

An embedding batch or a transcription is work a person does not watch token by token; a chat
model's decode is. Their workers run at ENCODE_NICE (env OMLX_ENCODE_NICE) from their start,
every thread of them (BLAS's pool does most of an encoder's work, and it exists before any
load): beside a decoding model they take about a tenth of the cores it wants, and all of them
when it is idle. Not 19, although nobody watches a bulk batch: one pool of BLAS threads runs
a RAG query (which a chat user waits for) and a bulk batch alike, so a nice value low enough
for the batch holds the query back too (bench/results/neighbour-cpu.md times both). Nor SCHED_IDLE,
which a load runs in (below): an idle-class thread gets a few thousandths of a core beside
threads that keep every core busy, so an embedding request beside chat models that fill a
node's cores would wait for as long as they decode, where a load only finishes later. Nothing
of theirs is ever raised back.

On Linux the threads of a load nobody waits for also run in the SCHED_IDLE class (`idle_class`;
env OMLX_LOAD_IDLE=0: nice values only). A niced thread still keeps a core it runs on until its slice
ends or a waking thread's deadline is earlier (EEVDF), so a decode whose threads wake every few
milliseconds found the spare core taken by the load often enough to lose part of its rate at
nice 19; a SCHED_IDLE thread is preempted at once by any other class's wakeup
(bench/results/neighbour-cpu.md). Its weight (3, against a nice-19 thread's 15
and a nice-10 one's 110) makes a load beside workers that keep every core busy about 37 times slower
than at nice 10: the price of a neighbour that keeps its rate, paid only where nobody waits. A
load that requests wait for (a model they named, a re-plan of a model that serves nowhere until
it is done) keeps its nice value alone: in the idle class it would crawl behind busy workers
while its requests wait, a failover's with every one of that model's. Where the kernel refuses the
class (a seccomp profile), the load logs it and runs at its nice value as before. Nothing is
set back afterwards: the threads a load lowers end with it (the loading thread, the grammar
tokenizer's, a worker's importing thread) or stay idle (the MLX stream the load evaluated on),
and the serving threads never had their class or nice value changed; leaving SCHED_IDLE would
need CAP_SYS_NICE or an RLIMIT_NICE that allows the thread's nice value.

Nothing is lowered where MLX computes on a GPU (its CUDA build on Linux). The device's own threads
(the driver's, a stream's completion worker that frees its buffers) start with the first thread
that uses it and keep that thread's class and nice value for the process's life, and a load's
thread, the first to touch the GPU, would leave every later decode step waiting on idle-class
threads. A GPU's load spends its time on the disk and the device, not on the cores neighbours
decode on.

Linux only: there a nice value and a scheduling class belong to a thread. Elsewhere (macOS,
where a nice value would be the whole process's, and SCHED_IDLE does not exist) the work runs
as before.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

from omlx_shared.hardware import mlx_on_cpu
from proto import omlx_pb2 as pb

log = logging.getLogger(__name__)

T = TypeVar("T")

LOAD_NICE = 10  # a load requests wait for
BACKGROUND_LOAD_NICE = 19  # a load nobody waits for
ENCODE_NICE = 10
# The reasons nobody waits on; any other (a newer coordinator's too) is waited for.
BACKGROUND_REASONS = frozenset({pb.LOAD_PRELOAD, pb.LOAD_REPLICA, pb.LOAD_MOVE})


def nice_from_env(name: str, default: int) -> int:
    """The nice value the environment variable `name` sets (0 to 19), else `default`; 0 where
    a thread cannot have its own, and where MLX computes on a GPU (see the module's
    docstring: a GPU's own threads)."""
    if not sys.platform.startswith("linux") or not mlx_on_cpu():
        return 0
    raw = os.environ.get(name, "")
    try:
        return max(0, min(19, int(raw))) if raw else default
    except ValueError:
        log.warning("%s=%r is not a number from 0 to 19; using %d", name, raw, default)
        return default


def load_nice(reason: int = pb.LOAD_REQUESTED) -> int:
    """The nice value a load for `reason` (a pb.LoadReason) runs at."""
    if reason in BACKGROUND_REASONS:
        return nice_from_env("OMLX_BACKGROUND_LOAD_NICE", BACKGROUND_LOAD_NICE)
    return nice_from_env("OMLX_LOAD_NICE", LOAD_NICE)


def load_idle() -> bool:
    """Whether a load's threads run in Linux's SCHED_IDLE class besides their nice value (env
    OMLX_LOAD_IDLE=0: no); never where the OS has no such class."""
    return (sys.platform.startswith("linux") and hasattr(os, "SCHED_IDLE")
            and os.environ.get("OMLX_LOAD_IDLE", "1").strip() != "0")


def idle_class(nice: int) -> bool:
    """Whether a load at `nice` also runs in the SCHED_IDLE class: where `load_idle`, a load
    nobody waits for (the background loads' nice value marks it), not one requests wait for."""
    return nice > 0 and load_idle() and nice >= load_nice(pb.LOAD_PRELOAD)


def thread_idle() -> bool:
    """Whether the calling thread runs in the SCHED_IDLE class (never off Linux)."""
    return (sys.platform.startswith("linux") and hasattr(os, "SCHED_IDLE")
            and os.sched_getscheduler(threading.get_native_id()) == os.SCHED_IDLE)


def thread_nice() -> int:
    """The calling thread's nice value (elsewhere than on Linux: its process's)."""
    linux = sys.platform.startswith("linux")
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id() if linux else 0)


def reason_name(reason: int) -> str:
    """`reason`'s name in the contract (for logs), its number where this node lacks it."""
    return pb.LoadReason.Name(reason) if reason in pb.LoadReason.values() else str(reason)


def encode_nice() -> int:
    """The nice value an embedding, reranking or Whisper worker's passes run at."""
    return nice_from_env("OMLX_ENCODE_NICE", ENCODE_NICE)


def lower_this_thread(nice: int) -> None:
    """The calling thread, a load's, at `nice` at least and in the SCHED_IDLE class where
    `idle_class(nice)` (the threads it starts inherit both); nothing where `nice` is 0 or a nice value
    is not a thread's (elsewhere than on Linux)."""
    if not nice or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    os.setpriority(os.PRIO_PROCESS, tid, max(thread_nice(), nice))
    if idle_class(nice):
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except OSError as e:  # a seccomp profile or security module may refuse it
            log.warning("SCHED_IDLE refused (%s): this load runs at nice %d", e, thread_nice())


def lower_this_process(nice: int) -> None:
    """Every thread of this process at `nice` at least (the threads they start inherit it)."""
    if nice == 0:
        return
    for tid in os.listdir("/proc/self/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid),
                           max(os.getpriority(os.PRIO_PROCESS, int(tid)), nice))
        except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
            continue


def at_low_priority(work: Callable[[], T], elsewhere: bool = True,
                    nice: int | None = None) -> T:
    """`work()`'s result (or its exception), run on a thread at `nice` (default: a requested
    load's, `load_nice()`; `lower_this_thread`) and on an MLX stream that thread made (its
    compute thread inherits the nice value and class); on this
    thread as it is where that is 0 or the work must stay on this thread (not `elsewhere`).
    Blocks until the work is done."""
    nice = load_nice() if nice is None else nice
    if nice == 0 or not elsewhere:
        return work()
    import mlx.core as mx

    def run() -> T:
        if mx.default_device() == mx.cpu:  # a GPU's work is not a CPU thread's
            with mx.stream(mx.new_stream(mx.cpu)):
                return materialized(work())
        return materialized(work())

    return on_niced_thread(run, nice)


def on_niced_thread(work: Callable[[], T], nice: int, name: str = "load") -> T:
    """`work()`'s result (or its exception), run on a new thread at `nice` at least, a load's
    (`lower_this_thread`: the threads it starts inherit it); blocks until it is done. This
    thread keeps its priority."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            lower_this_thread(nice)
            out["result"] = work()
        except BaseException as e:  # re-raised on the caller's thread
            out["error"] = e

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["result"]


def materialized(loaded: T) -> T:
    """`loaded` with every array of the modules it holds evaluated on the thread that loaded
    it, private ones too (a RoPE's frequencies, Whisper's positions): an array left lazy names
    the loading thread's stream,
    which no other thread may evaluate ("There is no Stream(cpu, 0) in current thread")."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    held = [loaded, *vars(loaded).values()] if hasattr(loaded, "__dict__") else [loaded]
    arrays = [v for v in held if isinstance(v, mx.array)]
    for m in held:
        if isinstance(m, nn.Module):
            arrays += [a for _, a in tree_flatten(m.filter_and_map(lambda *_: True))
                       if isinstance(a, mx.array)]
    mx.eval(arrays)
    return loaded
