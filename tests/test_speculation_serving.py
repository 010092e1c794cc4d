"""OpenAI's predicted outputs through a live server and the OpenAI SDK: the same answer as
without one, the usage fields that count the prediction, and the node's /metrics."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import grpc
import httpx
import mlx.core as mx
import openai
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from proto import omlx_pb2 as pb
from proto import omlx_pb2_grpc as pb_grpc
from tests.conftest import start_server
from tests.helpers.node import running_node
from tests.helpers.session import generate_chunks

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Repeat: the cat sat on the mat, the cat sat on the mat."}]


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    # ngram: drafts whatever this machine's step costs ("auto" may find them too dear here).
    with start_server(tiny_model_path, "--speculative", "ngram", node_metrics=True,
                      home=tmp_path_factory.mktemp("home")) as s:
        yield s


def test_prediction_drafts_and_usage_counts_it(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                           timeout=120)
    kw = {"model": server.model_id, "messages": ASK, "max_tokens": 40, "temperature": 0}
    plain = client.chat.completions.create(**kw)
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details is None  # no prediction, no counts
    predicted = client.chat.completions.create(
        **kw, prediction={"type": "content", "content": [{"type": "text", "text": text}]})
    assert predicted.choices[0].message.content == text
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0
    assert details.rejected_prediction_tokens >= 0
    # Half of it wrong: fewer stand, the answer is still the model's own.
    wrong = text[:len(text) // 2] + " zebra " * 10
    stream = client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True},
        prediction={"type": "content", "content": wrong})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    usage = chunks[-1].usage.completion_tokens_details
    assert 0 < usage.accepted_prediction_tokens <= details.accepted_prediction_tokens
    assert usage.rejected_prediction_tokens > details.rejected_prediction_tokens
    # A stop string inside a run of accepted drafts ends the text there, as without drafts.
    stop = text[len(text) // 2:len(text) // 2 + 4]
    stopped = client.chat.completions.create(**kw, stop=[stop],
                                             prediction={"type": "content", "content": text})
    assert stopped.choices[0].message.content == text[:text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens_details.accepted_prediction_tokens > 0
    metrics = server.node_metrics()
    drafted = metrics['omlx_node_speculative_draft_tokens_total{source="prediction"}']
    accepted = metrics['omlx_node_speculative_accepted_tokens_total{source="prediction"}']
    assert drafted >= accepted > 0
    assert 0 < metrics["omlx_node_speculative_acceptance_rate"] <= 1
    assert metrics["omlx_node_speculative_tokens_per_step"] > 1


def test_a_draft_model_drafts_through_the_server(server, tiny_model_path, tmp_path):
    """`--speculative draft=PATH` (the model drafting for itself: every draft stands): the
    same greedy answers as the ngram server's plain ones, a stop string inside a run of
    accepted drafts ends the text there, and /metrics counts the drafts by source."""
    kw = {"model": server.model_id, "messages": ASK, "max_tokens": 40, "temperature": 0}
    plain = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                          timeout=120).chat.completions.create(**kw)
    text = plain.choices[0].message.content
    with start_server(tiny_model_path, "--speculative", f"draft={tiny_model_path}",
                      node_metrics=True, home=tmp_path / "home") as drafting:
        client = openai.OpenAI(base_url=drafting.base_url, api_key="unused", max_retries=0,
                               timeout=120)
        assert client.chat.completions.create(**kw).choices[0].message.content == text
        stop = text[len(text) // 2:len(text) // 2 + 4]
        stopped = client.chat.completions.create(**kw, stop=[stop])
        assert stopped.choices[0].message.content == text[:text.index(stop)]
        assert stopped.choices[0].finish_reason == "stop"
        metrics = drafting.node_metrics()
        # The gateway shows what its agent last probed: status, and its own /metrics.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status = httpx.get(drafting.url + "/cluster/status", timeout=10).json()
            [spec] = status["models"][0]["speculative"] or [None]
            if spec is not None:
                break
            time.sleep(0.5)
        assert spec is not None, status["models"][0]
        assert spec["acceptance_rate"] == 1.0 and spec["tokens_per_step"] > 1
        gateway = drafting.metrics()  # (its model and node labels left out)
        assert gateway["omlx_model_speculative_acceptance_rate"] == 1.0
        assert gateway["omlx_model_speculative_tokens_per_step"] > 1
        shown = subprocess.run([sys.executable, "-m", "omlx_cluster", "status", "--url",
                                drafting.url], capture_output=True, text=True, timeout=60,
                               env={**os.environ, "COLUMNS": "200"})
        assert "speculative decoding, 100% of drafted tokens stood" in shown.stdout, shown
    drafted = metrics['omlx_node_speculative_draft_tokens_total{source="draft"}']
    accepted = metrics['omlx_node_speculative_accepted_tokens_total{source="draft"}']
    assert drafted == accepted > 0
    assert metrics["omlx_node_speculative_max_rows"] >= 1


def test_a_bad_prediction_is_a_400_naming_it(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model_id, messages=ASK, max_tokens=4,
                                       prediction={"type": "file", "content": "x"})
    assert "prediction" in str(e.value)


def test_a_models_own_mode_reaches_its_worker(tiny_model_path, tmp_path):
    """LoadShardRequest.speculative (a model's `speculative` in --models-config) wins over the
    node's --speculative: the same prediction drafts under "ngram" and not under "off"."""
    model, tok = load(str(tiny_model_path))
    ids = tok.encode("one two three one two three one two")
    ref = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=16)]
    with running_node(tmp_path, "--speculative", "off") as (_, agent):
        for mode, drafts in (("ngram", True), ("off", False), ("", False)):
            reply = agent.LoadShard(pb.LoadShardRequest(
                model_path=str(tiny_model_path), model_id="m", speculative=mode), timeout=180)
            with grpc.insecure_channel(reply.worker_address) as channel:
                chunks = generate_chunks(pb_grpc.ShardWorkerStub(channel), pb.GenerateRequest(
                    request_id=mode or "node", prompt_tokens=ids, max_tokens=16,
                    prediction_tokens=ref), timeout=60)
            assert [t for c in chunks for t in c.tokens] == ref
            last = chunks[-1]
            assert (last.accepted_prediction_tokens > 0) is drafts, mode
            assert last.accepted_prediction_tokens + last.rejected_prediction_tokens == len(ref)
