"""What the speculative-decoding tests share: a prompt that loops, a flat cost curve, and one
request run through a batcher to its end."""

from __future__ import annotations

from omlx_node.batcher import Batcher
from omlx_node.sampling import SamplingParams
from omlx_node.sequence import SeqRequest
from tests.helpers.engine import drain, reference_logprobs

# Repetitive: a random model's greedy output soon loops, and prompt lookup drafts the loop.
TEXT = "one two three four five six seven eight nine ten. " * 4 + "one two three"


# A weight-bound device's cost curve (k+1 positions cost what one does): rows draft all k_max
# tokens while their drafts stand. On a real node the measured curve decides.
FLAT = {1: 1.0, 256: 1.0}


def run_one(batcher: Batcher, req: SeqRequest) -> tuple[list[int], str, object]:
    seq = batcher.submit(req)
    [(tokens, finish)] = drain(batcher, [seq])
    return tokens, finish.reason, seq


def mixed_requests(model, tok, n: int, longer: bool = False) -> tuple[list, list, list]:
    """Eight requests of every kind a speculating batch mixes: prompts that loop (drafts), a
    prediction on every third, logprobs on every other, and one with a penalty (it never
    drafts). Returns (prompts, mlx-lm's greedy (token, logprobs) of n tokens each, requests);
    `longer`: request i asks n + i tokens."""
    texts = [TEXT, "Hello", TEXT[:60], "The capital of France is", TEXT[10:], "x y x y x y",
             "def add(a, b):\n    return", TEXT[:90]]
    prompts = [tok.encode(t) for t in texts]
    refs = [reference_logprobs(model, p, n) for p in prompts]
    reqs = []
    for i, p in enumerate(prompts):
        kw = {}
        if i % 3 == 1:
            kw["prediction"] = tuple(t for t, _ in refs[i])
        if i % 2 == 0:
            kw["sampling"] = SamplingParams(logprobs=3)
        if i == 5:
            kw["sampling"] = SamplingParams(repetition_penalty=1.0001)  # no drafts: a plain row
        reqs.append(SeqRequest(str(i), p, n + i if longer else n, **kw))
    return prompts, refs, reqs
