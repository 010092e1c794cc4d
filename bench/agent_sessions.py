#!/usr/bin/env python3
"""Agent sessions end to end: N concurrent sessions of M turns, each turn re-sending the whole
conversation, timed as the agent waits for it (a turn's time: request sent -> its answer ends).

Each session is a coding agent's loop: a system prompt (~--system-tokens with the tools), a
task, then per turn the model's answer (--answer-tokens, greedy) and a tool result
(~--tool-tokens) appended and the whole history sent again. Two ways of sending it:

- `chat`: /v1/chat/completions, the answer as the assistant's text, the tool result as a user
  message, rendered by the model's chat template (Qwen's tool-calling one);
- `anthropic`: /v1/messages as Claude Code sends it: system as text blocks, the assistant's
  reply as a text block plus a `tool_use` block, the result as a `tool_result` block.

Sides, one after another on the same model (each alone on the machine):

- ours: `omlx-cluster serve` (both variants; mlx_lm.server has no Messages API);
- mlx_lm.server 0.32 with batch settings that fit the load (--decode-concurrency and
  --prompt-concurrency = sessions, --prompt-cache-size 2x sessions: every session keeps its
  conversation cached);
- plain: mlx-lm `generate_step` in process, one session's turns one at a time with no cache:
  what a stream decodes when nobody else runs (the decode rate the others are held to).

Per turn: TTFT, turn time, decode tok/s (tokens after the first over the time after the first)
and the prompt tokens the server reported as cached, against the tokens that turn re-sent (the
previous prompt plus its answer). Per session: completion time. Ratios against mlx_lm.server
over the sessions' medians.

    python -m bench.agent_sessions                   # 4 x 6, CPU small random llama
    python -m bench.agent_sessions --sessions 16

Results: bench/results/agent-sessions-<tag>.json and .md (agent-sessions-<N>x<M>-<tag> for
another shape than 4 x 6).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import (
    RESULTS,
    SERVER_START_TIMEOUT,
    MlxLmServer,
    Server,
    add_model_args,
    agent_ready,
    agent_tools,
    machine_info,
    machine_tag,
    median,
    plain_env,
    select_model,
    sse_lines,
    with_repo_path,
)

ANTHROPIC_HEADERS = {"anthropic-version": "2023-06-01", "x-api-key": "bench"}


@dataclass
class Turn:
    session: int
    turn: int
    sent: float  # perf_counter when the request went out
    ttft: float
    turn_s: float
    tokens: int  # completion tokens
    decode_tps: float | None
    prompt_tokens: int
    cached: int
    resent: int  # the previous turn's prompt + answer: what the cache could have held
    text: str = field(repr=False, default="")


# ---- the conversation -----------------------------------------------------------------------


@functools.cache
def corpus() -> list[str]:
    """Real-looking text: the words of Python's own sources."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    return [w for f in files for w in f.read_text(errors="ignore").split()]


def filler(words: int, seed: int) -> str:
    """`words` words of the corpus, from a place of their own for each seed."""
    text = corpus()
    start = (seed * 104729) % (len(text) - words)
    return " ".join(text[start:start + words])


@dataclass
class Conversation:
    """One session's history, in both wire forms."""

    session: int
    system_words: int
    tool_words: int
    chat: list[dict] = field(default_factory=list)
    anthropic: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        task = f"Session {self.session}: find where the request parser fails and fix it."
        self.chat = [{"role": "system", "content": self.system}, {"role": "user", "content": task}]
        self.anthropic = [{"role": "user", "content": task}]

    @property
    def system(self) -> str:
        return filler(self.system_words, 1)  # one agent: every session's is the same

    def answered(self, turn: int, text: str) -> None:
        """Appends the model's answer and the tool result the agent got for it."""
        result = filler(self.tool_words, 100 * self.session + turn)
        self.chat += [{"role": "assistant", "content": text},
                      {"role": "user", "content": result}]
        call = f"toolu_{self.session}_{turn}"
        reply = ([{"type": "text", "text": text}] if text else []) + [
            {"type": "tool_use", "id": call, "name": "Read",
             "input": {"path": f"src/module_{turn}.py"}}]
        self.anthropic += [{"role": "assistant", "content": reply},
                           {"role": "user", "content": [{"type": "tool_result",
                                                         "tool_use_id": call,
                                                         "content": result}]}]


def tools_chat() -> list[dict]:
    return [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                              "parameters": t["input_schema"]}}
            for t in agent_tools()[:4]]


def chat_body(conv: Conversation, answer_tokens: int, model: str) -> dict:
    return {"model": model, "messages": conv.chat, "tools": tools_chat(),
            "max_tokens": answer_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}


def anthropic_body(conv: Conversation, answer_tokens: int) -> dict:
    return {"model": "bench", "max_tokens": answer_tokens, "temperature": 0.0, "stream": True,
            "system": [{"type": "text", "text": conv.system,
                        "cache_control": {"type": "ephemeral"}}],
            "tools": agent_tools()[:4], "messages": conv.anthropic}


# ---- one turn over HTTP -----------------------------------------------------------------------


async def chat_turn(client, base: str, body: dict) -> tuple[list[float], str, dict]:
    """(arrival times of the content chunks, the text, the final usage)."""
    times, text, usage = [], [], {}
    async for now, _, obj in sse_lines(client, base + "/v1/chat/completions", body):
        if "error" in obj:
            raise RuntimeError(f"stream error: {obj['error']}")
        for choice in obj.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                times.append(now)
                text.append(piece)
        if obj.get("usage"):
            usage = obj["usage"]
    return times, "".join(text), {
        "prompt": usage.get("prompt_tokens", 0), "completion": usage.get("completion_tokens", 0),
        "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


async def anthropic_turn(client, base: str, body: dict) -> tuple[list[float], str, dict]:
    times, text, usage = [], [], {}
    async for now, event, obj in sse_lines(client, base + "/v1/messages?beta=true", body,
                                           ANTHROPIC_HEADERS):
        if event == "error":
            raise RuntimeError(f"stream error: {obj}")
        if event == "content_block_delta":
            times.append(now)
            text.append(obj["delta"].get("text", ""))
        if event == "message_start":
            usage.update(obj["message"]["usage"])
        if event == "message_delta":
            usage.update(obj.get("usage", {}))
    read = usage.get("cache_read_input_tokens", 0)
    return times, "".join(text), {"prompt": usage.get("input_tokens", 0) + read,
                                  "completion": usage.get("output_tokens", 0), "cached": read}


async def session(client, base: str, variant: str, conv: Conversation, args,
                  model: str, delay: float) -> list[Turn]:
    await asyncio.sleep(delay)
    turns: list[Turn] = []
    resent = 0
    for k in range(args.turns):
        t0 = time.perf_counter()
        if variant == "chat":
            times, text, usage = await chat_turn(client, base,
                                                 chat_body(conv, args.answer_tokens, model))
        else:
            times, text, usage = await anthropic_turn(client, base,
                                                      anthropic_body(conv, args.answer_tokens))
        end = time.perf_counter()
        n = usage["completion"] or len(times)
        decode = (n - 1) / (times[-1] - times[0]) if len(times) > 1 and n > 1 else None
        turns.append(Turn(conv.session, k, t0, (times[0] if times else end) - t0, end - t0, n,
                          decode, usage["prompt"], usage["cached"], resent, text))
        resent = usage["prompt"] + n
        conv.answered(k, text)
        await asyncio.sleep(args.tool_seconds)
    return turns


def run_sessions(base: str, variant: str, args, model: str = "bench") -> list[Turn]:
    import httpx

    async def go() -> list[Turn]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout),
                                     headers={"authorization": "Bearer bench"},
                                     limits=httpx.Limits(max_connections=256)) as client:
            first = getattr(args, "first_session", 0)
            convs = [Conversation(first + s, args.system_words, args.tool_words)
                     for s in range(args.sessions)]
            runs = await asyncio.gather(*(session(client, base, variant, c, args, model,
                                                  s * args.stagger)
                                          for s, c in enumerate(convs)))
            return [t for run in runs for t in run]

    return asyncio.run(go())


def warm(base: str, variant: str, args, model: str = "bench") -> None:
    """As many short sessions of two turns as the run has, together: the template and the
    kernels of every batch size built before timing (on CUDA, MLX compiles a kernel the first
    time a process runs it; with one session only, the first timed turns paid that)."""
    small = argparse.Namespace(**{**vars(args), "turns": 2, "stagger": 0.0,
                                  "system_words": 50, "tool_words": 20, "first_session": 1000})
    run_sessions(base, variant, small, model)


def own_kernels(env: dict, work: Path, side: str) -> dict:
    """`env` with a kernel cache of the side's own (MLX_PTX_CACHE_DIR; unused off CUDA): MLX
    keeps compiled CUDA kernels on disk, so the side run second would otherwise find the
    kernels the first one compiled."""
    return dict(env, MLX_PTX_CACHE_DIR=str(work / f"kernels-{side}"))


# ---- the sides --------------------------------------------------------------------------------


def side_ours(model: Path, work: Path, args) -> dict:
    server = Server(model, work / "ours.log", ["--api-key", "bench", *args.server_arg],
                    own_kernels(dict(os.environ), work, "ours"))
    try:
        print(f"  ours ready in {server.wait_ready(SERVER_START_TIMEOUT):.1f}s", file=sys.stderr)
        out = {}
        for variant in args.variants:
            warm(server.base, variant, args)
            out[variant] = [t.__dict__ for t in run_sessions(server.base, variant, args)]
        return out
    except Exception:
        print(f"server log tail:\n{server.tail()}", file=sys.stderr)
        raise
    finally:
        server.stop()


def side_mlx_server(model: Path, work: Path, args, env: dict) -> dict:
    n = str(args.sessions)
    server = MlxLmServer(model, work / "mlx_lm_server.log",
                         ["--decode-concurrency", n, "--prompt-concurrency", n,
                          "--prompt-cache-size", str(2 * args.sessions)],
                         own_kernels(env, work, "mlx_lm_server"))
    try:
        print(f"  mlx_lm.server ready in {server.wait_ready(SERVER_START_TIMEOUT):.1f}s",
              file=sys.stderr)
        warm(server.base, "chat", args, "default_model")
        return {"chat": [t.__dict__ for t in run_sessions(server.base, "chat", args,
                                                          "default_model")]}
    except Exception:
        print(f"mlx_lm.server log tail:\n{server.tail()}", file=sys.stderr)
        raise
    finally:
        server.stop()


def plain_child(spec: dict) -> dict:
    """One session's turns, one at a time, mlx-lm's generate_step with no cache."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, tok = load(spec["model"])
    args = argparse.Namespace(**spec["args"])
    conv = Conversation(0, args.system_words, args.tool_words)
    turns = []
    for k in range(-1, args.turns):  # turn -1: the warm-up
        ids = tok.apply_chat_template(conv.chat, tools=tools_chat(), add_generation_prompt=True)
        t0, times, out = time.perf_counter(), [], []
        for token, _ in generate_step(mx.array(ids), model, max_tokens=args.answer_tokens):
            if token in tok.eos_token_ids:
                break
            times.append(time.perf_counter())
            out.append(int(token))
        if k >= 0:
            turns.append({"turn": k, "prompt_tokens": len(ids), "tokens": len(out),
                          "ttft": times[0] - t0, "turn_s": times[-1] - t0,
                          "decode_tps": (len(out) - 1) / (times[-1] - times[0])
                          if len(out) > 1 else None})
            conv.answered(k, tok.decode(out))
    return {"chat": turns}


def side_plain(model: Path, work: Path, args, env: dict) -> dict:
    import subprocess

    spec, result = work / "plain.in.json", work / "plain.out.json"
    spec.write_text(json.dumps({"model": str(model), "args": {
        k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, list))}}))
    subprocess.run([sys.executable, "-m", "bench.agent_sessions", "--_plain", str(spec),
                    "--_result", str(result)], env=with_repo_path(env), check=True,
                   timeout=args.timeout)
    return json.loads(result.read_text())


# ---- summary ----------------------------------------------------------------------------------


def session_times(turns: list[dict]) -> dict[int, float]:
    """Each session's completion time: its first request sent -> its last answer ended."""
    out: dict[int, tuple[float, float]] = {}
    for t in turns:
        lo, hi = out.get(t["session"], (t["sent"], t["sent"] + t["turn_s"]))
        out[t["session"]] = (min(lo, t["sent"]), max(hi, t["sent"] + t["turn_s"]))
    return {s: hi - lo for s, (lo, hi) in out.items()}


def stats(turns: list[dict], plain_tps: float | None) -> dict:
    later = [t for t in turns if t["turn"] > 0]
    reuse = [min(1.0, t["cached"] / t["resent"]) for t in later if t["resent"]]
    sess = session_times(turns)
    turn_s = [t["turn_s"] for t in turns]
    decode = [t["decode_tps"] for t in turns if t["decode_tps"]]
    return {
        "session_s_median": median(list(sess.values())), "session_s": sess,
        "turn_s_median": median(turn_s), "turn_s_max": max(turn_s),
        "ttft_later_median": median([t["ttft"] for t in later]),
        "reuse_min": min(reuse) if reuse else None, "reuse_median": median(reuse),
        "decode_tps_median": median(decode), "decode_tps_min": min(decode) if decode else None,
        "decode_vs_plain_median": (median(decode) / plain_tps) if decode and plain_tps else None,
        "decode_vs_plain_min": (min(decode) / plain_tps) if decode and plain_tps else None,
    }


def fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def turn_table(name: str, turns: list[dict]) -> list[str]:
    lines = [f"### {name}", "", ("| session | turn | prompt | cached | re-sent | reused | TTFT s | "
                                 "turn s | tokens | decode tok/s |"), "|" + " ---: |" * 10]
    for t in sorted(turns, key=lambda t: (t["session"], t["turn"])):
        reused = t["cached"] / t["resent"] if t["resent"] else None
        lines.append(f"| {t['session']} | {t['turn'] + 1} | {t['prompt_tokens']} | {t['cached']} "
                     f"| {t['resent']} | {fmt(reused, '.1%')} | {t['ttft']:.2f} | "
                     f"{t['turn_s']:.2f} | {t['tokens']} | {fmt(t['decode_tps'], '.1f')} |")
    sess = session_times(turns)
    lines += ["", "sessions' completion times (s): " + ", ".join(
        f"{s}: {v:.1f}" for s, v in sorted(sess.items())), ""]
    return lines


def markdown(result: dict) -> str:
    m, a = result["machine"], result["settings"]
    plain = result["plain_tps"]
    lines = [f"# Agent sessions: {a['sessions']} x {a['turns']} turns ({result['tag']})", "",
             (f"- machine: {m['cpu']} ({m['cpu_count']} cores)"
              f"{'; GPU ' + m['gpu'] if m['gpu'] else ''}"
              f"; load average at start {result['load_at_start']}"),
             f"- commit {m['git_commit']}, python {m['python']}, {result['date']}",
             f"- model: {result['model']}",
             f"- settings: {json.dumps(a)}",
             (f"- plain decode rate (mlx-lm generate_step, one stream alone): "
              f"{fmt(plain, '.1f')} tok/s"),
             "", ("| side | sessions median s | turn s median / max | later-turn TTFT s | "
                  "reused min / median | decode tok/s median / min "
                  "| decode vs plain median / min |"),
             "| --- |" + " ---: |" * 6]
    for name, s in result["summary"].items():
        lines.append(f"| {name} | {fmt(s['session_s_median'])} | {fmt(s['turn_s_median'])} / "
                     f"{fmt(s['turn_s_max'])} | {fmt(s['ttft_later_median'])} | "
                     f"{fmt(s['reuse_min'], '.1%')} / {fmt(s['reuse_median'], '.1%')} | "
                     f"{fmt(s['decode_tps_median'], '.1f')} / {fmt(s['decode_tps_min'], '.1f')} | "
                     f"{fmt(s['decode_vs_plain_median'])} / {fmt(s['decode_vs_plain_min'])} |")
    lines += ["", "## Ratios against mlx_lm.server (chat)", ""]
    for name, r in result["ratios"].items():
        lines.append(f"- {name}: " + ", ".join(f"{k} {fmt(v, '.2f')}" for k, v in r.items()))
    lines += ["", ("(sessions speed-up: mlx_lm.server's median session time over ours, goal >= 1.3;"
                   " later-turn TTFT: ours over mlx_lm.server's, goal <= 0.5; turn max over"
                   " median: goal <= 2)"), "", "## Every turn", ""]
    for name, turns in result["turns"].items():
        lines += turn_table(name, turns)
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--tag", help="results file tag (default: h200/gpu/cpu from the machine)")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-words", type=int, default=300,
                    help="words of the system prompt (with 4 tools: ~1,500 tokens)")
    ap.add_argument("--tool-words", type=int, default=170, help="words of a tool result "
                                                               "(~300 tokens)")
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--stagger", type=float, default=0.5,
                    help="seconds between two sessions' starts")
    ap.add_argument("--tool-seconds", type=float, default=0.0,
                    help="a tool's run time between an answer and the next turn")
    ap.add_argument("--variants", nargs="+", default=["chat", "anthropic"],
                    choices=["chat", "anthropic"], help="ours: which APIs to run")
    ap.add_argument("--sides", nargs="+", default=["ours", "mlx_lm.server", "plain"],
                    choices=["ours", "mlx_lm.server", "plain"])
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra flag for `serve` (repeatable)")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--work-dir", type=Path)
    ap.add_argument("--_plain", help=argparse.SUPPRESS)
    ap.add_argument("--_result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._plain:
        Path(args._result).write_text(json.dumps(plain_child(json.loads(
            Path(args._plain).read_text()))))
        return 0
    if args.model is None and args.random_llama is None:
        args.random_llama = "small"

    from omlx_shared.blas import blas_env

    load_at_start = os.getloadavg()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="omlx-bench-sessions-"))
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    machine = machine_info()
    tag = args.tag or machine_tag(machine)
    model, name, desc, _ = select_model(args, work, plain_env())
    model = agent_ready(model, args.context, work)
    node_env = blas_env()  # every MLX process gets the BLAS a node's worker gets
    sides: dict[str, dict] = {}
    for side in args.sides:
        print(f"== {side} ==", file=sys.stderr, flush=True)
        if side == "ours":
            sides["ours"] = side_ours(model, work, args)
        elif side == "mlx_lm.server":
            sides["mlx_lm.server"] = side_mlx_server(model, work, args, node_env)
        else:
            sides["plain"] = side_plain(model, work, args, node_env)
    plain = sides.get("plain", {}).get("chat")
    plain_tps = median([t["decode_tps"] for t in plain or [] if t["decode_tps"]])
    turns = {f"{side} {variant}": ts for side, by in sides.items() if side != "plain"
             for variant, ts in by.items()}
    summary = {k: stats(ts, plain_tps) for k, ts in turns.items()}
    ratios = {}
    ref = summary.get("mlx_lm.server chat")
    for k, s in summary.items():
        if ref and k.startswith("ours"):
            ratios[k] = {
                "sessions speed-up": ref["session_s_median"] / s["session_s_median"],
                "later-turn TTFT": s["ttft_later_median"] / ref["ttft_later_median"],
                "turn s median": s["turn_s_median"] / ref["turn_s_median"],
                "turn max / median (ours)": s["turn_s_max"] / s["turn_s_median"]}
    settings = {k: getattr(args, k) for k in ("sessions", "turns", "system_words", "tool_words",
                                              "answer_tokens", "stagger", "tool_seconds",
                                              "variants", "server_arg")}
    result = {"tag": tag, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine,
              "load_at_start": [round(x, 2) for x in load_at_start],
              "model": f"{name} ({desc})", "settings": settings, "plain_tps": plain_tps,
              "plain": plain, "summary": summary, "ratios": ratios,
              "turns": {k: [{f: v for f, v in t.items() if f != "text"} for t in ts]
                        for k, ts in turns.items()},
              "bench_seconds": round(time.monotonic() - t_start, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    shape = "" if (args.sessions, args.turns) == (4, 6) else f"-{args.sessions}x{args.turns}"
    stem = f"agent-sessions{shape}-{tag}"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str))
    (args.out / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
