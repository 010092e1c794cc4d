"""What the speculative-decoding tests share: a prompt that loops, a flat cost curve, one
request run through a batcher to its end, and the mixed streams a speculating worker (a
pipeline's head, a tensor stage's rank 0) must answer as mlx-lm does."""

from __future__ import annotations

import httpx
from mlx_lm import load

from omlx_node.batcher import Batcher
from omlx_node.sampling import SamplingParams
from omlx_node.sequence import SeqRequest
from proto import omlx_pb2 as pb
from tests.helpers.engine import assert_logprobs_match, drain, reference_logprobs
from tests.helpers.pipeline import run_concurrently
from tests.helpers.session import generate_chunks

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


N = 40  # tokens of each worker-level reference
# The mode, and a crossover that lets a step of all eight rows draft (a CPU's measured one
# drafts one row at a time): the mix the worker-level tests are about.
SPECULATE = ("--speculative", "ngram", "--speculative-rows", "8")


def stop_inside(ref: list[int]) -> int:
    """A position well into the output whose token comes there first: on a row whose
    prediction is its output, a stop token there ends the row inside a run of drafts."""
    return next(k for k in range(8, len(ref)) if ref[k] not in ref[:k])


def requests(model_path) -> tuple[list[pb.GenerateRequest], list[list[int]], list]:
    """The mixed set (`mixed_requests`) as GenerateRequests, each asking fewer tokens than the
    last, row 1 (a prediction's) with a stop token; with what each must give (tokens), and
    mlx-lm's (token, logprobs) for every row."""
    model, tok = load(str(model_path))
    _, refs, reqs = mixed_requests(model, tok, N)
    out, expected = [], []
    for i, (r, ref) in enumerate(zip(reqs, refs)):
        tokens = [t for t, _ in ref][:N - 2 * i]
        stop = []
        if i == 1:
            k = stop_inside(tokens)
            stop, tokens = [tokens[k]], tokens[:k]
        p = r.sampling
        out.append(pb.GenerateRequest(
            request_id=r.request_id, prompt_tokens=r.prompt, max_tokens=N - 2 * i,
            ignore_eos=True, stop_token_ids=stop, prediction_tokens=list(r.prediction),
            logprobs=p.logprobs is not None, top_logprobs=p.logprobs or 0,
            sampling=pb.SamplingParams(repetition_penalty=p.repetition_penalty)))
        expected.append(tokens)
    return out, expected, refs


def run_all(stub, reqs: list[pb.GenerateRequest]) -> list[tuple[list[int], list, str, int]]:
    """Every request at once: (tokens, logprobs, finish reason, accepted prediction tokens)."""
    def one(req):
        chunks = generate_chunks(stub, req)
        return ([t for c in chunks for t in c.tokens],
                [(lp.logprob, list(lp.top_ids), list(lp.top_logprobs))
                 for c in chunks for lp in c.logprobs],
                chunks[-1].finish_reason, chunks[-1].accepted_prediction_tokens)
    return run_concurrently(one, reqs)


def assert_answered(results: list, reqs: list[pb.GenerateRequest], expected: list[list[int]],
                    refs: list) -> None:
    """`run_all`'s results of `requests`: each row's tokens and finish as expected, its
    logprobs as mlx-lm's, and a row that sent a prediction had some of it stand."""
    for i, (req, want) in enumerate(zip(reqs, expected)):
        tokens, logprobs, reason, accepted = results[i]
        assert tokens == want, i
        assert reason == ("stop" if req.stop_token_ids else "length"), i
        if req.logprobs:
            assert_logprobs_match([(t, *lp) for t, lp in zip(tokens, logprobs)],
                                  refs[i][:len(tokens)], req.top_logprobs)
        assert (accepted > 0) is bool(req.prediction_tokens), i


def metrics_at(port: int) -> dict[str, float]:
    """A worker's /metrics, series by name and labels."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {k: float(v) for k, _, v in (line.rpartition(" ") for line in text.splitlines()
                                        if line and not line.startswith("#"))}


def drafted(metrics: dict[str, float], what: str) -> float:
    """`metrics_at`'s draft tokens of every source: "draft" (verified) or "accepted"."""
    return sum(v for k, v in metrics.items()
               if k.startswith(f"omlx_node_speculative_{what}_tokens_total"))
