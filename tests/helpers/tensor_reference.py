"""mlx-lm's own greedy tokens, top-two gaps and logprobs, and the checks that a tensor-parallel
stage (alone or as a pipeline's stage) answers as mlx-lm does, up to near-ties."""

from __future__ import annotations

from pathlib import Path

import httpx
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step

from proto import omlx_pb2 as pb
from tests.helpers.pipeline import PROMPTS, generate, run_concurrently
from tests.helpers.session import generate_chunks

TOKENS = 16
TIE = 1e-4  # a divergence is allowed only where mlx-lm's top two logits are this close


def reference(model: Path, prompts: list[str]) -> dict[str, list[tuple[int, float, float]]]:
    """mlx-lm's greedy tokens for each prompt, each with the gap between its top two logits and
    its logprob."""
    ref_model, tok = load(str(model))
    out = {}
    for p in prompts:
        steps = []
        for t, logprobs in generate_step(mx.array(tok.encode(p)), ref_model,
                                         max_tokens=TOKENS):
            top2 = mx.sort(logprobs)[-2:].tolist()
            steps.append((int(t), top2[1] - top2[0], logprobs[int(t)].item()))
        out[p] = steps
    return out


def assert_matches(tokens: list[int], ref: list[tuple[int, float, float]], prompt: str) -> None:
    """Equal to mlx-lm's tokens up to the end, or up to a near-tie of its top two logits."""
    for i, (t, gap, _) in enumerate(ref):
        if tokens[i] != t:
            assert gap < TIE, f"{prompt!r}: token {i} is {tokens[i]}, mlx-lm's {t} (gap {gap})"
            return
    assert len(tokens) == len(ref), prompt


def assert_serves_like_mlx_lm(stub, tok, refs: dict[str, list[tuple[int, float, float]]]
                              ) -> None:
    """Through the head's stub: PROMPTS[0] alone, then every prompt at once twice over
    (continuous batching, chunked prefill past the 8-token chunk), each as mlx-lm's `refs`;
    then PROMPTS[1]'s logprobs (sampled on rank 0) within 1e-4 of mlx-lm's."""
    alone, reason = generate(stub, tok.encode(PROMPTS[0]), TOKENS)
    assert reason == "length"
    assert_matches(alone, refs[PROMPTS[0]], PROMPTS[0])
    outs = run_concurrently(lambda p: generate(stub, tok.encode(p), TOKENS), PROMPTS * 2)
    for p, (tokens, _) in zip(PROMPTS * 2, outs):
        assert_matches(tokens, refs[p], p)
    chunks = generate_chunks(stub, pb.GenerateRequest(
        request_id="lp", prompt_tokens=tok.encode(PROMPTS[1]), max_tokens=TOKENS,
        logprobs=True, top_logprobs=2, ignore_eos=True))
    got = [(t, lp.logprob) for c in chunks for t, lp in zip(c.tokens, c.logprobs)]
    assert_matches([t for t, _ in got], refs[PROMPTS[1]], PROMPTS[1])
    for (t, logprob), (ref_t, _, ref_logprob) in zip(got, refs[PROMPTS[1]]):
        if t != ref_t:
            break
        assert abs(logprob - ref_logprob) < 1e-4, (t, logprob, ref_logprob)


def shard_bytes(metrics_port: int) -> float:
    """The weight bytes a worker holds, as its /metrics reports them."""
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("omlx_node_shard_bytes"))
