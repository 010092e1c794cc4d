"""How long a client waits when a pipeline stage dies mid-stream.

Serves a model as a 2-node pipeline (`serve --nodes 2`), streams a long greedy completion, kills
the tail's shard worker (or its whole node agent) after some tokens, and measures:

- detect: from the kill to the coordinator starting its re-plan (heartbeats),
- reload: the re-plan itself, of which `load` is the slowest worker's model load,
- first token: from the kill to the first token the client receives from the new plan (the
  token after the longest pause; tokens already in flight arrive before it),
- and that the output equals an undisturbed run.

    python -m bench.failover [--model PATH] [--tiny] [--repeats 3] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
from bench.common import RESULTS, free_port
from omlx_shared.child import omlx_command


def start_server(model: Path, home: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, OMLX_CLUSTER_HOME=str(home))
    log = open(home / f"server-{port}.log", "wb")
    proc = subprocess.Popen(omlx_command("serve", "--model", str(model), "--port", str(port),
                                         "--nodes", "2", "--hot-cache-max-size", "0"),
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not start")


def one_run(url: str, model_id: str, target: str, kill_after: int, max_tokens: int) -> dict:
    body = {"model": model_id, "prompt": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    reference = httpx.post(url + "/v1/completions", json=body, timeout=300).json()
    reference = reference["choices"][0]["text"]
    epoch = httpx.get(url + "/cluster/status", timeout=5).json()["epoch"]
    text, n, t_kill = "", 0, None
    after: list[float] = []  # arrival times of the tokens after the kill
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                      timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            d = json.loads(line[6:])
            if not d.get("choices"):
                continue
            text += d["choices"][0]["text"]
            n += 1
            if t_kill is not None:
                after.append(time.time())
            if n == kill_after:
                health = httpx.get(url + "/health", timeout=5).json()
                os.kill(health["nodes"][1][target], signal.SIGKILL)
                t_kill = time.time()
    deadline = time.monotonic() + 60
    while True:
        status = httpx.get(url + "/cluster/status", timeout=5).json()
        if status["epoch"] > epoch and status["ready"] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    rec = status["last_recovery"] or {}
    # Tokens already on their way arrive right after the kill; the first token generated on
    # the new plan is the one after the longest pause.
    gaps = [b - a for a, b in zip([t_kill] + after, after)]
    first_after = after[gaps.index(max(gaps))] - t_kill if after else None
    return {"identical": text == reference, "first_token_after_kill_s": first_after,
            "detect_s": rec.get("started_at", t_kill) - t_kill, "replan_s": rec.get("seconds"),
            "load_s": rec.get("load_seconds"), "stages_after": len(status["plan"]["stages"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="model folder (default: the default model)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random llama instead")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--kill-after", type=int, default=20)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="omlx-failover-"))
    if args.tiny:
        from tests.tiny_models import build_model

        model = build_model(work / "tiny-failover", "llama", num_layers=8, hidden_size=256)
    else:
        from omlx_shared.model_spec import resolve_model

        model = args.model or resolve_model(None)
    rows = []
    for target in ("worker_pid", "agent_pid"):
        runs = []
        for i in range(args.repeats):
            home = work / f"home-{target}-{i}"
            home.mkdir()
            proc, url = start_server(model, home)
            try:
                runs.append(one_run(url, model.name, target, args.kill_after, args.max_tokens))
            finally:
                proc.terminate()
                proc.wait(30)
        med = {k: statistics.median(r[k] for r in runs if r[k] is not None)
               for k in ("first_token_after_kill_s", "detect_s", "replan_s", "load_s")}
        rows.append({"killed": target.replace("_pid", ""), "runs": runs, "median": med,
                     "all_identical": all(r["identical"] for r in runs)})
        print(target, json.dumps(med), "identical:", rows[-1]["all_identical"], flush=True)
    stem = "failover-tiny-cpu" if args.tiny else "failover-cpu"
    result = {"machine": f"{platform.processor() or platform.machine()} "
                         f"({os.cpu_count()} cores), {platform.system()}",
              "model": model.name, "repeats": args.repeats, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    md = [f"# Failover: time to the first token after a stage dies ({model.name})", "",
          f"- machine: {result['machine']}; 2-node pipeline on one machine (`serve --nodes 2`), "
          f"{args.repeats} runs each, medians", "",
          "| killed | detect (s) | re-plan (s) | of which load (s) | kill -> next token (s) | "
          "output identical |", "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        m = r["median"]
        md.append(f"| {r['killed']} | {m['detect_s']:.2f} | {m['replan_s']:.2f} | "
                  f"{m['load_s']:.2f} | {m['first_token_after_kill_s']:.2f} | "
                  f"{r['all_identical']} |")
    (args.out / f"{stem}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
