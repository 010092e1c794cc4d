"""The commands that ask a running gateway: `status`, `rebalance` and `models
load|unload|pin|unpin`, rendered with rich."""

from __future__ import annotations

import argparse
import sys
import threading

from omlx_cluster.api_keys import ApiKeyError, api_keys


def client_api_key(args: argparse.Namespace) -> str | None:
    """The key to send to a gateway: the first given (api_keys.py); exits 2 on a bad one."""
    try:
        return next(iter(api_keys(args)), None)
    except ApiKeyError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _ask_gateway(args: argparse.Namespace, method: str, path: str, what: str,
                 timeout: float) -> dict | None:
    """The gateway's JSON answer at `path` (with --api-key); None after saying why not."""
    import httpx

    key = client_api_key(args)
    headers = {"authorization": f"Bearer {key}"} if key else {}
    try:
        r = httpx.request(method, args.url.rstrip("/") + path, timeout=timeout, headers=headers)
        if r.status_code == 401:
            print(f"error: {args.url} refused the API key sent: pass one the gateway was "
                  "started with (--api-key-file FILE, --api-key KEY or OMLX_CLUSTER_API_KEY)"
                  if key else f"error: {args.url} wants an API key: pass --api-key-file FILE "
                  "or set OMLX_CLUSTER_API_KEY", file=sys.stderr)
            return None
        if r.status_code >= 400 and _error_message(r):
            print(f"error: {_error_message(r)}", file=sys.stderr)
            return None
        r.raise_for_status()
    except httpx.HTTPError as e:
        print(f"error: cannot get {what} from {args.url}: {e}", file=sys.stderr)
        return None
    try:
        body = r.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        print(f"error: {args.url} answered {path} with something other than an omlx-cluster "
              f"gateway's JSON (is it the gateway's address, not a node's metrics?)",
              file=sys.stderr)
        return None
    return body


def _error_message(r) -> str:
    """The message of the gateway's error object ("" when the body is not one)."""
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return ""


def status_command(args: argparse.Namespace) -> int:
    import json

    from rich.console import Console
    from rich.table import Column, Table

    body = _ask_gateway(args, "GET", "/cluster/status", "the status", timeout=10)
    if body is None:
        return 2
    if args.json:
        print(json.dumps(body, indent=2))
        return 0
    console = Console()
    console.print(f"{body['model']}: {body['status']} (plan epoch {body['epoch']})")
    if body.get("parallel"):
        console.print(f"parallel: {body['parallel']}", markup=False)
    for line in ranks_lines(body.get("ranks") or []):
        console.print(line, markup=False)
    if body.get("backend"):
        console.print(f"data plane: {body['backend']['name']} ({body['backend']['reason']})",
                      markup=False)
    # Addresses fold rather than end in "…" on a narrow terminal: they are what one copies.
    table = Table("id", Column("address", overflow="fold"), "health", "layers", "speed",
                  "agent pid", "worker pid", Column("metrics", overflow="fold"), "checks")
    for n in body["nodes"]:
        health = "ok" if n["healthy"] else ("lost" if not n["alive"] else "unhealthy")
        layers = layers_on(n["id"], body.get("models") or []) or (
            f"[{n['layers'][0]}, {n['layers'][1]})" if n["layers"] else "-")
        table.add_row(n["id"], n["address"], health, layers,
                      _speed(n.get("measured_speed_gbps"), n.get("ms_per_layer")),
                      str(n["agent_pid"] or "-"), str(n["worker_pid"] or "-"),
                      n.get("metrics") or "-", _checks_summary(n.get("checks") or []))
    console.print(table)
    for line in links_lines(body["nodes"]):
        console.print(line, markup=False)
    if len(body.get("models") or []) > 1 or any(len(m["replicas"]) > 1
                                                 for m in body.get("models") or []):
        console.print(_models_table(body["models"]))
    for m in body.get("models") or []:
        for spec in m.get("speculative") or []:
            console.print(f"{m['id']} on {spec['node']}: speculative decoding, "
                          f"{spec['acceptance_rate']:.0%} of drafted tokens stood, "
                          f"{spec['tokens_per_step']:.2f} tokens a drafting step", markup=False)
    # What each node's own checks found wrong with its machine, and the fix.
    for n in body["nodes"]:
        for c in n.get("checks") or []:
            if c["status"] in ("warn", "fail"):
                console.print(f"{n['id']}: {c['name']} {c['status']}: {c['detail']}"
                              + (f" (fix: {c['fix']})" if c["fix"] else ""), markup=False)
    return 0


def ranks_lines(ranks: list[dict]) -> list[str]:
    """A tensor-parallel stage's ranks and their heads: "rank 0 a: q heads [0, 16), KV heads
    [0, 4)" (KV heads listed where a rank's are not a contiguous run, one held twice)."""
    out = []
    for r in ranks:
        kv = r["kv_heads"]
        held = (f"[{kv[0]}, {kv[-1] + 1})" if kv and kv == list(range(kv[0], kv[-1] + 1))
                else ", ".join(map(str, kv)))
        out.append(f"  rank {r['rank']} {r['node']}: q heads [{r['q_heads'][0]}, "
                   f"{r['q_heads'][1]}), KV heads {held}")
    return out


def links_lines(nodes: list[dict]) -> list[str]:
    """Each link measured at a join, once a pair ("link a <-> b: 2.31 GB/s, 45 us"), and each
    node's control-plane round trip."""
    out, seen = [], set()
    for n in nodes:
        for peer, link in (n.get("links") or {}).items():
            if frozenset((n["id"], peer)) in seen:
                continue
            seen.add(frozenset((n["id"], peer)))
            out.append(f"link {n['id']} <-> {peer}: " + (
                link["error"] if "error" in link
                else f"{link['gb_per_s']:.3g} GB/s, {link['latency_us']:.0f} us"))
    rtts = [f"{n['id']} {n['coordinator_rtt_ms']:.2f} ms" for n in nodes
            if n.get("coordinator_rtt_ms")]
    if rtts:
        out.append("coordinator round trip: " + ", ".join(rtts))
    return out


def layers_on(node: str, models: list[dict]) -> str:
    """The layers every model's stages hold on `node`: "[0, 4)", or with several models
    "a [0, 4), b#1 [2, 6)" (b's second replica); "" when none."""
    held = [(m["id"] + (f"#{r['replica']}" if r["replica"] else ""), s["layers"])
            for m in models for r in m["replicas"] for s in r["stages"] if s["node"] == node]
    if len(models) == 1 and len(held) == 1:  # what one model on one replica always showed
        return "[{}, {})".format(*held[0][1])
    return ", ".join(f"{name} [{a}, {b})" for name, (a, b) in held)


def _models_table(models: list[dict]):
    """Every model: its state, leases, and where each replica's stages run with their real
    memory."""
    from rich.table import Table

    table = Table("model", "state", "requests", "replica", "stages (node [layers] footprint)")
    for m in models:
        name = m["id"] + (f" ({', '.join(m['aliases'])})" if m["aliases"] else "")
        for i, r in enumerate(m["replicas"]):
            stages = ", ".join(
                f"{s['node']} [{s['layers'][0]}, {s['layers'][1]})"
                + (f" {s['footprint_bytes'] / 2**20:.0f} MiB" if s.get("footprint_bytes")
                   else "") for s in r["stages"]) or "-"
            table.add_row(name if i == 0 else "", m["state"] if i == 0 else "",
                          str(m["leases"]) if i == 0 else "", str(r["replica"]), stages)
    return table


def _speed(gbps: float | None, ms_per_layer: float | None) -> str:
    """A node's measured speed for the status and rebalance tables ("-": not measured)."""
    if gbps is None:
        return "-"
    return f"{gbps:.3g} GB/s" + (f", {ms_per_layer:.3g} ms/layer" if ms_per_layer else "")


def _checks_summary(checks: list[dict]) -> str:
    """"ok", "1 fail, 2 warn", or "-" before the node's checks have run."""
    counts = {s: sum(c["status"] == s for c in checks) for s in ("fail", "warn")}
    return ("-" if not checks else ", ".join(f"{k} {s}" for s, k in counts.items() if k)
            or "ok")


def rebalance_command(args: argparse.Namespace) -> int:
    import json

    from rich.console import Console
    from rich.table import Table

    body = _ask_gateway(args, "GET" if args.dry_run else "POST", "/cluster/rebalance",
                        "the rebalance proposal", timeout=600)  # a move loads a plan
    if body is None:
        return 2
    if args.json:
        print(json.dumps(body, indent=2))
        return 0
    console = Console()
    d = body["decision"]
    console.print(f"rebalance {body['mode']} (reading {body['source']})", markup=False)

    def split(ranges: list | None) -> str:
        return " ".join(f"{n}[{a}, {b})" for n, a, b in ranges) if ranges else "-"

    table = Table("node", "layers now", "proposed", "speed", "")
    now = {n: (a, b) for n, a, b in d["current"] or []}
    proposed = {n: (a, b) for n, a, b in d["proposed"] or []}
    for node, gbps in d["speeds_gbps"].items():
        table.add_row(node, "[{}, {})".format(*now[node]) if node in now else "-",
                      "[{}, {})".format(*proposed[node]) if node in proposed else "-",
                      _speed(gbps, d["ms_per_layer"].get(node)),
                      "measured" if node in d["measured"] else "carried over")
    console.print(table)
    console.print(f"current split: {split(d['current'])}", markup=False)
    console.print(f"proposed split: {split(d['proposed'])}", markup=False)
    if d["gain"] is not None:
        console.print(f"bottleneck: {d['current_bottleneck_seconds'] * 1e3:.3f} ms now, "
                      f"{d['best_bottleneck_seconds'] * 1e3:.3f} ms proposed: predicted gain "
                      f"{d['gain']:+.1%}")
    console.print(f"{'would move' if d['move'] else 'holds'}: {d['why']}", markup=False)
    if body["moved"] is not None:
        console.print("moved to the proposed split" if body["moved"]
                      else "not moved: the proposal is the current split, or the plan changed",
                      markup=False)
    return 0


def model_action(args: argparse.Namespace, console) -> int:
    """`models load|unload|pin|unpin NAME` against a running gateway."""
    from urllib.parse import quote

    action = args.models_command
    query = f"?wait={args.wait}" if action == "unload" and args.wait else ""
    done = threading.Event()
    if action == "load":  # seconds to minutes: its stages shown meanwhile
        from omlx_cluster.load_progress import watch_load

        key = client_api_key(args)
        watcher = threading.Thread(target=watch_load, daemon=True, args=(
            args.url, {"authorization": f"Bearer {key}"} if key else {}, args.name, done,
            console))
        watcher.start()
    try:
        # A load waits for the model to serve; an unload for its requests and its workers.
        body = _ask_gateway(args, "POST", f"/cluster/models/{quote(args.name, safe='')}/"
                            f"{action}{query}", f"the model {action}",
                            timeout=1800 + args.__dict__.get("wait", 0))
    finally:
        done.set()
        if action == "load":
            watcher.join()
    if body is None:
        return 2
    # A loaded model's state reads "pinned" when it is: said once, after "loaded".
    state = "loaded" if body["loaded"] else body["state"]
    console.print(f"{body['id']}: {state}" + (" (pinned)" if body["pinned"] else ""),
                  markup=False)
    return 0
