"""Layers on the SSD: decode speed with half of a model's layers streamed, against all resident
and against the bound the disk's measured read speed allows (issue 45).

One process, one random llama in float32 (built here; speed does not depend on the values), the
stage runner a worker uses, greedy decode at batch 1, 8 and 32 (every row the same length):
- resident: every layer in memory;
- streamed: the last half of the layers on disk (omlx_node/layer_stream.py).
`--family qwen3_moe` runs a MoE model instead (`--experts`, 2 a token), whose streamed layers
read only the experts their rows route to (omlx_node/routed_experts.py), and a third run:
- whole: the same weights with each expert stored as its own tensor, which streams whole.
The disk's sequential read speed is measured first on the model's own file, its pages dropped
from the page cache before each pass (posix_fadvise; Linux). The bound a streamed step cannot
beat: reading the streamed bytes at that speed, or the resident run's step, whichever is longer
(read-ahead overlaps the two). The planner's prediction (planner.make_plan with this node's
measured weight-streaming and disk speeds) is printed beside the measurement.

    python -m bench.disk_layers --out bench/results/disk-layers-cpu.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from bench.common import machine_info
from omlx_coordinator.planning.model_layout import read_layout
from omlx_coordinator.planning.planner import NodeSpec, make_plan
from omlx_node.calibrate import measure_speed
from omlx_node.stage import StageRunner
from tests.tiny_models import build_model


def disk_gbps(path: Path, passes: int = 3) -> float:
    """Median cold sequential read speed of `path` in GB/s (pages dropped before each pass)."""
    size, speeds, buf = path.stat().st_size, [], bytearray(8 << 20)
    for _ in range(passes):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            with os.fdopen(os.dup(fd), "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
            speeds.append(size / (time.perf_counter() - t0) / 1e9)
        finally:
            os.close(fd)
    return statistics.median(speeds)


def decode_tok_s(stage: StageRunner, rows: int, steps: int) -> tuple[float, float]:
    """Tokens per second decoding `rows` rows, and the bytes a step read from disk."""
    cache = stage.make_cache()
    x = mx.array([[(r * 16 + i) % 256 + 3 for i in range(16)] for r in range(rows)])
    mx.eval(stage(x, cache, last_only=True))
    x = mx.argmax(stage(x[:, -1:], cache, last_only=True)[:, -1:], axis=-1).astype(mx.int32)
    read, t0 = stage.streamed_bytes_read, time.perf_counter()
    for _ in range(steps):
        x = mx.argmax(stage(x, cache, last_only=True)[:, -1:], axis=-1).astype(mx.int32)
        mx.eval(x)
    seconds = time.perf_counter() - t0
    return rows * steps / seconds, (stage.streamed_bytes_read - read) / steps


def experts_apart(path: Path, dest: Path) -> Path:
    """A copy of the model at `path` with each routed expert stored as its own tensor (Hugging
    Face's layout, which the family's sanitize stacks at load)."""
    import shutil

    shutil.copytree(path, dest)
    weights = mx.load(str(path / "model.safetensors"))
    for name in [k for k in weights if ".switch_mlp." in k]:
        stacked = weights.pop(name)
        for e in range(stacked.shape[0]):
            weights[name.replace(".switch_mlp.", f".experts.{e}.")] = stacked[e]
    mx.save_safetensors(str(dest / "model.safetensors"), weights)
    return dest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=12, help="decode steps a run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--family", choices=["llama", "qwen3_moe"], default="llama")
    ap.add_argument("--experts", type=int, default=32, help="routed experts a MoE layer has")
    ap.add_argument("--machine-note", default="",
                    help="how to describe the machine beyond its CPU/GPU (e.g. 'shared')")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        moe = args.family == "qwen3_moe"
        extra = ({"num_experts": args.experts, "moe_intermediate_size": args.hidden // 4,
                  "mlp_only_layers": []} if moe else
                 {"intermediate_size": args.hidden * 11 // 4})
        path = build_model(Path(tmp) / args.family, args.family, num_layers=args.layers,
                           hidden_size=args.hidden, extra_config=extra)
        layout = read_layout(path)
        half = args.layers // 2
        streamed_bytes = sum(layout.layer_bytes[-half:])
        planned_read = sum(layout.read_bytes(i) for i in range(args.layers - half, args.layers))
        disk = disk_gbps(path / "model.safetensors")
        speed = measure_speed() / 1e9
        resident = StageRunner(path)
        streaming = StageRunner(path, streamed=half)
        runs = {"resident": resident, "streamed": streaming}
        if moe:
            runs["whole"] = StageRunner(experts_apart(path, Path(tmp) / "apart"), streamed=half)
        # The planner, told this node's speeds and a cap that leaves half the layers on disk.
        cap = layout.total_weight_bytes - streamed_bytes + 2 * max(layout.layer_bytes)
        plan = make_plan(layout, [NodeSpec("this", 1 << 50, speed=speed, weights_cap=cap,
                                           disk_gbps=disk)],
                         os_reserve_bytes=0, context_tokens=512, max_sequences=max(args.rows))
        predicted_ms = plan.stages[0].est_ms
        rows_out = []
        for rows in args.rows:
            got: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
            for _ in range(args.runs):  # interleaved, so drift hits all alike
                for name, stage in runs.items():
                    got[name].append(decode_tok_s(stage, rows, args.steps))
            tok_s = {k: statistics.median(t for t, _ in v) for k, v in got.items()}
            read = statistics.median(b for _, b in got["streamed"])
            r, s = tok_s["resident"], tok_s["streamed"]
            step_bound = max(read / (disk * 1e9), rows / r)
            bound = rows / step_bound
            rows_out.append((rows, r, s, read, bound, tok_s.get("whole"),
                             1e3 / predicted_ms if rows == 1 else None))
            print(f"batch {rows}: resident {r:.1f} tok/s, half streamed {s:.1f} tok/s "
                  f"({s / r:.2f}x, {read / 2**20:.0f} MiB read a step), bound {bound:.1f} "
                  f"({s / bound:.2f} of it)"
                  + (f", experts read whole {tok_s['whole']:.1f} tok/s" if moe else ""),
                  flush=True)

    machine = machine_info()
    device = machine["gpu"] or f"{machine['cpu']}, {machine['cpu_count']} cores"
    lines = [
        "# Layers on the SSD: half a model's layers streamed (issue 45)",
        "",
        f"- machine: {device}{'; ' + args.machine_note if args.machine_note else ''}; commit "
        f"{machine['git_commit']}; `python -m bench.disk_layers"
        f"{' --family qwen3_moe' if moe else ''}`",
        f"- model: random {args.family}, {args.layers} layers, hidden {args.hidden}"
        + (f", {args.experts} experts of width {args.hidden // 4}, 2 a token" if moe else "")
        + f", float32, {layout.total_weight_bytes / 2**20:.0f} MiB; the last {half} layers "
        f"streamed ({streamed_bytes / 2**20:.0f} MiB; the planner counts "
        f"{planned_read / 2**20:.0f} MiB read a step at batch 1)",
        f"- disk: {disk:.2f} GB/s cold sequential read of the model's file; weights streamed "
        f"from memory at {speed:.1f} GB/s (calibrate.measure_speed)",
        f"- medians of {args.runs} interleaved runs of {args.steps} decode steps each",
        "",
        "| batch | all resident tok/s | half streamed tok/s | streamed / resident | "
        "MiB read a step | disk bound tok/s | streamed / bound | planner's prediction tok/s |"
        + (" experts read whole tok/s |" if moe else ""),
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if moe else ""),
    ]
    for rows, r, s, read, bound, whole, pred in rows_out:
        lines.append(f"| {rows} | {r:.1f} | {s:.1f} | {s / r:.2f}x | {read / 2**20:.0f} | "
                     f"{bound:.1f} | {s / bound:.2f} | {'-' if pred is None else f'{pred:.1f}'} |"
                     + (f" {whole:.1f} |" if moe else ""))
    lines += ["", "The bound: a step can not be shorter than reading the bytes it read (counted "
              "by the stream) at the measured disk speed, nor than the resident run's step. The planner predicts one "
              "step's time at batch 1 (weights at the measured speed plus the disk read); its "
              "cost model is bandwidth-bound decode, so it predicts no batched rate."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
