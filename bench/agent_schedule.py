#!/usr/bin/env python3
"""Agent sessions replayed against one engine in process, for choosing its scheduling policy.

`bench.agent_sessions` times the whole server against mlx_lm.server; this drives a `Batcher`
directly (no HTTP, no template, no tokenizer), so that two policies can alternate within
minutes on a shared machine, on exactly the same work: the same random-token conversations, the
same greedy answers. Each session sends a system prompt, then per turn its whole history again
(the previous prompt, the answer, a tool result), the next turn the moment an answer ends.

Per policy it prints the sessions' completion times, the later turns' time to a first token and
where that time went (omlx_node.wait_parts: the running rows' decode steps, the turn's own
prefill, other prompts' prefill, and the rest), turn times, and the answers' decode rate against
a lone stream's on the same engine.

    python -m bench.agent_schedule                       # 4 x 6, every policy, 2 rounds
    python -m bench.agent_schedule --sessions 16 --policies paced share2 --together

On a shared machine, `--together` runs the policies of a round at the same time, each in its
own process: every one sees the same load, so their ratios mean something where consecutive
runs' times move 2x with the others' work (both then run slower than alone).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import RANDOM_LLAMAS, machine_info, write_random_llama
from omlx_node.batcher import Batcher
from omlx_node.kv_cache import PrefixCache
from omlx_node.metrics import NodeMetrics
from omlx_node.sequence import Finish, SeqRequest, Sequence
from omlx_node.stage import StageRunner
from omlx_node.step_pace import StepPace
from omlx_node.wait_parts import PARTS


def shortest_first(b: Batcher) -> None:
    b.shortest_first = True


def share(n: float) -> Callable[[Batcher], None]:
    """A pace whose prefill takes `n` decode steps' time (1e9: a whole chunk every iteration,
    as before pacing)."""
    def setup(b: Batcher) -> None:
        b.pace = StepPace(share=n)
    return setup


class PerTokenPace(StepPace):
    """The pace before a pass's fixed cost was fitted apart: all of a pass's time charged to
    its tokens (on a GPU, small passes then look expensive per token and stay small)."""

    def _line(self) -> tuple[float, float]:
        _, n, s, _, _ = self.fit
        return (0.0, s / n) if n else (0.0, 0.0)


def unpadded(b: Batcher) -> None:
    """Passes shared only by pieces at one offset and of one length (before padded passes):
    agents' turns, each with its own history and suffix, then prefill one pass each."""
    def groups(plan: list[tuple[Sequence, int, int]]) -> list[list[tuple[Sequence, int, int]]]:
        by_shape: dict[tuple[int, int], list[tuple[Sequence, int, int]]] = {}
        for piece in plan:
            if piece[2] > 0:
                by_shape.setdefault(piece[1:] if b.state.batchable else (id(piece), 0),
                                    []).append(piece)
        return list(by_shape.values())
    b._prefill_groups = groups  # type: ignore[method-assign]


# The policies compared (docs/scheduling.md): how each sets up an engine.
POLICIES: dict[str, Callable[[Batcher], None]] = {
    "engine": lambda b: None,  # the engine as it is
    "shortest": shortest_first,
    "fixed": share(1e9),
    "share0.5": share(0.5),  # (these keep the engine's order)
    "share2": share(2.0),
    "share4": share(4.0),
    "per-token": lambda b: setattr(b, "pace", PerTokenPace()),
    "unpadded": unpadded,
}


@dataclass
class TurnResult:
    session: int
    turn: int
    ttft: float
    turn_s: float
    decode_tps: float | None
    wait: dict[str, float]
    cached: int
    prompt: int


@dataclass
class Session:
    index: int
    start: float
    prompt: list[int]
    turn: int = 0
    seq: Sequence | None = None
    sent: float = 0.0
    times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    done_at: float = 0.0


class WorkClock:
    """Time as the work the engine did: each iteration costs its decode rows at `row_s` each
    and its prompt tokens at `token_s` each (both measured on the machine alone; on a CPU both
    are compute and linear, docs/scheduling.md). Other processes' load then moves no result:
    what differs between two policies is only who waited for which work. (The engine's pace
    still measures real time: its budget is a ratio of two costs, which load moves little.)"""

    def __init__(self, batcher: Batcher, row_s: float, token_s: float):
        self.now, self.row_s, self.token_s = 0.0, row_s, token_s
        self._prefilled = 0
        observe = batcher.pace.observe

        def counted(seconds: float, decoded: bool, prefilled: int) -> None:
            self._prefilled = prefilled
            observe(seconds, decoded, prefilled)
        batcher.pace.observe = counted  # type: ignore[method-assign]

    def step(self, batcher: Batcher) -> None:
        rows = len(batcher.running_seqs())
        self._prefilled = 0
        batcher.step()
        self.now += rows * self.row_s + self._prefilled * self.token_s


def replay(path: Path, policy: str, args, vocab: int) -> tuple[list[TurnResult], list[float]]:
    """One run of every session under `policy`; returns its turns and sessions' times (in
    work time with --work-clock)."""
    layers = RANDOM_LLAMAS[args.size][2]["num_hidden_layers"]
    cache = PrefixCache("m", (0, layers), block_size=16, hot_max_bytes=1 << 31)
    batcher = Batcher(StageRunner(path), NodeMetrics(), prefix_cache=cache)
    POLICIES[policy](batcher)
    clock = WorkClock(batcher, args.work_clock[0] / 1e3, args.work_clock[1] / 1e3) \
        if args.work_clock else None
    warm = batcher.submit(SeqRequest("warm", [5] * 40, 4))
    while not batcher.idle:
        batcher.step()
    del warm
    rng = random.Random(args.seed)
    system = [rng.randrange(10, vocab) for _ in range(args.system_tokens)]
    t0 = clock.now if clock else time.perf_counter()
    sessions = [Session(i, t0 + i * args.stagger,
                        system + [rng.randrange(10, vocab) for _ in range(30)])
                for i in range(args.sessions)]
    results: list[TurnResult] = []
    deadline = time.perf_counter() + args.timeout
    while any(not s.done_at for s in sessions):
        now = clock.now if clock else time.perf_counter()
        if time.perf_counter() > deadline:
            raise TimeoutError(f"policy {policy}: sessions not done in {args.timeout} s")
        for s in sessions:
            if s.seq is None and not s.done_at and now >= s.start:
                s.seq = batcher.submit(SeqRequest(f"s{s.index}t{s.turn}", s.prompt,
                                                  args.answer_tokens))
                s.sent, s.times, s.tokens = now, [], []
        if batcher.idle:
            if clock:  # nothing to compute until the next session starts
                clock.now = min(s.start for s in sessions if s.seq is None and not s.done_at)
            else:
                time.sleep(0.005)
            continue
        if clock:
            clock.step(batcher)
            now = clock.now
        else:
            batcher.step()
            now = time.perf_counter()
        for s in sessions:
            if s.seq is None:
                continue
            finished = False
            while not s.seq.events.empty():
                ev = s.seq.events.get_nowait()
                if isinstance(ev, Finish):
                    finished = True
                else:
                    s.tokens.append(ev)
                    s.times.append(now)
            if finished:
                tps = ((len(s.times) - 1) / (s.times[-1] - s.times[0])
                       if len(s.times) > 1 and s.times[-1] > s.times[0] else None)
                results.append(TurnResult(s.index, s.turn + 1, s.times[0] - s.sent,
                                          now - s.sent, tps, s.seq.wait.parts(), s.seq.cached,
                                          len(s.prompt)))
                s.turn += 1
                tool = [rng.randrange(10, vocab) for _ in range(args.tool_tokens)]
                s.prompt = s.prompt + s.tokens + tool
                s.seq = None
                if s.turn == args.turns:
                    s.done_at = now
                else:
                    s.start = now
    cache.close()
    return results, [s.done_at - (t0 + s.index * args.stagger) for s in sessions]


def lone_rate(path: Path, args, vocab: int) -> float:
    """A lone stream's decode rate on the engine: a system-prompt-long prompt, nobody else."""
    batcher = Batcher(StageRunner(path), NodeMetrics())
    rng = random.Random(args.seed + 1)
    seq = batcher.submit(SeqRequest("lone", [rng.randrange(10, vocab)
                                             for _ in range(args.system_tokens)], 64))
    times = []
    while not batcher.idle:
        batcher.step()
        while not seq.events.empty():
            if not isinstance(seq.events.get_nowait(), Finish):
                times.append(time.perf_counter())
    return (len(times) - 1) / (times[-1] - times[0])


def summary(turns: list[TurnResult], sessions: list[float], lone: float) -> dict:
    later = [t for t in turns if t.turn > 1]
    med = statistics.median
    return {
        "sessions_median_s": med(sessions),
        "later_ttft_median_s": med(t.ttft for t in later),
        # Where their wait went, as shares (real time: the engine measures it)
        **{f"later_{p}_share": sum(t.wait[p] for t in later)
           / sum(sum(t.wait.values()) for t in later) for p in PARTS},
        "turn_median_s": med(t.turn_s for t in turns),
        "turn_max_s": max(t.turn_s for t in turns),
        "decode_vs_lone_median": med(t.decode_tps for t in turns if t.decode_tps) / lone,
        "decode_vs_lone_min": min(t.decode_tps for t in turns if t.decode_tps) / lone,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--tool-tokens", type=int, default=330)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--stagger", type=float, default=0.5)
    ap.add_argument("--rounds", type=int, default=2, help="each policy this often, alternating")
    ap.add_argument("--policies", nargs="+", choices=sorted(POLICIES), default=sorted(POLICIES))
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--work-clock", type=float, nargs=2, metavar=("ROW_MS", "TOKEN_MS"),
                    help="time as work: a decode row and a prompt token cost this many ms "
                         "(measure them alone; see WorkClock)")
    ap.add_argument("--together", action="store_true",
                    help="a round's policies at the same time, one process each")
    ap.add_argument("--size", choices=sorted(RANDOM_LLAMAS), default="small",
                    help="the random llama's shape (bench.common.RANDOM_LLAMAS)")
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)  # (a --together child's)
    args = ap.parse_args()
    if args.model:
        print(json.dumps(run_policy(args.model, args.policies[0], args)), flush=True)
        return 0
    with tempfile.TemporaryDirectory(prefix="omlx-agent-schedule-") as tmp:
        path = Path(tmp) / "model"
        _, _, shape, dtype = RANDOM_LLAMAS[args.size]
        write_random_llama(path, shape, dtype, None, 16384)
        info = machine_info()
        print(f"machine: {info.get('cpu', '?')}; sessions {args.sessions} x {args.turns} turns",
              file=sys.stderr)
        for r in range(args.rounds):
            if args.together:
                children = [subprocess.Popen(
                    [sys.executable, "-m", "bench.agent_schedule", "--model", str(path),
                     "--policies", policy, *child_args(args)], stdout=subprocess.PIPE,
                    env=os.environ) for policy in args.policies]
                results = [json.loads(c.communicate(timeout=args.timeout + 60)[0].splitlines()[-1])
                           for c in children]
            else:
                results = [run_policy(path, policy, args) for policy in args.policies]
            for policy, res in zip(args.policies, results):
                print(f"round {r + 1} {policy:>8} load {res.pop('load')} lone "
                      f"{res.pop('lone_tps'):.0f} tok/s "
                      + " ".join(f"{k} {v:.3f}" for k, v in res.items()), flush=True)
    return 0


def child_args(args) -> list[str]:
    return [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
            ("sessions", "turns", "system_tokens", "tool_tokens", "answer_tokens", "stagger",
             "seed", "timeout", "size")] + (
        ["--work-clock", *map(str, args.work_clock)] if args.work_clock else [])


def run_policy(path: Path, policy: str, args) -> dict:
    """The lone stream's rate, then the sessions under `policy`: its summary."""
    vocab = RANDOM_LLAMAS[args.size][2]["vocab_size"]
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    lone = 1e3 / args.work_clock[0] if args.work_clock else lone_rate(path, args, vocab)
    turns, sessions = replay(path, policy, args, vocab)
    return {"load": load, "lone_tps": lone, **summary(turns, sessions, lone)}


if __name__ == "__main__":
    sys.exit(main())
