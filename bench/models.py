"""Several models on one cluster: replicas against one pipeline, prefix-affine routing against
round-robin, the cost of switching models, and serving one model while another loads.

Every figure comes from real `omlx-cluster serve` processes on this machine, driven over HTTP:

1. replicas: one random llama as one 2-stage pipeline (`--nodes 2`) and as 2 replicas
   (`--nodes 2 --replicas 2`): aggregate tok/s at 16 and 32 streams (medians of --runs).
2. routing: a multi-conversation agent workload (conversations that grow turn by turn, as an
   agent's do) on 2 replicas, routed by prefix and round-robin: the share of prompt tokens the
   prefix cache served.
3. switching: two models under a --node-memory that holds one: each model's cold load, and
   the first token of a request for the evicted model (its switch cost) against a warm one.
4. loading beside: model A's tok/s (8 streams) alone and while model B loads on the same
   node: the ratio should stay within 10%.

    python -m bench.models [--runs 3] [--out bench/results] [--machine NAME]
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from bench.common import RESULTS
from tests.conftest import start_server
from tests.helpers.serving import one_fits
from tests.tiny_models import build_model

TOKENS = 48  # per request in the throughput parts


def complete(url: str, model: str, prompt: list[int], n: int) -> dict:
    r = httpx.post(url + "/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
        "ignore_eos": True}, timeout=600)
    r.raise_for_status()
    return r.json()


def first_token_seconds(url: str, model: str, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "stream": True}, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                return time.perf_counter() - t0
    raise RuntimeError("no token came")


def aggregate(url: str, model: str, streams: int, n: int = TOKENS) -> float:
    """tok/s of `streams` concurrent requests of `n` tokens each, two rounds of them."""
    prompts = [[5 + (i * 7 + j) % 300 for j in range(24)] for i in range(streams * 2)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        outs = list(pool.map(lambda p: complete(url, model, p, n), prompts))
    return sum(o["usage"]["completion_tokens"] for o in outs) / (time.perf_counter() - t0)


def part_replicas(work: Path, model: Path, runs: int) -> dict:
    out = {}
    for label, flags in (("pipeline", ("--nodes", "2")),
                         ("replicas", ("--nodes", "2", "--replicas", "2"))):
        with start_server(model, *flags, home=work / label, keepalive=None) as server:
            aggregate(server.url, model.name, 4, 8)  # warm-up
            out[label] = {s: statistics.median(aggregate(server.url, model.name, s)
                                               for _ in range(runs)) for s in (16, 32)}
    out["ratio"] = {s: out["replicas"][s] / out["pipeline"][s] for s in (16, 32)}
    return out


def agent_workload(url: str, model: str, conversations: int, turns: int) -> float:
    """Conversations that grow each turn (the last answer and a new user message appended),
    run side by side: the share of their prompt tokens the prefix cache served."""
    history = [[5 + i] + [7 + (i * 13 + j) % 290 for j in range(96)]
               for i in range(conversations)]
    cached = prompt = 0
    lock = threading.Lock()

    def turn(i: int) -> None:
        nonlocal cached, prompt
        out = complete(url, model, history[i], 16)
        with lock:
            usage = out["usage"]
            cached += usage["prompt_tokens_details"]["cached_tokens"]
            prompt += usage["prompt_tokens"]
        # The answer's ids are not returned: the next turn appends fresh "user" ids instead,
        # which keeps the whole earlier prompt as its prefix, as an agent's next turn does.
        history[i] = history[i] + [9 + (i + j + len(history[i])) % 280 for j in range(24)]

    for _ in range(turns):
        with ThreadPoolExecutor(conversations) as pool:
            list(pool.map(turn, range(conversations)))
    return cached / prompt


def part_routing(work: Path, model: Path) -> dict:
    out = {}
    for mode in ("prefix", "round-robin"):
        with start_server(model, "--nodes", "2", "--replicas", "2", "--routing", mode,
                          "--cache-block-size", "16", home=work / f"route-{mode}",
                          keepalive=None) as server:
            out[mode] = agent_workload(server.url, model.name, conversations=8, turns=5)
    out["ratio"] = out["prefix"] / max(out["round-robin"], 1e-9)
    return out


def card(url: str, name: str) -> dict:
    return httpx.get(f"{url}/v1/models/{name}", timeout=10).json()


def part_switching(work: Path, a: Path, b: Path, runs: int) -> dict:
    prompt = [5 + j % 300 for j in range(32)]
    with start_server(a, "--model", f"{b.name}={b}", "--node-memory",
                      one_fits({"a": a, "b": b}), home=work / "switch",
                      keepalive=None) as server:
        warm, switch, loads = [], [], {a.name: [], b.name: []}
        first_token_seconds(server.url, a.name, prompt)
        for _ in range(runs):
            warm.append(first_token_seconds(server.url, a.name, prompt))
            for name in (b.name, a.name):  # each request evicts the other model
                switch.append(first_token_seconds(server.url, name, prompt))
                loads[name].append(card(server.url, name)["load_seconds"])
    return {"warm_ttft_s": statistics.median(warm), "switch_ttft_s": statistics.median(switch),
            "load_seconds": {k: statistics.median(v) for k, v in loads.items()},
            "switch_over_warm": statistics.median(switch) / statistics.median(warm)}


def predicted(url: str, model: str) -> float:
    """The gateway's count of tokens generated for `model` so far."""
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(r'^omlx_tokens_predicted_total\{model="' + re.escape(model) + r'"\} (\S+)',
                  text, re.M)
    return float(m.group(1)) if m else 0.0


def rate_during(url: str, model: str, seconds_of, streams: int = 8) -> tuple[float, float]:
    """tok/s of `model` under `streams` looping requests while `seconds_of()` runs, from the
    gateway's own token counter over that window; and the window's length."""
    return rates_during(url, model, [(None, seconds_of)], streams)[0]


def rates_during(url: str, model: str, steps, streams: int = 8) -> list[tuple[float, float]]:
    """rate_during's (tok/s, window) of each `(setup, work)` of `steps` in turn under one
    set of streams (one warm-up for them all): a window spans `work()`, not `setup()`
    (None: no setup)."""
    done = threading.Event()

    def loop(i: int) -> None:
        prompt = [5 + (i * 11 + j) % 300 for j in range(24)]
        while not done.is_set():
            complete(url, model, prompt, 32)

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    time.sleep(3)  # every stream running
    out = []
    try:
        for setup, work in steps:
            if setup is not None:
                setup()
            t0, before = time.monotonic(), predicted(url, model)
            work()
            t1, after = time.monotonic(), predicted(url, model)
            out.append(((after - before) / (t1 - t0), t1 - t0))
    finally:
        done.set()
        for t in threads:
            t.join(120)
    return out


def part_loading_beside(work: Path, a: Path, b: Path, runs: int) -> dict:
    """Per run: A's tok/s over 3 s with B unloaded, then over the window in which B loads."""
    alone, during, windows = [], [], []
    with start_server(a, "--model", f"{b.name}={b}", home=work / "beside",
                      keepalive=None) as server:
        for _ in range(runs):
            httpx.post(f"{server.url}/cluster/models/{b.name}/unload",
                       timeout=60).raise_for_status()
            alone.append(rate_during(server.url, a.name, lambda: time.sleep(3.0))[0])
            rate, window = rate_during(server.url, a.name, lambda: httpx.post(
                f"{server.url}/cluster/models/{b.name}/load", timeout=600).raise_for_status())
            during.append(rate)
            windows.append(window)
    ratios = [d / a_ for d, a_ in zip(during, alone)]
    return {"alone_tok_s": statistics.median(alone),
            "while_loading_tok_s": statistics.median(during),
            "ratio": statistics.median(ratios), "load_window_s": statistics.median(windows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--machine", default=platform.node(), help="what to call this machine")
    ap.add_argument("--parts", nargs="+", default=["replicas", "routing", "switching",
                                                   "beside"])
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-models-"))
    a = build_model(work / "model-a", "llama", num_layers=8, hidden_size=256, seed=1)
    # Large enough that its load takes a while (1.2 GB of float32 weights).
    b = build_model(work / "model-b", "qwen3", num_layers=24, hidden_size=1024, seed=2)
    results: dict = {"machine": args.machine, "runs": args.runs}
    if "replicas" in args.parts:
        results["replicas"] = part_replicas(work, a, args.runs)
        print("replicas vs pipeline:", json.dumps(results["replicas"]), flush=True)
    if "routing" in args.parts:
        results["routing"] = part_routing(work, a)
        print("cache hit rate:", json.dumps(results["routing"]), flush=True)
    if "switching" in args.parts:
        results["switching"] = part_switching(work, a, b, args.runs)
        print("switching:", json.dumps(results["switching"]), flush=True)
    if "beside" in args.parts:
        results["beside"] = part_loading_beside(work, a, b, args.runs)
        print("A while B loads:", json.dumps(results["beside"]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "models-cpu.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "models-cpu.md").write_text(markdown(results))


def markdown(r: dict) -> str:
    """The results as the table bench/results/ keeps, with the ratios each claim is about."""
    lines = [f"# Several models on one cluster ({r['machine']})", "",
             f"Medians of {r['runs']} runs; every figure from real `serve` processes over HTTP "
             "on this machine (`python -m bench.models`).", ""]
    if "replicas" in r:
        x = r["replicas"]
        lines += ["## 2 replicas vs one 2-stage pipeline (same model, same 2 local nodes)", "",
                  "| streams | pipeline tok/s | replicas tok/s | replicas / pipeline |",
                  "| ---: | ---: | ---: | ---: |"]
        lines += [f"| {s} | {x['pipeline'][s]:.0f} | {x['replicas'][s]:.0f} | "
                  f"{x['ratio'][s]:.2f} |" for s in x["pipeline"]]
        lines.append("")
    if "routing" in r:
        x = r["routing"]
        lines += ["## Prefix cache hit rate, 8 growing conversations x 5 turns, 2 replicas", "",
                  f"- prefix-affine routing: {x['prefix']:.1%} of prompt tokens from the cache",
                  f"- round-robin: {x['round-robin']:.1%}",
                  f"- ratio: {x['ratio']:.2f}", ""]
    if "switching" in r:
        x = r["switching"]
        lines += ["## Switching models under a budget that holds one", "",
                  f"- warm first token: {x['warm_ttft_s'] * 1e3:.0f} ms",
                  f"- first token of a request for the evicted model (evict + load + prefill): "
                  f"{x['switch_ttft_s'] * 1e3:.0f} ms ({x['switch_over_warm']:.0f}x warm)",
                  "- cold load per model: " + ", ".join(
                      f"{k} {v:.2f} s" for k, v in x["load_seconds"].items()), ""]
    if "beside" in r:
        x = r["beside"]
        lines += ["## Model A's decode while model B loads on the same node (8 streams)", "",
                  f"- A alone: {x['alone_tok_s']:.0f} tok/s; while B loads: "
                  f"{x['while_loading_tok_s']:.0f} tok/s; ratio {x['ratio']:.2f} "
                  f"(goal >= 0.90), over B's {x['load_window_s']:.1f} s load", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
