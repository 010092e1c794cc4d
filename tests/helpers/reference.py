"""mlx-lm's own greedy answers, run in a child process in a node's BLAS environment, for tests
that serve a model to compare with; and the text an answer adds after its prompt."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from omlx_shared.blas import blas_env

# Runs in a subprocess with the node's environment (same BLAS), so the numerics are the node's.
_REFERENCE_SCRIPT = textwrap.dedent("""
    import json, sys
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    model, _ = load(sys.argv[1])
    prompts, n = json.loads(sys.stdin.read()), int(sys.argv[2])
    out = [[t for t, _ in generate_step(mx.array(ids), model, max_tokens=n)] for ids in prompts]
    print("REFERENCE " + json.dumps(out))
""")


def mlx_lm_greedy(model_path: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """mlx-lm's own greedy generation (generate_step, argmax sampler) of n tokens per prompt."""
    r = subprocess.run([sys.executable, "-c", _REFERENCE_SCRIPT, str(model_path), str(n)],
                       input=json.dumps(prompts), capture_output=True, text=True, timeout=180,
                       env=blas_env())
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("REFERENCE "))
    return json.loads(line[len("REFERENCE "):])


def _decode_after(tok, prompt: list[int], gen: list[int]) -> str:
    """The text `gen` adds after `prompt`: decoded in context, as the prompt continues."""
    full = tok.decode(prompt + gen, skip_special_tokens=True)
    head = tok.decode(prompt, skip_special_tokens=True)
    assert full.startswith(head), (head, full)
    return full[len(head):]
