#!/usr/bin/env python3
"""Tiered KV prefix cache benchmark: TTFT cold vs RAM hit vs SSD hit vs SSD hit after a restart,
and the SSD restore bandwidth against the disk's raw sequential read bandwidth, in one run.

What one run does (every server is `python -m omlx_cluster serve`, measured through HTTP
streaming: request sent -> first streamed token, token-id prompts, greedy, ignore_eos):

0. raw disk read: a freshly written, fsync'd 1 GiB file in the cache directory's filesystem, read
   sequentially (a) buffered, 16 MiB reads, after `sync; echo 3 > /proc/sys/vm/drop_caches`
   (the same kind of read the cache does: `Path.read_bytes`), and (b) with O_DIRECT (page-aligned
   16 MiB buffer, no page cache). A page-cache-warm read is reported for reference.
1. server A: the default tiers (1 GiB RAM, 16 GiB SSD in a temporary $OMLX_CLUSTER_HOME). Per
   prompt length: cold = unique prompts (nothing cached; their new blocks are stored in RAM and
   queued for the SSD, as any cold request on a default server; the bench waits until the writer
   has written or dropped every stored block before going on), then RAM hit = the last cold
   prompt again, several times.
2. server B: a tiny RAM tier (`--hot-cache-max-size 1MiB`, smaller than one block, so every hit
   is read from the block files) on A's cache dir. Per length, A's last cold prompt: SSD hits
   with the page cache dropped before each request (disk reads), then with the page cache warm.
   A hit restores what A's writer put on disk; a block the writer dropped (its queue holds 256
   MiB) is prefilled again and stored, so a later hit is complete: medians use complete hits.
3. server C: server B's flags and cache dir in a new process (a restart): SSD hits, page cache
   dropped before each request.

The restore bandwidth is KV bytes restored / restore time, per request, from the node's
Prometheus /metrics (`--node-metrics-port 0`; the port from /health `nodes[0].metrics_port`):
delta of `omlx_node_kv_cache_restore_seconds` sum over the request, and delta of
`omlx_node_kv_cache_hits{tier=...}` blocks times the mean block file size in the cache dir.

Prompt lengths default to 2049 and 7937 tokens: 8 and 31 full 256-token blocks plus the last
prompt token, which is always run (the cache covers prompt[:-1]); an unaligned prompt re-prefills
up to block_size - 1 tokens on every hit. The model is the default store model (resolved with the
user's own OMLX_CLUSTER_HOME before the temporary one is set).

    python -m bench.kv_cache                  # ~15 minutes on a 2-core CPU
    python -m bench.kv_cache --lengths 513 1025 --cold-repeats 1 1   # a quick dry run

Results: bench/results/kv-cache-<tag>.json and .md (tag: cpu, h200, gpu, or --tag).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import mmap
import os
import pstats
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import (
    REPO,
    RESULTS,
    SERVER_START_TIMEOUT,
    Server,
    blas_of,
    completion_events,
    free_port,
    machine_info,
    median,
)

MiB, GiB = 1 << 20, 1 << 30
OMLX_PUBLISHED = {"prompt_tokens": "~6k", "cold_s": 2.688, "hit_s": 0.021,
                  "ratio": 0.021 / 2.688}
GOALS = {"ram_hit_over_cold": 0.05, "ssd_hit_over_cold": 0.15, "restore_over_raw_read": 0.50}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- page cache and raw disk ---------------------------------------------------------------------


def drop_caches() -> bool:
    """sync, then drop the page cache, dentries and inodes; False if not permitted here."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def raw_disk_read(folder: Path, size: int, can_drop: bool) -> dict:
    """Sequential read bandwidth of a fresh `size`-byte file in `folder` (bytes/s)."""
    path = folder / "raw-read-test.bin"
    chunk = 16 * MiB
    block = os.urandom(chunk)  # incompressible, in case the virtual disk compresses
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(size // chunk):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t0
    out: dict = {"file_bytes": size, "read_size": chunk, "write_fsync_Bps": size / write_s}

    def buffered() -> float:
        t = time.perf_counter()
        n = 0
        with open(path, "rb", buffering=0) as f:
            while data := f.read(chunk):
                n += len(data)
        assert n == size
        return n / (time.perf_counter() - t)

    if can_drop:
        runs = []
        for _ in range(2):
            drop_caches()
            runs.append(buffered())
        out["buffered_after_drop_caches_Bps"] = median(runs)
        out["buffered_after_drop_caches_runs"] = runs
    try:
        buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT wants
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            t, n = time.perf_counter(), 0
            while (got := os.preadv(fd, [buf], n)) > 0:
                n += got
            out["o_direct_Bps"] = n / (time.perf_counter() - t)
        finally:
            os.close(fd)
            buf.close()
    except (OSError, AttributeError) as e:
        out["o_direct_error"] = str(e)
    buffered()  # pulls it into the page cache
    out["page_cache_warm_Bps"] = buffered()
    path.unlink()
    raw = out.get("buffered_after_drop_caches_Bps") or out.get("o_direct_Bps")
    out["raw_Bps"] = raw
    out["raw_method"] = ("buffered 16 MiB reads after drop_caches" if can_drop else
                         "O_DIRECT 16 MiB reads")
    return out


# ---- HTTP --------------------------------------------------------------------------------------


async def stream_ttft(client, base: str, prompt: list[int], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first_text = first_chunk = None
    usage = None
    text = ""
    async for now, obj in completion_events(client, base, prompt, max_tokens):
        if obj.get("usage"):
            usage = obj["usage"]
        if obj.get("choices"):
            first_chunk = first_chunk or now
            piece = obj["choices"][0].get("text") or ""
            if piece and first_text is None:
                first_text = now
            text += piece
    end = time.perf_counter()
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return {"ttft": (first_text or first_chunk or end) - t0,
            "first_chunk": (first_chunk - t0) if first_chunk else None,
            "total": end - t0, "prompt_tokens": (usage or {}).get("prompt_tokens"),
            "completion_tokens": (usage or {}).get("completion_tokens"),
            "cached_tokens": cached, "text": text}


def parse_metrics(text: str) -> dict[str, float]:
    """{'name{label="v",...}': value} (labels sorted), without the labels naming the node's
    stage (IDENTITY_LABELS): each server here has one node of one stage."""
    from omlx_node.metrics import IDENTITY_LABELS
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items())
                              if k not in IDENTITY_LABELS)
            out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return out


class Bench:
    """One server: TTFT requests with the node's KV-cache counters around each."""

    def __init__(self, name: str, model: Path, work: Path, flags: list[str], timeout: float):
        import httpx

        self.name, self.flags = name, flags
        log(f"server {name}: starting with {' '.join(flags)}")
        # An explicit port: with `--node-metrics-port 0` the worker binds a free port but /health
        # reports the agent's configured 0 as null (seen at 9b7417b), so it cannot be found.
        chosen = free_port()
        self.server = Server(model, work / f"server-{name}.log",
                             [*flags, "--node-metrics-port", str(chosen)])
        try:
            self.ready_s = self.server.wait_ready(SERVER_START_TIMEOUT)
            health = httpx.get(self.server.base + "/health", timeout=10).json()
            self.health_metrics_port = health["nodes"][0].get("metrics_port")
            port = self.health_metrics_port or chosen
            httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).raise_for_status()
        except BaseException:
            print(f"server {name} log tail:\n{self.server.tail()}", file=sys.stderr)
            self.server.stop()
            raise
        self.metrics_url = f"http://127.0.0.1:{port}/metrics"
        self.loop = asyncio.new_event_loop()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout))
        log(f"server {name}: ready in {self.ready_s:.1f}s, node metrics on :{port}")

    def metrics(self) -> dict[str, float]:
        import httpx

        return parse_metrics(httpx.get(self.metrics_url, timeout=10).text)

    def request(self, prompt: list[int], max_tokens: int, label: str) -> dict:
        before = self.metrics()
        r = self.loop.run_until_complete(stream_ttft(self.client, self.server.base, prompt,
                                                     max_tokens))
        after = self.metrics()

        def d(key: str) -> float:
            return after.get(key, 0.0) - before.get(key, 0.0)

        r["restore_s"] = d("omlx_node_kv_cache_restore_seconds_sum")
        r["restores"] = d("omlx_node_kv_cache_restore_seconds_count")
        r["ram_hit_blocks"] = d('omlx_node_kv_cache_hits_total{tier="ram"}')
        r["ssd_hit_blocks"] = d('omlx_node_kv_cache_hits_total{tier="ssd"}')
        r["stored_blocks"] = d("omlx_node_kv_cache_stored_blocks_total")
        r["queue_full_blocks"] = d('omlx_node_kv_cache_ssd_writes_total{result="queue_full"}')
        r["label"] = label
        r["loadavg_1m"] = os.getloadavg()[0]
        log(f"  {self.name} {label}: TTFT {r['ttft'] * 1000:.0f} ms, cached "
            f"{r['cached_tokens']}/{r['prompt_tokens']}, restore {r['restore_s'] * 1000:.0f} ms "
            f"(ram {r['ram_hit_blocks']:.0f} / ssd {r['ssd_hit_blocks']:.0f} blocks)"
            + (f", {r['queue_full_blocks']:.0f} blocks dropped (write queue full)"
               if r["queue_full_blocks"] else ""))
        return r

    def wait_writer(self, timeout: float = 60.0) -> dict:
        """Until every stored block was written to SSD or dropped (each counted once in
        omlx_node_kv_cache_ssd_writes by result)."""
        t0 = time.monotonic()
        while True:
            m = self.metrics()
            stored = m.get("omlx_node_kv_cache_stored_blocks_total", 0.0)
            writes = {k.split('"')[1]: v for k, v in m.items()
                      if k.startswith("omlx_node_kv_cache_ssd_writes_total{")}
            if sum(writes.values()) >= stored or time.monotonic() - t0 > timeout:
                return {"stored": stored, "writes": writes,
                        "waited_s": time.monotonic() - t0,
                        "ssd_blocks": m.get('omlx_node_kv_cache_blocks{tier="ssd"}')}
            time.sleep(0.25)

    def stop(self) -> None:
        try:
            self.loop.run_until_complete(self.client.aclose())
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()
        finally:
            self.server.stop()
        log(f"server {self.name}: stopped")


# ---- restore profile (in-process, after the servers) ---------------------------------------------


def profile_restore(cache_dir: Path, block_size: int, prompt: list[int], can_drop: bool) -> dict:
    """cProfile of PrefixCache.restore of `prompt`'s blocks from the SSD tier left by servers
    B/C (page cache dropped first), plus the time of each piece of one block's load."""
    import hashlib

    import mlx.core as mx
    from omlx_node.kv_cache import PrefixCache

    files = sorted(cache_dir.rglob("*.safetensors"))
    if not files:
        return {"error": "no block files"}
    with open(files[0], "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        meta = json.loads(f.read(n))["__metadata__"]
    mx.set_default_device(mx.cpu)
    cache = PrefixCache(meta["model_id"], (int(meta["layer_start"]), int(meta["layer_end"])),
                        int(meta["block_size"]), hot_max_bytes=1, ssd_dir=cache_dir,
                        ssd_max_bytes=1 << 62, dtype=meta["dtype"])
    try:
        tokens = prompt[:-1]
        n_tok = cache.lookup(tokens)
        if can_drop:
            drop_caches()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        kv = cache.restore(tokens, n_tok)
        prof.disable()
        total = time.perf_counter() - t0
        held = kv[0].offset
        nbytes = sum(c.keys.nbytes + c.values.nbytes for c in kv)
        st = pstats.Stats(prof)
        rows = []
        for (fname, line, func), (_cc, nc, tt, ct, _) in st.stats.items():
            rows.append({"function": f"{Path(fname).name}:{line}({func})", "calls": nc,
                         "tottime_s": round(tt, 4), "cumtime_s": round(ct, 4)})
        rows.sort(key=lambda r: -r["tottime_s"])
        # one block's pieces, page cache warm (it was just read)
        path = files[-1]
        t = time.perf_counter()
        data = path.read_bytes()
        t_read_warm = time.perf_counter() - t
        t = time.perf_counter()
        hashlib.sha256(data).hexdigest()
        t_sha = time.perf_counter() - t
        return {"restored_tokens": held, "looked_up_tokens": n_tok, "kv_bytes": nbytes,
                "restore_s": total, "restore_Bps": nbytes / total if total else None,
                "page_cache_dropped": can_drop, "top_tottime": rows[:12],
                "one_block": {"bytes": len(data), "read_warm_s": t_read_warm,
                              "sha256_s": t_sha, "sha256_Bps": len(data) / t_sha}}
    finally:
        cache.close()


# ---- orchestration -------------------------------------------------------------------------------


def mean_block_bytes(cache_dir: Path) -> tuple[float | None, int]:
    sizes = [p.stat().st_size for p in cache_dir.rglob("*.safetensors")]
    return (sum(sizes) / len(sizes) if sizes else None), len(sizes)


def summarize_runs(runs: list[dict], block_bytes: float | None, full: int | None = None) -> dict:
    """Medians; with `full`, only over the runs whose cached prefix was complete."""
    use = [r for r in runs if full is None or r["cached_tokens"] == full] or runs
    bw = []
    for r in use:
        blocks = r["ram_hit_blocks"] + r["ssd_hit_blocks"]
        if block_bytes and blocks and r["restore_s"] > 0:
            bw.append(blocks * block_bytes / r["restore_s"])
    return {"median_ttft_s": median([r["ttft"] for r in use]),
            "median_restore_s": median([r["restore_s"] for r in use]),
            "median_restore_Bps": median(bw) if bw else None,
            "n": len(use), "n_all": len(runs),
            "cached_tokens": sorted({r["cached_tokens"] for r in runs}),
            "runs": runs}


def ratio(a, b):
    return a / b if a is not None and b else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model folder or store name (default: the default model)")
    ap.add_argument("--lengths", type=int, nargs=2, default=[2049, 7937],
                    metavar=("SHORT", "LONG"), help="prompt lengths in tokens (default 2049 7937)")
    ap.add_argument("--max-tokens", type=int, default=2, help="completion tokens per request")
    ap.add_argument("--cold-repeats", type=int, nargs=2, default=[3, 1], metavar=("SHORT", "LONG"),
                    help="unique cold prompts per length (default 3 1: a cold 7937-token prefill "
                         "takes minutes on a 2-core CPU)")
    ap.add_argument("--hit-repeats", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--raw-read-bytes", type=int, default=GiB)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--tag")
    ap.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    ap.add_argument("--keep-work", action="store_true", help="keep the temporary home")
    ap.add_argument("--source-commit", help="the commit the code under test was exported from "
                                            "(when run from a `git archive` export, not a checkout)")
    args = ap.parse_args()

    from omlx_shared.blas import blas_env
    from omlx_shared.model_spec import resolve_model

    t_start = time.monotonic()
    # The model from the user's normal store, resolved before the home changes.
    model = resolve_model(args.model, progress=True)
    config = json.loads((model / "config.json").read_text())
    vocab = int(config["vocab_size"])
    ctx = config.get("max_position_embeddings")
    if ctx and max(args.lengths) + args.max_tokens > ctx:
        ap.error(f"{max(args.lengths)} + {args.max_tokens} tokens exceed the context of {ctx}")

    work = Path(tempfile.mkdtemp(prefix="omlx-kvbench-", dir="/var/tmp"))
    home = work / "home"
    home.mkdir()
    os.environ["OMLX_CLUSTER_HOME"] = str(home)  # the servers' default cache dir lives here
    cache_root = home / "kv-cache"
    machine = machine_info()
    if args.source_commit:
        machine["git_commit"] = args.source_commit
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True)
    machine["source_tree"] = (f"export of commit {args.source_commit} at {REPO}"
                              if args.source_commit else
                              "checkout with uncommitted changes" if dirty.stdout.strip() else
                              "clean checkout" if dirty.returncode == 0 else str(REPO))
    tag = args.tag or ("h200" if "H200" in machine["gpu"] else "gpu" if machine["gpu"] else "cpu")
    can_drop = drop_caches()
    log(f"model {model}; temporary OMLX_CLUSTER_HOME {home}; drop_caches "
        f"{'permitted' if can_drop else 'NOT permitted (O_DIRECT for the raw read only)'}")

    rng = random.Random(4321)
    lo, hi = min(100, vocab // 2), vocab - 1

    def prompt(n: int) -> list[int]:
        return [rng.randrange(lo, hi) for _ in range(n)]

    bs = args.block_size
    full = {n: (n - 1) // bs * bs for n in args.lengths}  # what a complete hit restores
    common = ["--cache-block-size", str(bs)]
    result: dict = {"tag": tag, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                    "machine": machine, "model": {"name": model.name, "path": str(model),
                                                  "layers": config.get("num_hidden_layers"),
                                                  "context": ctx},
                    "blas": blas_of(blas_env()),
                    "settings": {**{k: getattr(args, k) for k in (
                        "lengths", "max_tokens", "cold_repeats", "hit_repeats", "block_size",
                        "raw_read_bytes")}, "drop_caches_permitted": can_drop,
                        "cache_dir_fs": subprocess.run(["df", "-T", str(work)], capture_output=True,
                                                       text=True).stdout.splitlines()[-1:]},
                    "phases": {}, "loadavg_start": os.getloadavg()}
    P = result["phases"]
    args.out.mkdir(parents=True, exist_ok=True)
    partial = args.out / f"kv-cache-{tag}.partial.json"

    def save_partial() -> None:
        partial.write_text(json.dumps(result, indent=1))

    try:
        # 0. raw disk
        log("raw disk read bandwidth ...")
        P["raw_disk"] = raw_disk_read(home, args.raw_read_bytes, can_drop)
        rd = P["raw_disk"]
        log(f"  raw read {rd['raw_Bps'] / MiB:.0f} MiB/s ({rd['raw_method']}); O_DIRECT "
            f"{(rd.get('o_direct_Bps') or 0) / MiB:.0f} MiB/s; page cache warm "
            f"{rd['page_cache_warm_Bps'] / MiB:.0f} MiB/s; write+fsync "
            f"{rd['write_fsync_Bps'] / MiB:.0f} MiB/s")
        warm_prompt = prompt(16)

        # 1. default tiers: cold (populates RAM and SSD) and RAM hits
        a = Bench("A-default", model, work, common, args.timeout)
        ssd_prompts = {}
        try:
            a.request(warm_prompt, args.max_tokens, "warm-up")
            P["A"] = {"flags": a.flags, "ready_s": a.ready_s,
                      "health_metrics_port": a.health_metrics_port}
            for n, reps in zip(args.lengths, args.cold_repeats):
                prompts = [prompt(n) for _ in range(reps)]
                cold, writers = [], []
                for p in prompts:
                    cold.append(a.request(p, args.max_tokens, f"cold {n}"))
                    writers.append(a.wait_writer())
                    log(f"  writer done {writers[-1]['waited_s']:.1f}s later: "
                        f"{writers[-1]['writes']}")
                hits = [a.request(prompts[-1], args.max_tokens, f"RAM hit {n}")
                        for _ in range(args.hit_repeats)]
                ssd_prompts[n] = prompts[-1]
                P["A"][str(n)] = {"cold": cold, "writer": writers, "ram_hit": hits}
                save_partial()
        finally:
            a.stop()

        # 2. SSD tier with a tiny RAM tier, on A's cache dir
        ssd_flags = [*common, "--hot-cache-max-size", "1MiB"]
        b = Bench("B-ssd", model, work, ssd_flags, args.timeout)
        try:
            P["B"] = {"flags": b.flags, "ready_s": b.ready_s,
                      "ssd_blocks_indexed": b.metrics().get(
                          'omlx_node_kv_cache_blocks{tier="ssd"}')}
            b.request(warm_prompt, args.max_tokens, "warm-up")
            for n in args.lengths:
                p = ssd_prompts[n]
                dropped, warm = [], []
                for _ in range(args.hit_repeats):
                    if can_drop:
                        drop_caches()
                    dropped.append(b.request(p, args.max_tokens,
                                             f"SSD hit {n}" + (" (caches dropped)"
                                                               if can_drop else "")))
                    b.wait_writer()  # a partial hit stores the rest: let it land on disk
                for _ in range(max(2, args.hit_repeats - 1)):
                    warm.append(b.request(p, args.max_tokens, f"SSD hit {n} (page cache warm)"))
                P["B"][str(n)] = {"ssd_hit_dropped": dropped, "ssd_hit_warm": warm}
                save_partial()
        finally:
            b.stop()
        P["block_bytes"], P["block_files"] = mean_block_bytes(cache_root)

        # 3. restart: a new process on the same cache dir
        if can_drop:
            drop_caches()
        c = Bench("C-restart", model, work, ssd_flags, args.timeout)
        try:
            P["C"] = {"flags": c.flags, "ready_s": c.ready_s,
                      "ssd_blocks_indexed": c.metrics().get(
                          'omlx_node_kv_cache_blocks{tier="ssd"}')}
            c.request(warm_prompt, args.max_tokens, "warm-up")
            for n in args.lengths:
                hits = []
                for _ in range(args.hit_repeats):
                    if can_drop:
                        drop_caches()
                    hits.append(c.request(ssd_prompts[n], args.max_tokens,
                                          f"SSD hit after restart {n}"))
                P["C"][str(n)] = {"ssd_hit_restart": hits}
                save_partial()
        finally:
            c.stop()

        # 4. where an SSD restore spends its time (in-process)
        log("profiling one SSD restore in-process ...")
        P["restore_profile"] = profile_restore(cache_root, bs, ssd_prompts[args.lengths[1]],
                                               can_drop)
        prof = P["restore_profile"]
        if "restore_Bps" in prof:
            log(f"  {prof['kv_bytes'] / MiB:.0f} MiB in {prof['restore_s']:.3f}s = "
                f"{prof['restore_Bps'] / MiB:.0f} MiB/s")
    finally:
        result["loadavg_end"] = os.getloadavg()
        save_partial()

    # ---- summary
    bb = P["block_bytes"]
    raw = P["raw_disk"]["raw_Bps"]
    rows = []
    for n in args.lengths:
        k = str(n)
        cold = summarize_runs(P["A"][k]["cold"], bb)
        ram = summarize_runs(P["A"][k]["ram_hit"], bb, full[n])
        ssd = summarize_runs(P["B"][k]["ssd_hit_dropped"], bb, full[n])
        ssd_warm = summarize_runs(P["B"][k]["ssd_hit_warm"], bb, full[n])
        rst = summarize_runs(P["C"][k]["ssd_hit_restart"], bb, full[n])
        first = P["B"][k]["ssd_hit_dropped"][0]
        rows.append({
            "prompt_tokens": n, "full_hit_tokens": full[n],
            "cold_s": cold["median_ttft_s"],
            "ram_hit_s": ram["median_ttft_s"], "ssd_hit_s": ssd["median_ttft_s"],
            "ssd_hit_warm_s": ssd_warm["median_ttft_s"], "ssd_hit_restart_s": rst["median_ttft_s"],
            "ram_over_cold": ratio(ram["median_ttft_s"], cold["median_ttft_s"]),
            "ssd_over_cold": ratio(ssd["median_ttft_s"], cold["median_ttft_s"]),
            "ssd_warm_over_cold": ratio(ssd_warm["median_ttft_s"], cold["median_ttft_s"]),
            "ssd_restart_over_cold": ratio(rst["median_ttft_s"], cold["median_ttft_s"]),
            "ram_restore_s": ram["median_restore_s"], "ram_restore_Bps": ram["median_restore_Bps"],
            "ram_hit_minus_restore_s": median([r["ttft"] - r["restore_s"] for r in ram["runs"]
                                               if r["cached_tokens"] == full[n]]),
            "ssd_restore_s": ssd["median_restore_s"], "ssd_restore_Bps": ssd["median_restore_Bps"],
            "ssd_warm_restore_Bps": ssd_warm["median_restore_Bps"],
            "ssd_restart_restore_s": rst["median_restore_s"],
            "ssd_restart_restore_Bps": rst["median_restore_Bps"],
            "ssd_restore_over_raw": ratio(ssd["median_restore_Bps"], raw),
            "ssd_restart_restore_over_raw": ratio(rst["median_restore_Bps"], raw),
            "kv_bytes_full_hit": full[n] // bs * bb if bb else None,
            "first_ssd_hit_cached_tokens": first["cached_tokens"],
            "first_ssd_hit_s": first["ttft"],
            "cold_queue_full_blocks": P["A"][k]["cold"][-1]["queue_full_blocks"],
            "n": {"cold": cold["n"], "ram": ram["n"], "ssd": ssd["n"], "ssd_n_all": ssd["n_all"],
                  "restart": rst["n"]},
        })
    result["rows"] = rows
    long = rows[-1]
    result["goals"] = {
        "ram_hit_over_cold_at_long": {"value": long["ram_over_cold"],
                                      "goal": GOALS["ram_hit_over_cold"]},
        "ssd_hit_over_cold_at_long": {"value": long["ssd_over_cold"],
                                      "goal": GOALS["ssd_hit_over_cold"]},
        "ssd_restart_over_cold_at_long": {"value": long["ssd_restart_over_cold"],
                                          "goal": GOALS["ssd_hit_over_cold"]},
        "restore_over_raw_read": {"value": long["ssd_restore_over_raw"],
                                  "goal": GOALS["restore_over_raw_read"]},
        "restore_after_restart_over_raw_read": {"value": long["ssd_restart_restore_over_raw"],
                                                "goal": GOALS["restore_over_raw_read"]},
    }
    for g in result["goals"].values():
        g["met"] = None if g["value"] is None else (g["value"] >= g["goal"]
                                                   if g["goal"] == GOALS["restore_over_raw_read"]
                                                   else g["value"] <= g["goal"])
    result["omlx_published"] = OMLX_PUBLISHED
    result["bench_seconds"] = round(time.monotonic() - t_start, 1)
    (args.out / f"kv-cache-{tag}.json").write_text(json.dumps(result, indent=1))
    (args.out / f"kv-cache-{tag}.md").write_text(markdown(result))
    partial.unlink(missing_ok=True)
    print(markdown(result))
    log(f"wrote {args.out}/kv-cache-{tag}.json and .md ({result['bench_seconds']:.0f}s)")
    if not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    else:
        log(f"kept {work}")
    return 0


def ms(x) -> str:
    return "n/a" if x is None else f"{x * 1000:.0f} ms" if x < 10 else f"{x:.1f} s"


def pct(x) -> str:
    return "n/a" if x is None else f"{x * 100:.1f}%"


def mibs(x) -> str:
    return "n/a" if x is None else f"{x / MiB:.0f} MiB/s"


def markdown(result: dict) -> str:
    m, s, P = result["machine"], result["settings"], result["phases"]
    rd = P["raw_disk"]
    lines = [
        f"# Tiered KV cache benchmark ({result['tag']})",
        "",
        f"- machine: {m['gpu'] or m['cpu']} ({m['cpu_count']} CPU cores: {m['cpu']}), "
        f"{m['platform']}; commit {m['git_commit']} ({m['source_tree']}); load average at start/end "
        f"{result['loadavg_start'][0]:.1f}/{result['loadavg_end'][0]:.1f} (shared machine)",
        f"- model: {result['model']['name']} ({result['model']['layers']} layers, context "
        f"{result['model']['context']}); BLAS: {result['blas']}",
        f"- prompts: random token ids, {s['lengths'][0]} and {s['lengths'][1]} tokens "
        f"(block-aligned: the cache covers prompt[:-1]), max_tokens {s['max_tokens']}, greedy, "
        f"block {s['block_size']} tokens, KV block file {P['block_bytes'] / MiB:.2f} MiB "
        f"(float32 on the CPU)",
        f"- TTFT = request sent -> first streamed token over HTTP; medians: cold "
        f"{s['cold_repeats'][0]}/{s['cold_repeats'][1]} unique prompts, hits {s['hit_repeats']} "
        f"each (SSD-hit medians use only complete hits, see notes)",
        f"- cold and RAM hit: server A (default tiers: 1 GiB RAM, 16 GiB SSD in a temporary "
        f"$OMLX_CLUSTER_HOME; the SSD writer was let finish after each cold request); SSD hit: "
        f"server B on A's cache dir (`--hot-cache-max-size 1MiB`, smaller than one block, so every "
        f"block is read from its file), page cache dropped (`echo 3 > /proc/sys/vm/drop_caches`) before each "
        f"request: {'yes' if s['drop_caches_permitted'] else 'NOT permitted'}; after restart: "
        f"server C = B's flags and cache dir, new process, page cache dropped before each request",
        f"- raw disk sequential read: {mibs(rd['raw_Bps'])} ({rd['raw_method']}, fresh "
        f"{rd['file_bytes'] // MiB} MiB file on the cache's filesystem); O_DIRECT "
        f"{mibs(rd.get('o_direct_Bps'))}; page cache warm {mibs(rd['page_cache_warm_Bps'])}",
        "",
        "| prompt | cold | RAM hit | SSD hit (disk) | SSD hit (page cache warm) | SSD hit after "
        "restart | RAM/cold | SSD/cold | restart/cold |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['prompt_tokens']} tok | {ms(r['cold_s'])} | {ms(r['ram_hit_s'])} | "
            f"{ms(r['ssd_hit_s'])} | {ms(r['ssd_hit_warm_s'])} | {ms(r['ssd_hit_restart_s'])} | "
            f"{pct(r['ram_over_cold'])} | {pct(r['ssd_over_cold'])} | "
            f"{pct(r['ssd_restart_over_cold'])} |")
    lines += ["", "Restore (node's `omlx_node_kv_cache_restore_seconds`, KV bytes = restored "
              "blocks x block file size):", "",
              "| prompt | KV bytes | RAM restore | SSD restore (disk) | SSD restore after restart "
              "| SSD restore, page cache warm | SSD (disk) / raw read |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["rows"]:
        kvb = r["kv_bytes_full_hit"]
        lines.append(
            f"| {r['prompt_tokens']} tok | {kvb / MiB:.0f} MiB | {ms(r['ram_restore_s'])}, "
            f"{mibs(r['ram_restore_Bps'])} | {ms(r['ssd_restore_s'])}, "
            f"{mibs(r['ssd_restore_Bps'])} | {ms(r['ssd_restart_restore_s'])}, "
            f"{mibs(r['ssd_restart_restore_Bps'])} | {mibs(r['ssd_warm_restore_Bps'])} | "
            f"{pct(r['ssd_restore_over_raw'])} |")
    lines += ["", "Goals (at the long prompt):", ""]
    for name, g in result["goals"].items():
        op = ">=" if g["goal"] == GOALS["restore_over_raw_read"] else "<="
        mark = "n/a" if g["met"] is None else ("met" if g["met"] else "NOT met")
        lines.append(f"- {name}: {pct(g['value'])} (goal {op} {pct(g['goal'])}): {mark}")
    o = result["omlx_published"]
    long = result["rows"][-1]
    lines += ["", f"oMLX's published figure: {o['cold_s']} s -> {o['hit_s']} s on a "
              f"{o['prompt_tokens']}-token prompt (hit/cold {pct(o['ratio'])}). Ours at "
              f"{long['prompt_tokens']} tokens: RAM hit {pct(long['ram_over_cold'])}, SSD hit "
              f"{pct(long['ssd_over_cold'])} of cold ({ms(long['cold_s'])} cold on this CPU).", ""]
    notes = []
    for r in result["rows"]:
        if r["cold_queue_full_blocks"]:
            notes.append(
                f"{r['prompt_tokens']} tok: the cold request stored {r['full_hit_tokens'] // s['block_size']} "
                f"blocks but {r['cold_queue_full_blocks']:.0f} were dropped by the SSD write "
                f"queue (256 MiB cap, filled in one store() call), so the first SSD hit restored "
                f"only {r['first_ssd_hit_cached_tokens']} tokens and prefilled the rest (TTFT "
                f"{ms(r['first_ssd_hit_s'])}); that "
                f"hit stored the missing blocks and the later hits were complete. SSD-hit medians "
                f"use the complete hits only ({r['n']['ssd']} of {r['n']['ssd_n_all']}).")
    for r in result["rows"]:
        if r["ram_hit_minus_restore_s"] is not None:
            notes.append(f"{r['prompt_tokens']} tok: RAM-hit TTFT minus the restore itself: "
                         f"{ms(r['ram_hit_minus_restore_s'])} (the first decode step over the "
                         f"whole context, the copy that grows the restored cache, HTTP/gRPC).")
    if not P["A"].get("health_metrics_port"):
        notes.append("the node's metrics port was read from the explicit `--node-metrics-port` "
                     "given: /health reported `metrics_port: null`.")
    prof = P.get("restore_profile", {})
    if prof.get("top_tottime"):
        top = ", ".join(f"{t['function']} {t['tottime_s'] * 1000:.0f} ms"
                        for t in prof["top_tottime"][:5])
        notes.append(
            f"in-process SSD restore of the long prompt (page cache dropped): "
            f"{prof['kv_bytes'] / MiB:.0f} MiB in {ms(prof['restore_s'])} = "
            f"{mibs(prof['restore_Bps'])}; most self time: {top}; sha256 of one block runs at "
            f"{mibs(prof['one_block']['sha256_Bps'])}.")
    if notes:
        lines += ["Notes:", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
