"""The HTTP load of a comparison: streamed completions sent at once from separate client
processes (`python -m bench.load_client`, each started and connected before a go signal on its
stdin), so that Python's client cost stays out of the timed path and off the server's cores
where it can; `http_workloads` turns a server into run_workloads' `single` and `batch`."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import with_repo_path


async def _client_stream(client, url: str, body: dict) -> dict:
    """One streamed completion: send time, first-text time, last-event time, token count. JSON
    is parsed only until the first text and for the usage chunk, to keep the client cheap. A
    connection the server drops before answering is made again (mlx_lm.server's listen
    backlog is 5: at 64 streams at once some connections are reset), its time counted."""
    import httpx

    t0 = time.monotonic()
    for attempt in range(5):
        try:
            return await _client_read(client, url, body, t0)
        except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
            if attempt == 4:
                raise
            await asyncio.sleep(0.05)
    raise AssertionError("unreachable")


async def _client_read(client, url: str, body: dict, t0: float) -> dict:
    ttft = last = None
    tokens = events = 0
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            now = time.monotonic()
            data = line[6:]
            if data == "[DONE]":
                break
            if '"error"' in data:
                raise RuntimeError(f"stream error: {data[:500]}")
            if '"usage"' in data:
                obj = json.loads(data)
                if obj.get("usage") and not obj.get("choices"):
                    tokens = obj["usage"]["completion_tokens"]
                    continue
            if ttft is None:
                choices = json.loads(data)["choices"]
                if not (choices and choices[0].get("text")):
                    continue
                ttft = now - t0
            events += 1
            last = now
    return {"t0": t0, "ttft": ttft, "t_first": t0 + ttft if ttft is not None else None,
            "t_last": last, "end": time.monotonic(), "tokens": tokens, "events": events}


async def _client_main(spec: dict) -> list[dict]:
    import httpx

    n = len(spec["bodies"])
    async with httpx.AsyncClient(timeout=httpx.Timeout(spec["timeout"]),
                                 limits=httpx.Limits(max_connections=n + 4)) as client:
        # A fresh process's first request pays for lazy imports and connection setup (~25 ms on
        # the 2-core VM, ~145 ms on the H200 host, for every server alike): done before the
        # clock starts, with one kept-alive connection per stream where the server keeps them,
        # as an agent's SDK client does.
        models = spec["url"].rsplit("/v1/", 1)[0] + "/v1/models"
        t = time.monotonic()
        await asyncio.gather(*(client.get(models) for _ in range(n)))
        warmup = time.monotonic() - t
        print("ready", flush=True)
        # The parent starts every client process at once, once all are up.
        await asyncio.to_thread(sys.stdin.readline)
        streams = await asyncio.gather(*(_client_stream(client, spec["url"], b)
                                         for b in spec["bodies"]))
        return [s | {"client_warmup_s": warmup} for s in streams]


def run_clients(url: str, bodies: list[dict], procs: int, work: Path, timeout: float
                ) -> list[dict]:
    """Streams `bodies` at once from `procs` client processes; every stream's timings."""
    procs = max(1, min(procs, len(bodies)))
    parts, outs, running = [bodies[i::procs] for i in range(procs)], [], []
    env = with_repo_path(dict(os.environ))
    for i, part in enumerate(parts):
        spec_file, out_file = work / f"client{i}.in.json", work / f"client{i}.out.json"
        spec_file.write_text(json.dumps({"url": url, "bodies": part, "timeout": timeout}))
        out_file.unlink(missing_ok=True)
        outs.append(out_file)
        running.append(subprocess.Popen(
            [sys.executable, "-m", "bench.load_client", "--_spec", str(spec_file),
             "--_result", str(out_file)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env))
    try:
        for p in running:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a load client failed to start")
        for p in running:
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in running:
            if p.wait(timeout) != 0:
                raise RuntimeError(f"a load client failed with code {p.returncode}")
    finally:
        for p in running:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [s for f in outs for s in json.loads(f.read_text())]


def http_workloads(spec: dict, url: str, body, work: Path, procs: int):
    """`single` and `batch` (run_workloads) over HTTP; body(prompt, max_tokens) is one request's
    JSON."""
    def batch(prompts: list[list[int]], max_tokens: int, procs: int = procs) -> dict:
        streams = run_clients(url, [body(p, max_tokens) for p in prompts], procs, work,
                              spec["timeout"])
        t0, end = min(s["t0"] for s in streams), max(s["end"] for s in streams)
        ntok = sum(s["tokens"] for s in streams)
        return {"agg_tps": ntok / (end - t0), "wall": end - t0, "tokens": ntok,
                "ttft_mean": statistics.mean(s["ttft"] for s in streams)}

    def single(prompt: list[int], max_tokens: int) -> dict:
        # End to end: a server that writes its events in bursts (mlx_lm.server does, on a CPU)
        # would make a first-to-last-event rate meaningless.
        s = run_clients(url, [body(prompt, max_tokens)], 1, work, spec["timeout"])[0]
        return {"ttft": s["ttft"], "decode_tps": s["tokens"] / (s["end"] - s["t0"]),
                "tokens": s["tokens"], "events": s["events"],
                "client_warmup_s": s["client_warmup_s"]}

    return single, batch


def main() -> int:
    """A client process: streams its spec's bodies at once, writes every stream's timings."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--_spec", required=True)
    ap.add_argument("--_result", required=True)
    args = ap.parse_args()
    res = asyncio.run(_client_main(json.loads(Path(args._spec).read_text())))
    Path(args._result).write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
