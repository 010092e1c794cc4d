"""Two tiny models served side by side: their reference answers, a node memory that holds
one of them, and the requests the serving tests send."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from omlx_coordinator.models import placement
from omlx_coordinator.planning.model_layout import read_layout
from omlx_coordinator.planning.planner import NodeSpec, make_plan
from tests.helpers.reference import _decode_after, mlx_lm_greedy
from tests.tiny_models import build_model

# Each model's worker keeps this much for its RAM prefix cache (--hot-cache-max-size), more
# than the tiny models weigh: were the cache not counted, one_fits would hold both models.
# One token a step: these tests time a stream against others (speculative decoding could
# finish a repetitive tiny-model stream before the next one is sent).
CACHE_FLAGS = ("--hot-cache-max-size", "32MiB", "--speculative", "off")
N = 12  # tokens per answer


def two_models(root: Path) -> dict[str, Path]:
    return {"alpha": build_model(root / "alpha", "llama", num_layers=4, seed=3),
            "beta": build_model(root / "beta", "qwen3", num_layers=3, seed=4)}


def planned_bytes(path: Path) -> int:
    """What the planner reserves for a model on one node (weights, KV, the worker's cache)."""
    plan = make_plan(read_layout(path), [NodeSpec("n", 1 << 40, cache_bytes=32 << 20)],
                     os_reserve_bytes=0)
    return sum(placement.plan_bytes(plan).values())


def one_fits(models: dict[str, Path]) -> str:
    """A --node-memory that holds either model but not both (with CACHE_FLAGS)."""
    sizes = [planned_bytes(p) for p in models.values()]
    assert max(sizes) * 1.2 < sum(sizes)
    return f"{max(sizes) * 1.1 / 2**20:.0f}MiB"


def complete(url: str, model: str, prompt: list[int], n: int = N, **extra) -> dict:
    r = httpx.post(url + "/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
        "ignore_eos": True, **extra}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def stream(url: str, model: str, prompt: list[int], n: int) -> tuple[str, list[float], int]:
    """A streamed completion: its text, when each keep-alive came, and the finish time."""
    text, keepalives = "", []
    with httpx.stream("POST", url + "/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "stream": True}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith(": keep-alive"):
                keepalives.append(time.monotonic())
            elif line.startswith("data: {"):
                chunk = json.loads(line[6:])
                text += chunk["choices"][0]["text"] if chunk["choices"] else ""
    return text, keepalives, time.monotonic()


def card(url: str, name: str) -> dict:
    r = httpx.get(f"{url}/v1/models/{name}", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def prompts_for(path: Path) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(str(path))
    return [tok.encode(t) for t in ("The capital of France is", "Once upon a time",
                                    "I am fine, thank")]


def expected(path: Path, prompts: list[list[int]], n: int = N) -> list[str]:
    tok = AutoTokenizer.from_pretrained(str(path))
    return [_decode_after(tok, p, g) for p, g in zip(prompts, mlx_lm_greedy(path, prompts, n))]


