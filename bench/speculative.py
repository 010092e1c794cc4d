"""Speculative decoding's batch-1 decode speed on the edit workload, in one engine.

The workload: a ~300-line Python file in the prompt and "rename this variable everywhere, print
the whole file"; the answer repeats most of the prompt. Each mode decodes the same greedy
answer (checked token for token against "off"):
- off: one token a step;
- ngram: prompt lookup drafts (omlx_node.speculation);
- prediction: the file as OpenAI's predicted output (the text an editor sends);
- ceiling: the answer itself as the prediction (the "off" run's tokens): every draft stands,
  so this is the mechanism's best, k+1 tokens a step at the cost of one step of k+1 positions.
Decode tok/s is (tokens - 1) / (last token - first token) of one request alone in the engine
(no prefill in it), the median of --runs runs a mode, modes interleaved run by run. The engines
share one prefix cache: the prompt is prefilled once, then restored.

On a Linux CPU run it as a node's worker runs: with OpenBLAS preloaded (omlx_shared/blas.py);
MLX's own reference BLAS is compute bound, where k+1 positions cost k+1 times one and no draft
pays ("auto" then stays off; `verify_cost` is printed).

    python -m bench.speculative --model default --tokens 256 --runs 3
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from omlx_node.batcher import Batcher, Finish, SeqRequest  # noqa: E402
from omlx_node.kv_cache import PrefixCache  # noqa: E402
from omlx_node.metrics import NodeMetrics  # noqa: E402
from omlx_node.speculation import verify_cost  # noqa: E402
from omlx_node.stage import StageRunner  # noqa: E402

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
    args = ap.parse_args()
    if args.model == "default":
        from omlx_shared.default_model import pull_default
        path = pull_default(progress=False)
    else:
        path = Path(args.model)
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(path)
    text = source_file()
    prompt = prompt_tokens(tok, text)
    prediction = tuple(tok.encode(f"```python\n{text}```", add_special_tokens=False))
    stage = StageRunner(path)
    cost = verify_cost(stage)
    print(f"a step of 5 positions costs {cost:.2f} of one (one layer's MLP)", flush=True)
    cache = PrefixCache("bench", (0, stage.info.num_layers), block_size=64,
                        hot_max_bytes=4 << 30)
    engines = {mode: Batcher(stage, NodeMetrics(), prefix_cache=cache,
                             speculative="off" if mode == "off" else "ngram")
               for mode in ("off", "ngram", "prediction", "ceiling")}
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
    machine = f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}"
    report = "\n".join([
        f"# Speculative decoding, batch 1, edit workload ({path.name})", "",
        f"Machine: {machine} ({args.machine}). Commit {commit()}. "
        f"Prompt {len(prompt)} tokens (a {len(text.splitlines())}-line file), "
        f"{args.tokens} tokens decoded, median of {args.runs} runs a mode, interleaved. "
        f"BLAS: {os.environ.get('LD_PRELOAD') or 'MLX reference'}; a step of 5 positions "
        f"costs {cost:.2f} of one (verify_cost; auto drafts up to 2.0).", "",
        "| mode | decode tok/s | vs off | acceptance | same tokens as off |",
        "|---|---|---|---|---|", *rows, "",
        "Command: `python -m bench.speculative --model default "
        f"--tokens {args.tokens} --runs {args.runs}`", ""])
    print(report)
    print("the answer begins:", repr(tok.decode(outputs["off"])[:300]))
    if args.out:
        args.out.write_text(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
