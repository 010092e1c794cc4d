"""Speculative decoding across an uneven two-stage pipeline (worker processes over a ring on
loopback): the head drafts, the tail verifies, every stage trims. Greedy output equal, token
for token, to mlx-lm's and to the same pipeline without speculation, with eight concurrent
streams mixing drafting and plain rows, a stop token and `max_tokens` inside accepted runs;
and the same through the gateway, with a stop string; and a tensor-parallel stage, whose
rank 0 drafts and whose other rank mirrors the cache trims."""

from __future__ import annotations

import json
import time

import httpx
import mlx.core as mx
import openai
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from omlx_coordinator.telemetry.rebalancer import parse_stage
from proto import omlx_pb2 as pb
from tests.conftest import start_server
from tests.helpers.engine import assert_logprobs_match
from tests.helpers.pipeline import pipeline, run_concurrently, tensor_stage
from tests.helpers.session import generate_chunks
from tests.helpers.speculation import TEXT, mixed_requests

pytestmark = pytest.mark.slow

N = 40  # tokens of each reference
SPLIT = [1, 3]  # uneven: the head holds one layer of four
# The mode, and a crossover that lets a step of all eight rows draft (a CPU's measured one
# drafts one row at a time): the mix this test is about.
SPECULATE = ("--speculative", "ngram", "--speculative-rows", "8")


def stop_inside(ref: list[int]) -> int:
    """A position well into the output whose token comes there first: on a row whose
    prediction is its output, a stop token there ends the row inside a run of drafts."""
    return next(k for k in range(8, len(ref)) if ref[k] not in ref[:k])


def requests(model_path) -> tuple[list[pb.GenerateRequest], list[list[int]], list]:
    """The mixed set (tests.helpers.speculation) as GenerateRequests, each asking fewer
    tokens than the last, row 1 (a prediction's) with a stop token; with what each must give
    (tokens), and mlx-lm's (token, logprobs) for every row."""
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


def metrics_at(port: int) -> dict[str, float]:
    """A worker's /metrics, series by name and labels."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {k: float(v) for k, _, v in (line.rpartition(" ") for line in text.splitlines()
                                        if line and not line.startswith("#"))}


def drafted(metrics: dict[str, float], what: str) -> float:
    return sum(v for k, v in metrics.items()
               if k.startswith(f"omlx_node_speculative_{what}_tokens_total"))


def test_mixed_streams_match_mlx_lm_and_the_plain_pipeline(model):
    reqs, expected, refs = requests(model)
    results = {}
    for mode in (SPECULATE, ("--speculative", "off")):
        with pipeline(model, SPLIT, 2, extra=mode) as (stub, workers):
            results[mode] = run_all(stub, reqs)
            # A sampled row drafts from its prediction too: the tail's rejection rule keeps it
            # on the model's distribution (tests/test_speculation.py checks the rule itself).
            sampled = pb.GenerateRequest(request_id="t", prompt_tokens=reqs[1].prompt_tokens,
                                         max_tokens=N, ignore_eos=True,
                                         sampling=pb.SamplingParams(temperature=0.7),
                                         prediction_tokens=reqs[1].prediction_tokens)
            port = json.loads(workers[0].ready_file.read_text())["metrics_port"]
            before = drafted(metrics_at(port), "draft")
            [(tokens, _, reason, _)] = run_all(stub, [sampled])
            assert (len(tokens), reason) == (N, "length")
            metrics = metrics_at(port)
            assert (drafted(metrics, "draft") > before) is (mode == SPECULATE)
            # What the rebalancer reads: the head's drafting apart from its layers' time, and
            # its timed steps' wait for the tail's tokens (read on the host when it drafts).
            _, head = parse_stage(httpx.get(f"http://127.0.0.1:{port}/metrics").text)
            assert (head.draft_seconds > 0) is (mode == SPECULATE)
            assert head.wait_steps > 0 and head.wait_seconds > 0
        if mode == SPECULATE:
            assert drafted(metrics, "accepted") > 0, metrics
            assert drafted(metrics, "draft") >= drafted(metrics, "accepted")
            assert metrics[next(k for k in metrics if k.startswith(
                "omlx_node_speculative_tokens_per_step"))] > 1
        else:
            assert drafted(metrics, "draft") == 0
    spec, plain = results[SPECULATE], results[("--speculative", "off")]
    for i, (req, want) in enumerate(zip(reqs, expected)):
        tokens, logprobs, reason, accepted = spec[i]
        assert tokens == want, i
        assert reason == ("stop" if req.stop_token_ids else "length"), i
        assert (plain[i][0], plain[i][2]) == (tokens, reason), i
        if req.logprobs:
            got = [(t, *lp) for t, lp in zip(tokens, logprobs)]
            assert_logprobs_match(got, refs[i][:len(tokens)], req.top_logprobs)
            assert_logprobs_match([(t, *lp) for t, lp in zip(tokens, plain[i][1])],
                                  refs[i][:len(tokens)], req.top_logprobs)
        if req.prediction_tokens:
            assert accepted > 0, i  # read from the prediction, verified on the tail
        else:
            assert accepted == 0


def test_tensor_stage_drafts_on_rank_0(model):
    """The mixed streams on two tensor-parallel ranks: rank 0 drafts and verifies, rank 1 trims
    as told, and the output is mlx-lm's (this model's top two logits are nowhere near a tie)."""
    reqs, expected, refs = requests(model)
    with tensor_stage(model, extra=SPECULATE) as (stub, infos):
        results = run_all(stub, reqs)
        metrics = metrics_at(infos[0]["metrics_port"])
    assert drafted(metrics, "accepted") > 0, metrics
    for i, (req, want) in enumerate(zip(reqs, expected)):
        tokens, logprobs, reason, accepted = results[i]
        assert tokens == want, i
        assert reason == ("stop" if req.stop_token_ids else "length"), i
        if req.logprobs:
            assert_logprobs_match([(t, *lp) for t, lp in zip(tokens, logprobs)],
                                  refs[i][:len(tokens)], req.top_logprobs)


def test_gateway_over_a_speculating_pipeline(model, tmp_path):
    """`serve --nodes 2` with ngram drafts: greedy text as mlx-lm's, a stop string inside a
    run of accepted drafts ends the text there, and status shows the drafts that stood."""
    ref_model, tok = load(str(model))
    ids = tok.encode(TEXT)
    ref = [int(t) for t, _ in generate_step(mx.array(ids), ref_model, max_tokens=N)]
    mx.synchronize()
    text = tok.decode(ref)
    with start_server(model, "--nodes", "2", "--split", ",".join(map(str, SPLIT)), *SPECULATE,
                      home=tmp_path / "h", keepalive=None) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0,
                               timeout=120)
        kw = {"model": server.model_id, "prompt": ids, "max_tokens": N, "temperature": 0,
              "extra_body": {"ignore_eos": True}}
        assert client.completions.create(**kw).choices[0].text == text
        stop = text[len(text) // 2:len(text) // 2 + 4]
        stopped = client.completions.create(**kw, stop=[stop]).choices[0]
        assert (stopped.text, stopped.finish_reason) == (text[:text.index(stop)], "stop")
        deadline = time.monotonic() + 60  # as the head's agent last probed it
        while time.monotonic() < deadline:
            status = httpx.get(server.url + "/cluster/status", timeout=10).json()
            [spec] = status["models"][0]["speculative"] or [None]
            if spec is not None:
                break
            time.sleep(0.5)
        assert spec is not None and spec["tokens_per_step"] > 1, status["models"][0]
        assert 0 < spec["acceptance_rate"] <= 1
