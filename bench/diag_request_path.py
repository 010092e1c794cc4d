#!/usr/bin/env python3
"""Where a long prompt's first token goes on its way through our server, segment by segment,
next to the floor of the one gRPC hop it takes (a bare grpc.aio client and sync server in
this process, the same request).

`omlx-cluster serve` runs with a probe injected through PYTHONPATH (a sitecustomize) that
stamps, in every process, the moments a request passes (time.perf_counter: one monotonic clock
for all processes on the machine). One client sends `--requests` streamed completions of a
`--prompt`-token prompt, one after another, and the stamps inside each request's window are
read back in order:

    HTTP in       client sends            -> uvicorn starts the app
    parse         app starts              -> the endpoint runs (body read, JSON, validation)
    gateway       endpoint                -> the gRPC call's send starts
    gRPC in       send starts             -> the worker's server takes the call
    worker in     call taken              -> the Generate handler runs (its thread, the ids)
    to engine     handler                 -> the engine plans the prompt's prefill
    engine        prefill planned         -> the first token is handed out (prefill, decode)
    to handler    token out               -> the handler serializes its chunk
    gRPC out      chunk serialized        -> the gateway takes it
    render        chunk taken             -> its SSE event is written
    HTTP out      event written           -> the client reads it

    python bench/diag_request_path.py [--prompt 2048] [--requests 60] [--random-llama 1b]

With --agent WORDS the requests are instead coding-agent conversations of two turns
(bench_agents.py's: `POST /v1/messages` with system blocks of WORDS words and 12 tools, then
the same conversation one exchange longer), and the segments are given for each turn: turn 2
restores its prefix from the cache, so its "engine" is a cache hit's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.bench_single_node import RANDOM_LLAMAS, Server, diag_model  # noqa: E402

PROBE = r'''
import atexit, importlib.abc, importlib.util, os, sys, threading, time
_out = os.path.join(os.environ["OMLX_PATH_PROBE"], f"{os.getpid()}.ev")
_buf = []

def _flush():
    lines, _buf[:] = list(_buf), []
    with open(_out, "a") as f:
        f.writelines(lines)

def _flusher():
    while True:
        time.sleep(0.5)
        _flush()

atexit.register(_flush)
threading.Thread(target=_flusher, daemon=True).start()

def _stamped(f, name, when):
    import inspect
    if inspect.iscoroutinefunction(f):
        async def w(*a, **k):
            _buf.append(f"{name} {time.perf_counter():.7f}\n")
            return await f(*a, **k)
    else:
        def w(*a, **k):
            if when is None or when(a):
                _buf.append(f"{name} {time.perf_counter():.7f}\n")
            return f(*a, **k)
    return w

def _sse(a):
    m = a[1]
    body = m.get("body", b"") if m.get("type") == "http.response.body" else b""
    return b"choices" in body or b"content_block_delta" in body

STAMPS = {
    "uvicorn.protocols.http.httptools_impl": [("RequestResponseCycle.run_asgi", "app", None),
                                             ("RequestResponseCycle.send", "sse", _sse)],
    "fastapi.routing": [("run_endpoint_function", "endpoint", None)],
    "grpc.aio._call": [("UnaryStreamCall._send_unary_request", "send", None)],
    "grpc._server": [("_handle_call", "taken", None), ("_serialize_response", "serialized", None)],
    "omlx_node.worker": [("WorkerService.Generate", "handler", None)],
    "omlx_node.batcher": [("Engine._take_prefill", "planned", None),
                          ("Engine._emit", "token", None)],
    "omlx_coordinator.generation": [("_joined", "chunk", None)],
}

class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in STAMPS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            for dotted, stamp, when in STAMPS[name]:
                owner, *rest = dotted.split(".")
                obj = module if not rest else getattr(module, owner)
                attr = rest[0] if rest else owner
                setattr(obj, attr, _stamped(getattr(obj, attr), stamp, when))

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _Finder())
'''

# (segment, the stamp that ends it); each starts where the one before ended.
SEGMENTS = [("HTTP in", "app"), ("parse", "endpoint"), ("gateway", "send"),
            ("gRPC in", "taken"), ("worker in", "handler"), ("to engine", "planned"),
            ("engine", "token"), ("to handler", "serialized"), ("gRPC out", "chunk"),
            ("render", "sse"), ("HTTP out", None)]


def request_times(base: str, prompts: list[list[int]]) -> list[tuple[float, float]]:
    """(sent, first token read) of each streamed completion, one after another."""
    import httpx

    out = []
    with httpx.Client(timeout=120) as client:
        for prompt in prompts:
            body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": 4,
                               "temperature": 0.0, "stream": True, "ignore_eos": True})
            t0 = time.perf_counter()
            first = None
            with client.stream("POST", base + "/v1/completions", content=body,
                               headers={"content-type": "application/json"}) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if first is None and line.startswith("data: {"):
                        first = time.perf_counter()
            out.append((t0, first))
    return out


def agent_times(base: str, words: int, conversations: int
                ) -> dict[str, list[tuple[float, float]]]:
    """(sent, first content_block_delta read) of each turn of `conversations` two-turn agent
    conversations, one after another, by turn."""
    import httpx

    from bench.bench_agents import agent_conversation

    async def run() -> dict[str, list[tuple[float, float]]]:
        out: dict[str, list[tuple[float, float]]] = {"turn 1": [], "turn 2": []}
        async with httpx.AsyncClient(timeout=600) as client:
            for i in range(conversations):
                conv = await agent_conversation(client, base, f"{i}-{time.time()}", words)
                for turn in (1, 2):
                    sent = conv[f"sent_turn{turn}"]
                    out[f"turn {turn}"].append((sent, sent + conv[f"ttft_turn{turn}"]))
        return out

    return asyncio.run(run())


def segments(stamps: list[tuple[float, str]], windows: list[tuple[float, float]]
             ) -> dict[str, list[float]]:
    """Per segment, its length (ms) in each request whose every stamp was found in order."""
    out: dict[str, list[float]] = {name: [] for name, _ in SEGMENTS}
    for t0, t1 in windows:
        inside = [(t, n) for t, n in stamps if t0 <= t <= t1]
        last, lengths = t0, []
        for name, stamp in SEGMENTS:
            end = t1 if stamp is None else next((t for t, n in inside
                                                 if n == stamp and t >= last), None)
            if end is None:
                break
            lengths.append((name, (end - last) * 1e3))
            last = end
        if len(lengths) == len(SEGMENTS):
            for name, ms in lengths:
                out[name].append(ms)
    return out


def grpc_floor(prompt_len: int, requests: int) -> dict[str, float]:
    """A bare grpc.aio client and sync server (a thread pool, as the worker's) in this
    process: the request's way to its handler, and the handler's first chunk's way back."""
    from concurrent import futures

    import grpc

    from proto import omlx_pb2 as pb
    from proto import omlx_pb2_grpc as pb_grpc

    stamps: dict[str, float] = {}

    class Echo(pb_grpc.ShardWorkerServicer):
        def Generate(self, request, context):
            stamps["in"] = time.perf_counter()
            for i in range(4):
                yield pb.TokenChunk(tokens=[i], prompt_tokens=len(request.prompt_tokens))

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_ShardWorkerServicer_to_server(Echo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()

    async def run() -> dict[str, float]:
        ins, outs = [], []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.ShardWorkerStub(channel)
            req = pb.GenerateRequest(request_id="floor", prompt_tokens=[7] * prompt_len,
                                     max_tokens=4)
            for i in range(requests + 5):
                t0 = time.perf_counter()
                first = None
                async for _ in stub.Generate(req, timeout=30):
                    first = first or time.perf_counter()
                if i >= 5:
                    ins.append((stamps["in"] - t0) * 1e3)
                    outs.append((first - stamps["in"]) * 1e3)
        return {"in": statistics.median(ins), "out": statistics.median(outs)}

    try:
        return asyncio.run(run())
    finally:
        server.stop(0)


def print_segments(title: str, found: dict[str, list[float]],
                   windows: list[tuple[float, float]]) -> dict[str, float]:
    whole = statistics.median(b - a for a, b in windows) * 1e3
    print(f"\n{title}: medians of {len(found['engine'])} of {len(windows)} requests (the rest "
          f"missed a stamp); first token at the client after {whole:.2f} ms")
    print("\n| segment | median | min |\n|---|---:|---:|")
    medians = {}
    for name, _ in SEGMENTS:
        xs = found[name]
        medians[name] = statistics.median(xs) if xs else float("nan")
        print(f"| {name} | {medians[name]:.2f} ms | {min(xs, default=float('nan')):.2f} ms |")
    path = sum(v for k, v in medians.items() if k != "engine")
    print(f"\nserving path (all but the engine): {path:.2f} ms; engine {medians['engine']:.2f} ms")
    return medians


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=2048, help="prompt tokens (default: 2048)")
    ap.add_argument("--requests", type=int, default=60,
                    help="measured requests, or conversations with --agent (default: 60)")
    ap.add_argument("--agent", type=int, metavar="WORDS",
                    help="two-turn agent conversations with system blocks of WORDS words")
    ap.add_argument("--random-llama", choices=sorted(RANDOM_LLAMAS),
                    help="a random llama of that shape (default: a tiny test model)")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="an extra `serve` argument (repeatable)")
    args = ap.parse_args()
    context = 4 * args.prompt if args.agent is None else 32768
    with tempfile.TemporaryDirectory(prefix="diag-path-") as tmp:
        work = Path(tmp)
        model, vocab = diag_model(work, args.random_llama, context, num_layers=1,
                                  hidden_size=32, vocab_size=2000)
        if args.agent is not None:
            from bench.bench_agents import agent_ready

            model = agent_ready(model, context, work)
        probe = work / "probe"
        probe.mkdir()
        (probe / "sitecustomize.py").write_text(PROBE)
        env = dict(os.environ, OMLX_PATH_PROBE=str(probe), PYTHONPATH=os.pathsep.join(
            filter(None, [str(probe), str(REPO), os.environ.get("PYTHONPATH")])))
        rng = random.Random(0)
        prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt)]
                   for _ in range(args.requests + 5)]
        server = Server(model, probe / "server.log", args.server_arg, env=env)
        try:
            server.wait_ready(600)
            if args.agent is None:
                request_times(server.base, prompts[:5])  # warm-up: kernels, connections
                windows = {"": request_times(server.base, prompts[5:])}
            else:
                agent_times(server.base, args.agent // 10, 2)
                windows = agent_times(server.base, args.agent, args.requests)
            time.sleep(1.5)  # the probes' last stamps reach their files
        finally:
            server.stop()
        stamps = sorted((float(t), n) for f in probe.glob("*.ev")
                        for n, t in (line.split() for line in f.read_text().splitlines()))
    shape = f"model {args.random_llama or 'tiny'}"
    for turn, times in windows.items():
        title = (f"{args.prompt}-token prompt, {shape}" if args.agent is None else
                 f"agent {turn} ({args.agent} system words), {shape}")
        medians = print_segments(title, segments(stamps, times), times)
    if args.agent is None:
        floor = grpc_floor(args.prompt, args.requests)
        print(f"gRPC floor (bare aio client -> sync server, same request): in {floor['in']:.2f} "
              f"ms (ours: gateway's send -> handler {medians['gRPC in'] + medians['worker in']:.2f}"
              f"), out {floor['out']:.2f} ms (ours: token out -> gateway "
              f"{medians['to handler'] + medians['gRPC out']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
