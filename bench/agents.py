#!/usr/bin/env python3
"""Agent benchmark: what a coding agent pays on our endpoint, as ratios measured in one run.

1. Constrained decoding's per-token cost: aggregate completion tok/s of `response_format`
   json_schema requests against the same requests unconstrained, at 1 and 32 concurrent
   streams (greedy, fixed max_tokens; the schema is an array of at least 10,000 integers, so a
   constrained stream never ends before max_tokens either). Goal: constrained >= 0.9x.
2. An agent turn's time to first token: a Claude-Code-sized `POST /v1/messages` (system blocks
   of ~--agent-prompt tokens, 12 tools with JSON schemas, `max_tokens: 32000`), turn 1 on a
   cold prefix cache against turn 2 of the same conversation (turn 1's messages, the
   assistant's reply and a new user message), streamed with the Anthropic event sequence;
   TTFT = request sent -> first `content_block_delta`. Goal: turn 2 <= 10% of turn 1.
   Each repeat uses a fresh conversation (a distinct first system line), so turn 1 is cold.

The server runs alone (`python -m omlx_cluster serve`) on a copy of the model (weights
linked) with a context of --agent-prompt tokens and Qwen's tool-calling chat template; the
random llamas also get a byte-level BPE tokenizer of their vocabulary size (their word-level
one cannot spell JSON). The timing, not the text, is what counts here.

    python -m bench.agents                      # the default model (SmolLM2-135M)
    python -m bench.agents --random-llama 8b    # random Llama-3-8B-shaped model (GPU)

Results: bench/results/agents-<tag>.json and .md (tag: cpu, h200, gpu, or --tag).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.common import (
    RESULTS,
    SERVER_START_TIMEOUT,
    Server,
    add_model_args,
    agent_ready,
    agent_tools,
    machine_info,
    median,
    select_model,
    sse_lines,
)

NUMBERS_SCHEMA = {"type": "object", "required": ["numbers"], "additionalProperties": False,
                  "properties": {"numbers": {"type": "array", "items": {"type": "integer"},
                                             "minItems": 10000}}}


def agent_system(tag: str, words: int) -> list[dict]:
    """System blocks of about `words` words, with a first line unique to the conversation."""
    filler = ("You are an interactive agent that helps users with software engineering tasks. "
              "Use the tools available to you to assist the user. ")
    body = (filler * (words // len(filler.split()) + 1))
    return [{"type": "text", "text": f"Conversation {tag}."},
            {"type": "text", "text": body, "cache_control": {"type": "ephemeral"}}]


async def chat_stream(client, base: str, max_tokens: int, constrained: bool, i: int) -> dict:
    body = {"model": "bench", "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"List numbers, series {i}."}]}
    if constrained:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "numbers", "schema": NUMBERS_SCHEMA}}
    else:
        body["ignore_eos"] = True
    tokens, t0 = 0, time.perf_counter()
    async for _, _, obj in sse_lines(client, base + "/v1/chat/completions", body):
        if "error" in obj:
            raise RuntimeError(f"stream error: {obj['error']}")
        if obj.get("usage"):
            tokens = obj["usage"]["completion_tokens"]
    return {"tokens": tokens, "t0": t0, "end": time.perf_counter()}


async def streams_rate(client, base: str, n: int, max_tokens: int, constrained: bool) -> float:
    t0 = time.perf_counter()
    res = await asyncio.gather(*(chat_stream(client, base, max_tokens, constrained, i)
                                 for i in range(n)))
    return sum(r["tokens"] for r in res) / (max(r["end"] for r in res) - t0)


async def agent_turn(client, base: str, body: dict) -> tuple[float, float, dict]:
    """When one streamed /v1/messages turn was sent (perf_counter), its TTFT and the final
    usage it reported."""
    t0, ttft, usage, text = time.perf_counter(), None, {}, []
    headers = {"anthropic-version": "2023-06-01", "x-api-key": "bench"}
    async for now, event, obj in sse_lines(client, base + "/v1/messages?beta=true", body,
                                           headers):
        if event == "error":
            raise RuntimeError(f"stream error: {obj}")
        if event == "content_block_delta" and ttft is None:
            ttft = now - t0
        if event == "content_block_delta" and obj["delta"].get("type") == "text_delta":
            text.append(obj["delta"]["text"])
        if event == "message_start":
            usage.update(obj["message"]["usage"])
        if event == "message_delta":
            usage.update(obj.get("usage", {}))
    usage["text"] = "".join(text)
    return t0, ttft, usage


async def agent_conversation(client, base: str, tag: str, words: int, gap: float = 0.0) -> dict:
    """Two turns, the second `gap` seconds after the first ended (an agent sends it at once; a
    gap lets the node finish moving turn 1's blocks to host memory first)."""
    first = {"model": "bench", "max_tokens": 8, "stream": True, "temperature": 0.0,
             "system": agent_system(tag, words), "tools": agent_tools(),
             "stop_sequences": ["\n"],  # a short reply: only the first token is timed
             "messages": [{"role": "user", "content": "Where is the main function defined?"}]}
    sent1, ttft1, usage1 = await agent_turn(client, base, first)
    second = dict(first, messages=first["messages"] + [
        {"role": "assistant", "content": usage1["text"] or "I will look."},
        {"role": "user", "content": "Now explain what it does."}])
    await asyncio.sleep(gap)
    sent2, ttft2, usage2 = await agent_turn(client, base, second)
    return {"ttft_turn1": ttft1, "ttft_turn2": ttft2, "usage_turn1": usage1,
            "usage_turn2": usage2, "sent_turn1": sent1, "sent_turn2": sent2}


def measure(model: Path, work: Path, args) -> dict:
    import httpx

    server = Server(model, work / "server.log", ["--api-key", "bench", *args.server_arg])
    try:
        ready = server.wait_ready(SERVER_START_TIMEOUT)
        print(f"  server ready in {ready:.1f}s", file=sys.stderr, flush=True)
        loop = asyncio.new_event_loop()
        client = httpx.AsyncClient(timeout=httpx.Timeout(args.timeout),
                                   headers={"authorization": "Bearer bench"},
                                   limits=httpx.Limits(max_connections=256))
        run = loop.run_until_complete
        out: dict = {"server_ready_s": ready, "constrained": {}, "agent": []}
        try:
            run(streams_rate(client, server.base, 2, args.warmup_tokens, True))
            run(streams_rate(client, server.base, 2, args.warmup_tokens, False))
            for n in (args.concurrency if args.part in ("all", "constrained") else []):
                rows: dict = {"plain": [], "json_schema": []}
                for _ in range(args.repeats):
                    for kind, constrained in (("plain", False), ("json_schema", True)):
                        rows[kind].append(run(streams_rate(client, server.base, n,
                                                           args.tokens, constrained)))
                out["constrained"][str(n)] = rows
                print(f"  {n} streams: {rows}", file=sys.stderr, flush=True)
            for r in range(args.repeats if args.part in ("all", "agent") else 0):
                if r == 0:
                    run(agent_conversation(client, server.base, "warm-up",
                                           args.agent_words // 10))
                conv = run(agent_conversation(client, server.base, f"{r}-{time.time()}",
                                              args.agent_words, args.turn_gap))
                out["agent"].append(conv)
                print(f"  agent turn TTFT: {conv['ttft_turn1'] * 1e3:.0f} ms cold, "
                      f"{conv['ttft_turn2'] * 1e3:.0f} ms on turn 2", file=sys.stderr,
                      flush=True)
        finally:
            run(client.aclose())
            loop.close()
        return out
    except Exception:
        print(f"server log tail:\n{server.tail()}", file=sys.stderr)
        raise
    finally:
        server.stop()


def summarize(out: dict) -> list[dict]:
    rows: list[dict] = []
    for n, r in out["constrained"].items():
        plain, cons = median(r["plain"]), median(r["json_schema"])
        rows.append({"metric": f"aggregate tok/s, {n} stream(s)", "a": f"{cons:.1f}",
                     "b": f"{plain:.1f}", "ratio": cons / plain, "goal": ">= 0.9",
                     "a_name": "json_schema", "b_name": "unconstrained"})
    if not out["agent"]:
        return rows
    t1 = median([c["ttft_turn1"] for c in out["agent"]])
    t2 = median([c["ttft_turn2"] for c in out["agent"]])
    u1, u2 = out["agent"][-1]["usage_turn1"], out["agent"][-1]["usage_turn2"]
    rows.append({"metric": (f"agent turn TTFT (turn 1: {u1.get('input_tokens', 0)} input tokens;"
                            f" turn 2: {u2.get('cache_read_input_tokens', 0)} read from cache, "
                            f"{u2.get('input_tokens', 0)} not)"),
                 "a": f"{t2 * 1e3:.0f} ms", "b": f"{t1 * 1e3:.0f} ms", "ratio": t2 / t1,
                 "goal": "<= 0.10", "a_name": "turn 2", "b_name": "turn 1 (cold)"})
    return rows


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# Agent benchmark ({result['tag']})", "",
             f"- machine: {m['cpu']} ({m['cpu_count']} cores){'; GPU ' + m['gpu'] if m['gpu'] else ''}",
             f"- commit {m['git_commit']}, python {m['python']}, {result['date']}",
             f"- model: {result['model']}",
             f"- settings: {json.dumps(result['settings'])}; medians of {result['settings']['repeats']} runs",
             "", "| metric | measured | reference | ratio | goal |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for r in result["rows"]:
        lines.append(f"| {r['metric']} | {r['a_name']}: {r['a']} | {r['b_name']}: {r['b']} | "
                     f"{r['ratio']:.3f} | {r['goal']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--tag", help="results file tag (default: h200/gpu/cpu from the machine)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64, help="max_tokens of the tok/s runs")
    ap.add_argument("--warmup-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--agent-words", type=int, default=16000,
                    help="words of the agent's system prompt (~20k tokens with the tools)")
    ap.add_argument("--agent-prompt", type=int, default=32768,
                    help="context the model must allow (its config is extended if shorter)")
    ap.add_argument("--part", choices=["all", "constrained", "agent"], default="all",
                    help="measure both claims, or one")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra flag for `serve` (repeatable)")
    ap.add_argument("--turn-gap", type=float, default=0.0, metavar="SECONDS",
                    help="wait between an agent's two turns (default 0: at once, as agents do)")
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--work-dir", type=Path)
    args = ap.parse_args()

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="omlx-bench-agents-"))
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    machine = machine_info()
    tag = args.tag or ("h200" if "H200" in machine["gpu"] else "gpu" if machine["gpu"] else "cpu")
    base_env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD",
                                                                 "OPENBLAS_NUM_THREADS")}
    model, name, desc, _ = select_model(args, work, base_env)
    model = agent_ready(model, args.agent_prompt, work)
    print(f"model {model}", file=sys.stderr, flush=True)
    out = measure(model, work, args)
    rows = summarize(out)
    settings = {k: getattr(args, k) for k in ("part", "repeats", "tokens", "concurrency",
                                              "agent_words", "agent_prompt", "turn_gap",
                                              "server_arg")}
    result = {"tag": tag, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine,
              "model": f"{name} ({desc})", "settings": settings, "rows": rows, "raw": out,
              "bench_seconds": round(time.monotonic() - t_start, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    tag += "" if args.part == "all" else f"_{args.part}"
    (args.out / f"agents-{tag}.json").write_text(json.dumps(result, indent=1, default=str))
    (args.out / f"agents-{tag}.md").write_text(markdown(result))
    print(markdown(result))
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
