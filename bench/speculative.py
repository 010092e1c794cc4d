"""Speculative decoding's batch-1 decode speed on the edit workload, in one engine.

The workload: a ~300-line Python file in the prompt and "rename this variable everywhere, print
the whole file"; the answer repeats most of the prompt. Each mode decodes the same greedy
answer (checked token for token against "off"):
- off: one token a step;
- ngram: prompt lookup drafts (omlx_node.speculation);
- prediction: the file as OpenAI's predicted output (the text an editor sends);
- ceiling: the answer itself as the prediction (the "off" run's tokens): every draft stands,
  so this is the mechanism's best, k+1 tokens a step at the cost of one step of k+1 positions;
- draft-self: the model as its own draft model (--speculative draft=PATH): every draft stands,
  each drafted token paid with a pass of the draft, the draft-model mechanism's ceiling;
- draft-small: the model's first --draft-layers layers (then its norm and head) as the draft,
  a smaller model of the same tokenizer built on the spot.
--streams 8,32 then runs that many concurrent streams of a shorter edit (one prompt, restored
from the prefix cache) under off, ngram and draft-small: aggregate decode tok/s from the moment
every stream has its first token; speculation should step aside there (the measured crossover,
`max_rows`), never below 0.95x of off.
--pipeline A,B then runs the edit (a --pipeline-lines file) at batch 1 through worker processes
over gRPC, as a node serves it: one node holding every layer, and a pipeline of stages of A, B
... layers (mx.distributed's ring on loopback), each with ngram drafts and without, all four
interleaved run by run; a pipeline's drafts save a trip through every stage and hop, so its
speedup should be at least the one node's.
Decode tok/s is (tokens - 1) / (last token - first token) of one request alone in the engine
(no prefill in it), the median of --runs runs a mode, modes interleaved run by run. The engines
share one prefix cache: the prompt is prefilled once, then restored.

On a Linux CPU run it as a node's worker runs: with OpenBLAS preloaded (omlx_shared/blas.py);
MLX's own reference BLAS is compute bound, where k+1 positions cost k+1 times one and no draft
pays ("auto" then stays off; `verify_cost` is printed).

    python -m bench.speculative --model default --tokens 256 --runs 3
    python -m bench.speculative --model default --modes none --streams 8,32 --tokens 24
    python -m bench.speculative --model default --modes none --pipeline 15,15 --tokens 64
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from omlx_node.batcher import Batcher, SeqRequest  # noqa: E402
from omlx_node.kv_cache import PrefixCache  # noqa: E402
from omlx_node.metrics import NodeMetrics  # noqa: E402
from omlx_node.sequence import Finish
from omlx_node.speculation import verify_cost  # noqa: E402
from omlx_node.stage import StageRunner  # noqa: E402
from tests.tiny_models import truncated_model  # noqa: E402

OLD, NEW = "total_count", "item_total"


def source_file(lines: int = 300) -> str:
    """A plausible module of `lines` lines that uses OLD throughout."""
    out = ['"""Inventory bookkeeping."""', "", "import math", ""]
    i = 0
    while len(out) < lines:
        out += [f"def update_{i}(items, {OLD}):",
                f"    # fold batch {i} into the running {OLD}",
                "    for item in items:",
                f"        {OLD} += item.quantity * {i + 1}",
                f"    if {OLD} > {1000 * (i + 1)}:",
                f"        {OLD} = math.floor({OLD} / 2)",
                f"    return {OLD}",
                ""]
        i += 1
    return "\n".join(out[:lines]) + "\n"


def prompt_tokens(tok, text: str) -> list[int]:
    ask = (f"Rename the variable `{OLD}` to `{NEW}` everywhere in this file and print the "
           f"whole file, nothing else.\n\n```python\n{text}```")
    return tok.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True)


def run(batcher: Batcher, prompt: list[int], n: int, prediction: tuple[int, ...]
        ) -> tuple[list[int], float, object]:
    seq = batcher.submit(SeqRequest("r", prompt, n, prediction=prediction))
    tokens, times = [], []
    for _ in range(100_000):
        if batcher.idle:
            break
        batcher.step()
        while not seq.events.empty():
            ev = seq.events.get_nowait()
            if not isinstance(ev, Finish):
                tokens.append(ev)
                times.append(time.perf_counter())
    rate = (len(tokens) - 1) / (times[-1] - times[0]) if len(tokens) > 1 else 0.0
    return tokens, rate, seq.spec


def run_streams(batcher: Batcher, prompt: list[int], n: int, streams: int) -> float:
    """Aggregate decode tok/s of `streams` concurrent requests of `prompt`: tokens streamed
    after every stream had its first one, over the time since."""
    seqs = [batcher.submit(SeqRequest(f"s{i}", prompt, n)) for i in range(streams)]
    got, t0, after = [0] * streams, 0.0, 0
    for _ in range(1_000_000):
        if batcher.idle:
            break
        batcher.step()
        for i, seq in enumerate(seqs):
            while not seq.events.empty():
                if not isinstance(seq.events.get_nowait(), Finish):
                    got[i] += 1
                    after += bool(t0)
        if not t0 and all(got):
            t0 = time.perf_counter()
    return after / (time.perf_counter() - t0) if t0 and after else 0.0


def speculative_mode(mode: str, drafts: dict[str, Path]) -> str:
    """What a bench mode serves with."""
    if mode in drafts:
        return f"draft={drafts[mode]}"
    return "off" if mode == "off" else "ngram"


def commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="model folder, or 'default'")
    ap.add_argument("--tokens", type=int, default=256, help="tokens decoded a run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, help="write the markdown table here")
    ap.add_argument("--machine", default="CPU; shared with other jobs",
                    help="what ran it, for the report (default: the shared CPU)")
    ap.add_argument("--modes", default="off,ngram,prediction,ceiling,draft-self,draft-small",
                    help="batch-1 modes, comma-separated ('none': skip batch 1)")
    ap.add_argument("--draft-layers", type=int, default=8,
                    help="layers of the draft-small model (the model's first ones)")
    ap.add_argument("--streams", default="", help="concurrent stream counts, e.g. 8,32")
    ap.add_argument("--pipeline", default="",
                    help="layers of each stage of a pipeline to run beside one node, e.g. 15,15")
    ap.add_argument("--pipeline-lines", type=int, default=100,
                    help="lines of the file the pipeline case edits")
    args = ap.parse_args()
    if args.model == "default":
        from omlx_shared.default_model import pull_default
        path = pull_default(progress=False)
    else:
        path = Path(args.model)
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(path)
    tmp = Path(tempfile.mkdtemp(prefix="spec-bench-"))
    drafts = {"draft-self": path,
              "draft-small": truncated_model(path, tmp / "draft", args.draft_layers)}
    stage = StageRunner(path)
    cost = verify_cost(stage)
    print(f"a step of 5 positions costs {cost:.2f} of one (one layer's MLP)", flush=True)
    cache = PrefixCache("bench", (0, stage.info.num_layers), block_size=64,
                        hot_max_bytes=4 << 30)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}"
    report = [f"# Speculative decoding, edit workload ({path.name})", "",
              f"Machine: {machine} ({args.machine}). Commit {commit()}. BLAS: "
              f"{os.environ.get('LD_PRELOAD') or 'MLX reference'}; a step of 5 positions "
              f"costs {cost:.2f} of one (verify_cost; auto drafts up to 2.0). draft-small: "
              f"the model's first {args.draft_layers} layers.", ""]
    modes = [m for m in args.modes.split(",") if m and m != "none"]
    if modes:
        report += batch_one(args, tok, stage, cache, modes, drafts)
    for streams in [int(x) for x in args.streams.split(",") if x]:
        report += many_streams(args, tok, stage, cache, streams, drafts)
    if args.pipeline:
        report += pipeline_case(args, tok, path, [int(x) for x in args.pipeline.split(",")])
    report += ["Command: `python " + " ".join(sys.argv) + "`", ""]
    text = "\n".join(report)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


def batch_one(args, tok, stage: StageRunner, cache: PrefixCache, modes: list[str],
              drafts: dict[str, Path]) -> list[str]:
    """Batch-1 decode of the 300-line edit under each mode; the report's table."""
    text = source_file()
    prompt = prompt_tokens(tok, text)
    prediction = tuple(tok.encode(f"```python\n{text}```", add_special_tokens=False))
    engines = {mode: Batcher(stage, NodeMetrics(), prefix_cache=cache,
                             speculative=speculative_mode(mode, drafts))
               for mode in dict.fromkeys(["off", *modes])}
    rates: dict[str, list[float]] = {m: [] for m in engines}
    stats, outputs = {}, {}
    for r in range(args.runs):
        for mode, batcher in engines.items():
            given = {"prediction": prediction,
                     "ceiling": tuple(outputs.get("off", ()))}.get(mode, ())
            tokens, rate, spec = run(batcher, prompt, args.tokens, given)
            rates[mode].append(rate)
            stats[mode] = spec
            outputs.setdefault(mode, tokens)
            print(f"run {r} {mode}: {rate:.1f} tok/s, {len(tokens)} tokens, drafted "
                  f"{spec.drafted}, accepted {spec.accepted}", flush=True)
    base = statistics.median(rates["off"])
    rows = []
    for mode in engines:
        s, med = stats[mode], statistics.median(rates[mode])
        same = outputs[mode] == outputs["off"]
        acc = f"{s.accepted / s.drafted:.2f}" if s.drafted else "-"
        rows.append(f"| {mode} | {med:.1f} | {med / base:.2f}x | {acc} | {same} |")
    print("the answer begins:", repr(tok.decode(outputs["off"])[:300]))
    return [f"Batch 1: prompt {len(prompt)} tokens (a {len(text.splitlines())}-line file), "
            f"{args.tokens} tokens decoded, median of {args.runs} runs a mode, interleaved.",
            "", "| mode | decode tok/s | vs off | acceptance | same tokens as off |",
            "|---|---|---|---|---|", *rows, ""]


def many_streams(args, tok, stage: StageRunner, cache: PrefixCache, streams: int,
                 drafts: dict[str, Path]) -> list[str]:
    """`streams` concurrent streams of a 40-line edit under off, ngram and draft-small."""
    prompt = prompt_tokens(tok, source_file(40))
    engines = {mode: Batcher(stage, NodeMetrics(), prefix_cache=cache,
                             max_batch=max(streams, 64), speculative=speculative_mode(mode, drafts))
               for mode in ("off", "ngram", "draft-small")}
    run_streams(engines["off"], prompt, 4, 1)  # the prompt into the prefix cache
    rates: dict[str, list[float]] = {m: [] for m in engines}
    for r in range(args.runs):  # modes interleaved: each median sees the same load
        for mode, batcher in engines.items():
            rates[mode].append(run_streams(batcher, prompt, args.tokens, streams))
            print(f"run {r}, {streams} streams {mode}: {rates[mode][-1]:.1f} tok/s", flush=True)
    rows, base = [], statistics.median(rates["off"])
    for mode, batcher in engines.items():
        rate, spec = statistics.median(rates[mode]), batcher.speculator
        rows.append(f"| {mode} | {rate:.1f} | {rate / base:.2f}x | "
                    f"{spec.max_rows if spec is not None and spec.on else '-'} |")
    return [f"{streams} concurrent streams: prompt {len(prompt)} tokens, {args.tokens} tokens "
            f"each, aggregate decode tok/s, median of {args.runs} runs.", "",
            "| mode | decode tok/s | vs off | speculates up to (rows) |", "|---|---|---|---|",
            *rows, ""]


def timed_generate(stub, prompt: list[int], n: int) -> tuple[list[int], float]:
    """One greedy request through a worker: its tokens and decode tok/s (first to last
    token, as each message of them arrives)."""
    from proto import omlx_pb2 as pb
    from tests.helpers.session import SessionClient

    tokens, first, last, firsts = [], 0.0, 0.0, 0
    with SessionClient(stub) as session:
        chunks = session.generate(pb.GenerateRequest(request_id=str(time.monotonic_ns()),
                                                     prompt_tokens=prompt, max_tokens=n,
                                                     ignore_eos=True), 600)
        for chunk in chunks:
            if chunk.tokens:
                now = time.perf_counter()
                first, last = first or now, now
                if not tokens:
                    firsts = len(chunk.tokens)  # those arrived at `first`: not timed
                tokens += chunk.tokens
    rate = (len(tokens) - firsts) / (last - first) if last > first else 0.0
    return tokens, rate


def head_counts(workers) -> tuple[float, float, float]:
    """Drafted and accepted tokens so far, and the tokens a drafting step gave, from a head
    worker's /metrics."""
    import json
    import urllib.request

    port = json.loads(workers[0].ready_file.read_text())["metrics_port"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    counts = {"draft": 0.0, "accepted": 0.0}
    per_step = 0.0
    for line in text.splitlines():
        for what in counts:
            if line.startswith(f"omlx_node_speculative_{what}_tokens_total"):
                counts[what] += float(line.rsplit(" ", 1)[1])
        if line.startswith("omlx_node_speculative_tokens_per_step"):
            per_step = float(line.rsplit(" ", 1)[1])
    return counts["draft"], counts["accepted"], per_step


def pipeline_case(args, tok, path: Path, split: list[int]) -> list[str]:
    """Batch-1 decode of the edit through worker processes: one node and a pipeline of
    `split`, each with and without ngram drafts, interleaved run by run."""
    from tests.helpers.pipeline import pipeline

    text = source_file(args.pipeline_lines)
    prompt = prompt_tokens(tok, text)
    layouts = {"one node": [sum(split)], f"{len(split)} stages {args.pipeline}": split}
    rates: dict[tuple[str, str], list[float]] = {}
    outputs, counts = {}, {}
    with ExitStack() as stack:
        started = {}
        for name, layout in layouts.items():
            for mode in ("off", "ngram"):
                started[name, mode] = stack.enter_context(pipeline(
                    path, layout, 1, init_timeout=120,
                    extra=("--speculative", mode, "--prefill-chunk", "512")))
        for stub, _ in started.values():
            timed_generate(stub, prompt, 2)  # its prompt into the worker's prefix cache
        for r in range(args.runs):
            for key, (stub, _) in started.items():
                tokens, rate = timed_generate(stub, prompt, args.tokens)
                rates.setdefault(key, []).append(rate)
                outputs.setdefault(key, tokens)
                print(f"run {r} {key[0]} {key[1]}: {rate:.1f} tok/s, {len(tokens)} tokens",
                      flush=True)
        for key, (_, workers) in started.items():
            counts[key] = head_counts(workers)
    reference = outputs["one node", "off"]
    rows = []
    for (name, mode), got in rates.items():
        med, base = statistics.median(got), statistics.median(rates[name, "off"])
        drafted, accepted, per_step = counts[name, mode]
        acc = f"{accepted / drafted:.2f} | {per_step:.2f}" if drafted else "- | -"
        rows.append(f"| {name} | {mode} | {med:.1f} | {med / base:.2f}x | {acc} | "
                    f"{outputs[name, mode] == reference} |")
    return [f"Batch 1 through worker processes: prompt {len(prompt)} tokens (a "
            f"{args.pipeline_lines}-line file), {args.tokens} tokens decoded, median of "
            f"{args.runs} runs, the four interleaved.", "",
            "| layout | mode | decode tok/s | vs off (same layout) | acceptance | "
            "tokens a drafting step | same tokens as one node off |",
            "|---|---|---|---|---|---|---|", *rows, ""]


if __name__ == "__main__":
    raise SystemExit(main())
