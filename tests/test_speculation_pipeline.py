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
from tests.helpers.pipeline import pipeline, tensor_stage
from tests.helpers.speculation import (
    N,
    SPECULATE,
    TEXT,
    assert_answered,
    drafted,
    metrics_at,
    requests,
    run_all,
)

pytestmark = pytest.mark.slow

SPLIT = [1, 3]  # uneven: the head holds one layer of four


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
    # A prediction's tokens stood: read on the head, verified on the tail.
    assert_answered(spec, reqs, expected, refs)
    for i, req in enumerate(reqs):
        assert (plain[i][0], plain[i][2]) == (spec[i][0], spec[i][2]), i
        if req.logprobs:
            assert_logprobs_match([(t, *lp) for t, lp in zip(plain[i][0], plain[i][1])],
                                  refs[i][:len(plain[i][0])], req.top_logprobs)


def test_tensor_stage_drafts_on_rank_0(model):
    """The mixed streams on two tensor-parallel ranks: rank 0 drafts and verifies, rank 1 trims
    as told, and the output is mlx-lm's (this model's top two logits are nowhere near a tie)."""
    reqs, expected, refs = requests(model)
    with tensor_stage(model, extra=SPECULATE) as (stub, infos):
        results = run_all(stub, reqs)
        metrics = metrics_at(infos[0]["metrics_port"])
    assert drafted(metrics, "accepted") > 0, metrics
    assert_answered(results, reqs, expected, refs)


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
