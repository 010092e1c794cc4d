"""The gateway under overload: many more concurrent requests than a model's queue bound.

Serves a tiny random llama with `--max-batch 8` (so `--max-queue` defaults to 32), sends N
concurrent chat completions (loopback, one connection each) and checks issue 46's goal: every
excess request refused (429 with Retry-After) within 100 ms, every admitted one completed, the
gateway's memory bounded (its RSS before, at peak and after), and the server serving
afterwards. Three runs: every connection opened first, then every request sent at once, each
timed from its send (the server's answer alone); every connection opened and its request sent
at once, each timed from its connect (the client's connects, as fast as one Python process
makes them, and the server's accepts counted too); the same number spread evenly over a few
seconds. The end of a latency is the kernel's receive timestamp of the answer
(tests/helpers/burst.py).

    python -m bench.overload [--requests 2000] [--max-batch 8] [--out bench/results]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.common import Server, machine_info, machine_tag
from tests.helpers.burst import burst
from tests.tiny_models import build_model

REFUSED_WITHIN_MS = 100.0  # the goal


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class PeakRss:
    """The most RSS a process showed while this runs, sampled every 20 ms in a thread."""

    def __init__(self, pid: int):
        self.pid, self.peak = pid, rss_bytes(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, rss_bytes(self.pid))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def percentile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


def outcomes(answers: list[dict]) -> list[dict]:
    """Per request its status, Retry-After, completion tokens and milliseconds to its answer."""
    return [{"status": a["status"], "retry_after": a["headers"].get("retry-after"),
             "tokens": a["body"]["usage"]["completion_tokens"] if a["status"] == 200 else 0,
             "ms": a["ms"]} for a in answers]


def summary(results: list[dict], max_tokens: int, wall: float, cpu: float) -> dict:
    refused = [x for x in results if x["status"] == 429]
    admitted = [x for x in results if x["status"] == 200]
    refused_ms = [x["ms"] for x in refused if not math.isnan(x["ms"])]  # nan: no kernel time
    return {
        "admitted": len(admitted), "refused": len(refused),
        "other": len(results) - len(admitted) - len(refused),
        "all_completed": all(x["tokens"] == max_tokens for x in admitted),
        "refused_p50_ms": percentile(refused_ms, 50), "refused_p99_ms": percentile(refused_ms, 99),
        "refused_max_ms": max(refused_ms, default=float("nan")),
        "refused_within": sum(ms <= REFUSED_WITHIN_MS for ms in refused_ms),
        "retry_after_values": sorted({int(x["retry_after"]) for x in refused
                                      if x["retry_after"]}),
        "admitted_p50_ms": statistics.median([x["ms"] for x in admitted]) if admitted else 0,
        "admitted_max_ms": max((x["ms"] for x in admitted), default=0),
        "wall_s": wall, "gateway_cpu_ms_per_request": cpu * 1000 / len(results),
    }


def markdown(r: dict) -> str:
    m, runs = r["machine"], r["runs"]
    mib = 1 << 20

    def row(name: str, cell) -> str:
        return f"| {name} | " + " | ".join(cell(x) for x in runs.values()) + " |"

    return "\n".join([
        f"# Overload: {r['requests']} concurrent requests, --max-batch {r['max_batch']} "
        f"(--max-queue {r['max_queue']})",
        "",
        f"Machine: {m['cpu']} ({m['cpu_count']} cores, shared), {m['platform']}, Python "
        f"{m['python']}; commit {m['git_commit']} plus this change. Tiny random llama "
        f"(4 layers, hidden 64), max_tokens {r['max_tokens']} each, ignore_eos; loopback, one "
        "connection a request (`python -m bench.overload --out bench/results`).",
        "",
        "| | " + " | ".join(runs) + " |",
        "|---|" + "---|" * len(runs),
        row("admitted (200), all completed", lambda x: f"{x['admitted']}, {x['all_completed']}"),
        row("refused (429 + Retry-After) / other", lambda x: f"{x['refused']} / {x['other']}"),
        row("refusal latency p50 / p99 / max, ms", lambda x: f"{x['refused_p50_ms']:.1f} / "
            f"{x['refused_p99_ms']:.1f} / {x['refused_max_ms']:.1f}"),
        row(f"refused within {REFUSED_WITHIN_MS:.0f} ms",
            lambda x: f"{x['refused_within']} of {x['refused']}"),
        row("Retry-After values, s", lambda x: str(x["retry_after_values"])),
        row("admitted latency p50 / max, ms",
            lambda x: f"{x['admitted_p50_ms']:.0f} / {x['admitted_max_ms']:.0f}"),
        row("wall time, s", lambda x: f"{x['wall_s']:.2f}"),
        row("gateway CPU per request, ms", lambda x: f"{x['gateway_cpu_ms_per_request']:.2f}"),
        "",
        f"Gateway RSS before / peak / after both runs: {r['rss_before'] / mib:.0f} / "
        f"{r['rss_peak'] / mib:.0f} / {r['rss_after'] / mib:.0f} MiB; serves afterwards: "
        f"{r['serves_after']}.",
        "",
        "Latency ends at the kernel's receive timestamp of the answer's first bytes "
        "(SO_TIMESTAMPNS: the client's own loop is not counted); it starts when the request "
        "was sent (connected first) or when its connect began (the other two). Client, gateway "
        "and node worker share the same cores, which other work shared too (load average "
        f"{r['load_before']:.1f} at the start, {r['load_after']:.1f} at the end). All at once, "
        "the gateway answers the requests one after another on its one event loop: a "
        "refusal's latency is its place in that line times what the gateway spends per "
        "refusal, not a wait for generation. Refusals are answered by the HTTP protocol from "
        "the headers (omlx_coordinator/http/connections.py) once every model's bound is taken, "
        "the requests still undecided counted. Spread, requests arrive at a steady rate far "
        "past what the model drains.",
        "",
    ])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000, help="concurrent (default: 2000)")
    ap.add_argument("--max-batch", type=int, default=8, help="the server's (default: 8)")
    ap.add_argument("--max-tokens", type=int, default=32, help="per request (default: 32)")
    ap.add_argument("--spread", type=float, default=4.0, metavar="SECONDS",
                    help="the second run's requests start evenly over this long (default: 4)")
    ap.add_argument("--out", type=Path, help="write overload_<machine>.md here")
    args = ap.parse_args()
    runs = {}
    with tempfile.TemporaryDirectory(prefix="bench-overload-") as tmp:
        work = Path(tmp)
        model = build_model(work / "tiny-llama", "llama", num_layers=4, hidden_size=64)
        server = Server(model, work / "server.log", ["--max-batch", str(args.max_batch)])
        try:
            server.wait_ready(300)
            body = {"model": "bench", "max_tokens": args.max_tokens, "ignore_eos": True,
                    "messages": [{"role": "user", "content": "Count to ten."}]}
            burst(server.base, body, 4)  # warm: the first requests' one-offs
            time.sleep(1.0)
            limit = int(next(line.rsplit(" ", 1)[1] for line in httpx.get(
                server.base + "/metrics").text.splitlines()
                if line.startswith("omlx_model_queue_limit{")).split(".")[0])
            pid = server.proc.pid
            rss_before, load_before = rss_bytes(pid), os.getloadavg()[0]
            peak = PeakRss(pid)
            for name, spread, first in (("connected, sent at once", 0.0, True),
                                        ("connecting at once", 0.0, False),
                                        (f"spread over {args.spread:g} s", args.spread, False)):
                t0, cpu0 = time.perf_counter(), cpu_seconds(pid)
                results = outcomes(burst(server.base, body, args.requests, spread,
                                         connect_first=first))
                runs[name] = summary(results, args.max_tokens, time.perf_counter() - t0,
                                     cpu_seconds(pid) - cpu0)
                time.sleep(2.0)
            rss_peak = peak.stop()
            rss_after = rss_bytes(pid)
            serves = httpx.post(server.base + "/v1/chat/completions", json=body,
                                timeout=60).status_code == 200
        finally:
            server.stop()
    result = {"machine": machine_info(), "requests": args.requests,
              "max_batch": args.max_batch, "max_queue": limit, "max_tokens": args.max_tokens,
              "runs": runs, "rss_before": rss_before, "rss_peak": rss_peak,
              "rss_after": rss_after, "serves_after": serves, "load_before": load_before,
              "load_after": os.getloadavg()[0]}
    text = markdown(result)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"overload-{machine_tag(result['machine'])}.md").write_text(text)
    ok = serves and all(x["other"] == 0 and x["all_completed"] for x in runs.values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
