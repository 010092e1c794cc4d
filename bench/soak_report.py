"""The chaos soak's record and its report (bench/soak.py): what each request and fault came to,
the faults it injects, and the analysis that writes soak-cpu.md, soak-cpu.svg and
soak-cpu.json from them (also again from a finished run's raw results, `--report-from`)."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import median

SAMPLE_EVERY = 5.0  # seconds between /proc samples
RECOVERY_LIMIT = 180.0  # seconds a fault's pause is measured for at most
WARM_UP = 180.0  # seconds before growth is measured: the KV tiers and MLX's allocator fill
PROC_WARM_UP = 60.0  # seconds of a process's own life it loads and warms (a restarted one)
# Seconds of the window a process must live to be judged on its own. Faults replace a worker
# every few minutes (a 30-minute run had none live 6): longer, and no worker would be judged.
LONG_LIVED = 150.0
HOT_CACHE = "16MiB"  # each worker's RAM KV tier: small, so that it is full after warm-up
FAULTS = ("kill_worker", "kill_agent", "kill_coordinator", "stop_worker", "stop_agent",
          "fill_disk", "drop_link")

# What each shard worker's /metrics says of its memory: the RAM KV tier, MLX's allocator
# (in use and freed-but-kept), the sequences' KV. Lets a growing RSS be told apart.
# (series name, a label it must carry or "") -> the name it is kept under.
STAGE_GAUGES = {("omlx_node_kv_cache_bytes", 'tier="ram"'): "ram_tier",
                ("omlx_node_mlx_active_bytes", ""): "mlx_active",
                ("omlx_node_mlx_cache_bytes", ""): "mlx_cache",
                ("omlx_node_kv_cache_used_bytes", ""): "kv_used"}


@dataclass
class Outcome:
    kind: str
    outcome: str  # identical / different / completed / cancelled / failed_clear / ...
    start: float
    end: float
    ttft: float | None = None
    detail: str = ""


@dataclass
class Fault:
    kind: str
    target: str
    at: float
    pause: float | None = None  # until /health 200 and a greedy request succeeded
    health_after: float | None = None
    detail: str = ""
    main_before: list[str] | None = None  # drop_link: the nodes with a stage of main at the cut


def explained(o: Outcome, faults: list[Fault], kills: tuple[str, ...]) -> bool:
    """Whether the request ran while a fault of one of `kills` was in effect: from 2 s before
    it until the cluster served again (a coordinator being restarted refuses connections)."""
    return any(f.kind in kills and o.start <= f.at + (f.pause or RECOVERY_LIMIT)
               and f.at - 2 <= o.end for f in faults)


# --- report ------------------------------------------------------------------------------

def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def classify(outcomes: list[Outcome], faults: list[Fault]) -> dict[str, int]:
    table: dict[str, int] = {}
    for o in outcomes:
        name = o.outcome
        if name == "connection_closed":
            name += (" (coordinator killed meanwhile)"
                     if explained(o, faults, ("kill_coordinator",)) else " (no coordinator kill)")
        if name in ("failed_clear", "failed_unclear", "lost"):
            name += "" if explained(o, faults, FAULTS) else " (no fault meanwhile)"
        table[name] = table.get(name, 0) + 1
    return dict(sorted(table.items()))


def role_names(sample: dict) -> list[str]:
    return [k for k, v in sample.items() if isinstance(v, dict) and "rss" in v]


def thirds(points: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """The values of the first and of the last third of the points' time span."""
    t0, t1 = points[0][0], points[-1][0]
    span = (t1 - t0) / 3
    return [v for t, v in points if t <= t0 + span], [v for t, v in points if t >= t1 - span]


def change(points: list[tuple[float, float]]) -> dict:
    """Median and max of the first third against the last third, with the change in %."""
    first, last = thirds(points)

    def pct_of(a: float, b: float) -> float | None:
        return round(100 * (b - a) / a, 1) if a else None

    m0, m1, x0, x1 = median(first), median(last), max(first), max(last)
    return {"first": m0, "last": m1, "pct": pct_of(m0, m1), "max_first": x0, "max_last": x1,
            "max_pct": pct_of(x0, x1), "samples": [len(first), len(last)]}


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    """The least-squares slope of the points, a unit an hour."""
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return 3600 * sum((t - mt) * (v - mv) for t, v in points) / var if var else 0.0


def steady(samples: list[dict]) -> dict:
    """Growth after warm-up, measured so that restarts do not read as growth (a process
    started again is lighter than a warmed one, and a start/end snapshot lands on either):

    - roles: each role's sum over the post-warm-up window, the median (and max) of its first
      third against its last third: a median of ~100 samples ignores the short dips while a
      killed process restarts;
    - processes: each process (pid and role) on its own, past its own first PROC_WARM_UP s
      (a worker's counted from when it took a shard), that lived at least LONG_LIVED s of
      the window: its first third against its last, and
      its RSS's slope; `whole` says it lived the whole window. A leak shows here as steady
      growth of one process, which no restart hides. A worker's STAGE_GAUGES likewise."""
    window = [s for s in samples if s["t"] >= WARM_UP]
    if len(window) < 3:
        return {"roles": {}, "processes": []}
    roles = {}
    for role in role_names(window[-1]):
        roles[role] = {m: change([(s["t"], s[role][m]) for s in window if role in s])
                       for m in ("rss", "fds", "threads", "procs")}
    series: dict[tuple[str, str], list[dict]] = {}
    for s in samples:
        for pid, (role, rss, fds, threads) in s.get("procs", {}).items():
            if not rss:  # a zombie: it exited, its agent has not reaped it yet
                continue
            series.setdefault((pid, role), []).append(
                {"t": s["t"], "rss": rss, "fds": fds, "threads": threads,
                 **s.get("stages", {}).get(pid, {})})
    t_end = window[-1]["t"]
    processes = []
    for (pid, role), points in series.items():
        born = points[0]["t"] if points[0]["t"] > samples[0]["t"] else -math.inf
        # A worker is first the agent's standby (no shard, ~2 threads): its life as a stage
        # starts when it exports metrics, and taking a shard is not growth.
        born = next((p["t"] for p in points if "mlx_active" in p), born)
        kept = [p for p in points if p["t"] >= max(WARM_UP, born + PROC_WARM_UP)]
        if len(kept) < 3 or kept[-1]["t"] - kept[0]["t"] < LONG_LIVED:
            continue
        whole = kept[0]["t"] <= WARM_UP + 2 * SAMPLE_EVERY and kept[-1]["t"] >= t_end - 2 * SAMPLE_EVERY
        entry = {"pid": int(pid), "role": role, "from": kept[0]["t"], "to": kept[-1]["t"],
                 "whole": whole,
                 "rss_mib_per_hour": round(slope_per_hour(
                     [(p["t"], p["rss"] / 2**20) for p in kept]), 1)}
        for m in ("rss", "fds", "threads", *STAGE_GAUGES.values()):
            points_m = [(p["t"], p[m]) for p in kept if m in p]
            if len(points_m) >= 3:
                entry[m] = change(points_m)
        processes.append(entry)
    return {"roles": roles, "processes": sorted(processes, key=lambda e: (e["role"], e["from"]))}


def svg_chart(samples: list[dict]) -> str:
    """Three small line charts (RSS MiB, fds, threads) over time, a line per role."""
    roles = role_names(samples[-1])
    colours = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
    w, h, pad = 600, 160, 40
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w + 180}" height="{3 * (h + pad) + 20}"'
             ' font-family="sans-serif" font-size="11">']
    tmax = max(s["t"] for s in samples) or 1
    for i, (metric, scale, unit) in enumerate((("rss", 2 ** 20, "RSS MiB"), ("fds", 1, "open fds"),
                                               ("threads", 1, "threads"))):
        y0 = 20 + i * (h + pad)
        vmax = max((s[r][metric] / scale for s in samples for r in roles if r in s), default=1) or 1
        parts.append(f'<text x="{pad}" y="{y0 - 5}">{unit} (max {vmax:.0f}) over {tmax:.0f} s</text>')
        parts.append(f'<rect x="{pad}" y="{y0}" width="{w}" height="{h}" fill="none" stroke="#999"/>')
        for j, role in enumerate(roles):
            pts = " ".join(f"{pad + w * s['t'] / tmax:.1f},{y0 + h - h * s[role][metric] / scale / vmax:.1f}"
                           for s in samples if role in s)
            c = colours[j % len(colours)]
            parts.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.5" points="{pts}"/>')
            if i == 0:
                parts.append(f'<text x="{pad + w + 10}" y="{y0 + 15 + 15 * j}" fill="{c}">{role}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def machine() -> str:
    cpu = "?"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores ({cpu})"


def tier_lines(root: Path, words: str) -> int:
    """How many lines of the nodes' worker logs say `words`."""
    return sum(line.count(words) for path in root.glob("home-*/logs/*worker*.log")
               for line in path.read_text(errors="replace").splitlines())


def mib_change(c: dict | None) -> str:
    return "-" if c is None else f"{c['first'] / 2**20:.1f} → {c['last'] / 2**20:.1f} ({c['pct']}%)"


def plain_change(c: dict | None) -> str:
    return "-" if c is None else f"{c['first']:.0f} → {c['last']:.0f} ({c['pct']}%)"


def report(out: Path, args, outcomes: list[Outcome], faults: list[Fault], samples: list[dict],
           duration: float, commit: str, root: Path, no_link_drops: str | None) -> None:
    """`no_link_drops`: why the run dropped no link (no network namespaces), None if it did."""
    out.mkdir(parents=True, exist_ok=True)
    table = classify(outcomes, faults)
    ttfts = [o.ttft for o in outcomes if o.ttft is not None]
    grow = steady(samples)
    loads = sorted(s["load"] for s in samples if "load" in s)
    ram_max = max((g.get("ram_tier", 0) for s in samples for g in s.get("stages", {}).values()),
                  default=0)
    by_kind: dict[str, int] = {}
    for f in faults:
        by_kind[f.kind] = by_kind.get(f.kind, 0) + 1
    bugs = [o for o in outcomes if o.outcome in ("different", "lost", "truncated", "malformed",
                                                 "failed_unclear")]
    raw = {"machine": machine(), "commit": commit, "duration_s": round(duration, 1),
           "args": vars(args), "outcomes": table, "faults_by_kind": by_kind,
           "ttft_p50": pct(ttfts, 0.5), "ttft_p99": pct(ttfts, 0.99),
           "faults": [asdict(f) for f in faults], "requests": [asdict(o) for o in outcomes],
           "samples": samples, "growth": grow, "logs": str(root),
           "no_link_drops": no_link_drops}
    (out / "soak-cpu.json").write_text(json.dumps(raw, indent=1, default=str))
    if samples:
        (out / "soak-cpu.svg").write_text(svg_chart(samples))

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    lines = [
        "# Chaos soak on CPU (`bench/soak.py`)", "",
        f"- Machine: {machine()}, **{args.machine_note}** (timings are slow and noisy); "
        f"1-minute load average over the run: min {fmt(loads[0] if loads else None)}, "
        f"median {fmt(pct(loads, 0.5))}, max {fmt(loads[-1] if loads else None)}.",
        f"- Commit: `{commit}`; duration {duration / 60:.1f} min; {args.clients} client threads;"
        f" seed {args.seed}; a fault every {args.gap_min:.0f}-{args.gap_max:.0f} s;"
        f" per-request deadline {args.deadline:.0f} s.",
        "- Cluster: a coordinator and two `join` nodes, two tiny random llama models (`main` "
        "a 2-stage pipeline over both nodes, `side` loaded on demand).",
        "- Each node's SSD KV tier on a tmpfs of its own (1100 MiB: the tier keeps 1 GiB "
        "free); `fill_disk` takes one to 16 MiB from full for 10-20 s.",
        *(["- Node b (its agent and workers) in a network namespace of its own, joined by a "
           "veth pair to the coordinator's and node a's, where the clients run too; "
           "`drop_link` drops every packet on it (tc) for 5-20 s, then heals it. Every fault "
           "kind the issue names is injected."] if no_link_drops is None else
          [f"- All on loopback. Not injected: dropped links ({no_link_drops})."]), "",
        "## Faults", "",
        "| kind | count |", "|---|---|",
        *(f"| {k} | {v} |" for k, v in sorted(by_kind.items())), "",
        "| at (s) | fault | target | /health 200 after (s) | greedy served after (s) | note |",
        "|---|---|---|---|---|---|",
        *(f"| {f.at - outcomes[0].start if outcomes else 0:.0f} | {f.kind} | {f.target} | "
          f"{fmt(f.health_after)} | {fmt(f.pause)} | {f.detail.strip()} |" for f in faults), "",
        "## Requests by outcome", "",
        f"{len(outcomes)} requests. `identical`: greedy, equal to the fault-free reference; "
        "`completed`: sampled; `cancelled`: the client closed it on purpose; `failed_clear`: an "
        "HTTP error with an error body or a stream ending with an error event; "
        "`connection_closed`: the connection dropped; `lost`: no answer within the deadline; "
        "`different`/`truncated`/`malformed`/`failed_unclear`: bugs.", "",
        "| outcome | requests |", "|---|---|", *(f"| {k} | {v} |" for k, v in table.items()), "",
        f"The SSD KV tier on a full disk (the nodes' worker logs): said it skips writes "
        f"{tier_lines(root, 'skipping SSD writes')} time(s), that they resume "
        f"{tier_lines(root, 'SSD writes resume')} time(s), that it gave them up (a write "
        f"failed) {tier_lines(root, 'continuing with the RAM tier only')} time(s).", "",
        f"TTFT over {len(ttfts)} streams: p50 {fmt(pct(ttfts, 0.5))} s, "
        f"p99 {fmt(pct(ttfts, 0.99))} s.", "",
        "## Processes", "",
        f"Sampled every {SAMPLE_EVERY:.0f} s from /proc (RSS, open fds, threads), with each "
        "shard worker's own gauges from its /metrics: the RAM KV tier's bytes "
        f"(`--hot-cache-max-size {HOT_CACHE}` a worker, small so that it would be full after "
        f"warm-up; it held at most {ram_max / 2**20:.1f} MiB: the load has few distinct "
        "prefixes), "
        "MLX's memory in use and its allocator's cache. Growth is measured after a warm-up of "
        f"{WARM_UP:.0f} s, not as a start/end snapshot: processes are killed and started again "
        "all through the run, and a fresh one is lighter than a warmed one, so a snapshot says "
        "more about when the last restart was than about a leak. Two views:", "",
        "- per role: the role's sum, the median (and the max) over the first third of the "
        "post-warm-up window against the last third; the medians ignore the short dips while a "
        "killed process restarts;",
        f"- per process: every process that lived at least {LONG_LIVED:.0f} s of the window past "
        f"its own first {PROC_WARM_UP:.0f} s (a worker's counted from when it took a shard: "
        "the agent keeps a standby worker with no shard, ~104 MiB and 2 threads), its own "
        "first third against its last third, and its RSS's least-squares slope; `whole`: it "
        "lived the whole window. A leak is steady growth of one process, which no restart "
        "hides.", "",
        "The raw samples (each process's, each role's sums, each worker's gauges) are in "
        "soak-cpu.json.", "",
        "| role | processes (median) | RSS MiB median first → last third | RSS max | "
        "fds median | threads median |", "|---|---|---|---|---|---|",
        *(f"| {role} | {g['procs']['first']:.0f} → {g['procs']['last']:.0f} | "
          f"{g['rss']['first'] / 2**20:.0f} → {g['rss']['last'] / 2**20:.0f} "
          f"({g['rss']['pct']}%) | {g['rss']['max_first'] / 2**20:.0f} → "
          f"{g['rss']['max_last'] / 2**20:.0f} ({g['rss']['max_pct']}%) | "
          f"{g['fds']['first']:.0f} → {g['fds']['last']:.0f} ({g['fds']['pct']}%) | "
          f"{g['threads']['first']:.0f} → {g['threads']['last']:.0f} ({g['threads']['pct']}%) |"
          for role, g in grow["roles"].items()), "",
        "| process | window (s) | RSS MiB median first → last third | RSS slope MiB/h | fds | "
        "threads | RAM KV tier MiB | MLX active MiB | MLX cache MiB |",
        "|---|---|---|---|---|---|---|---|---|",
        *(f"| {e['role']} {e['pid']} | {e['from']:.0f}-{e['to']:.0f}"
          f"{' (whole)' if e['whole'] else ''} | {mib_change(e.get('rss'))} | "
          f"{e['rss_mib_per_hour']} | {plain_change(e.get('fds'))} | "
          f"{plain_change(e.get('threads'))} | {mib_change(e.get('ram_tier'))} | "
          f"{mib_change(e.get('mlx_active'))} | {mib_change(e.get('mlx_cache'))} |"
          for e in grow["processes"]), "",
        "![RSS, fds and threads over time](soak-cpu.svg)", "",
        "## Requests that look like bugs", "",
        *(f"- {o.kind} at {o.start - outcomes[0].start:.0f} s: {o.outcome}: {o.detail}"
          for o in bugs[:40]),
        *([] if bugs else ["None."]),
    ]
    (out / "soak-cpu.md").write_text("\n".join(lines) + "\n")


def report_again(path: Path, out: Path) -> None:
    """The report of a finished run from its soak-cpu.json (the analysis may change after)."""
    raw = json.loads(path.read_text())
    args = argparse.Namespace(**raw["args"])
    report(out, args, [Outcome(**o) for o in raw["requests"]], [Fault(**f) for f in raw["faults"]],
           raw["samples"], raw["duration_s"], raw["commit"], Path(raw["logs"]),
           raw.get("no_link_drops", "the soak did not drop links at this commit"))
    print((out / "soak-cpu.md").read_text())
