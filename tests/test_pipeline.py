"""Multi-stage pipelines over mx.distributed (ring on loopback), as separate worker processes."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from openai import OpenAI

from omlx_node.worker_config import WorkerConfig, WorkerJob, worker_process
from omlx_shared.child import ChildError, omlx_command
from proto import omlx_pb2 as pb
from tests.conftest import free_port, start_server
from tests.helpers.pipeline import PROMPTS, generate, pipeline, run_concurrently
from tests.helpers.session import SessionClient, wait_idle, worker_load
from tests.helpers.workers import stage_worker
from tests.tiny_models import build_model


@pytest.fixture(scope="module")
def references(model) -> dict[str, list[int]]:
    ref_model, tok = load(str(model))
    out = {}
    for p in PROMPTS:
        out[p] = [int(t) for t, _ in generate_step(mx.array(tok.encode(p)), ref_model,
                                                    max_tokens=20)]
    mx.synchronize()
    return out


@pytest.mark.parametrize("split, micro_batches", [
    ([1, 3], 2),        # two uneven stages, K = 2
    ([2, 1, 1], 3),     # three stages, K = 3
    ([1, 2, 1], 1),     # lockstep (K = 1): same tokens
    ([3, 1], 0),        # as many micro-batches as pay off on this device
])
@pytest.mark.slow
def test_pipeline_greedy_matches_mlx_lm(model, references, split, micro_batches):
    _, tok = load(str(model))
    with pipeline(model, split, micro_batches) as (stub, _):
        alone = generate(stub, tok.encode(PROMPTS[0]))
        assert alone == (references[PROMPTS[0]], "length")
        outs = run_concurrently(lambda p: generate(stub, tok.encode(p)), PROMPTS * 2)
        for p, (tokens, reason) in zip(PROMPTS * 2, outs):
            assert tokens == references[p], p
            assert reason == "length"


@pytest.mark.slow
def test_pipeline_concurrency_with_cancellation(model, references):
    _, tok = load(str(model))
    with pipeline(model, [1, 1, 2], 3) as (stub, _):
        cancelled: list[str] = []

        def one(i: int):
            p = PROMPTS[i % len(PROMPTS)]
            if i % 4 == 3:  # these leave after their first tokens
                with SessionClient(stub) as session:  # closed: the sequence is cancelled
                    next(session.generate(pb.GenerateRequest(
                        request_id=f"c{i}", prompt_tokens=tok.encode(p), max_tokens=500)))
                cancelled.append(p)
                return None
            return p, generate(stub, tok.encode(p), rid=f"r{i}")

        results = run_concurrently(one, list(range(16)))
        assert len(cancelled) == 4
        for r in results:
            if r is not None:
                p, (tokens, _) = r
                assert tokens == references[p]
        assert wait_idle(stub)["omlx_node_requests_processing"] == 0
        # The pipeline keeps serving after the cancellations.
        assert generate(stub, tok.encode(PROMPTS[1]))[0] == references[PROMPTS[1]]


@pytest.mark.slow
def test_group_that_cannot_form_names_host_port_backend(model):
    """A rank that dies before joining (a job it cannot read: its first layer "two"): it says
    which field, and rank 0 gives up after its init timeout, naming the backend, its own host
    and port and every peer's."""
    peers = (f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}")
    workers = [stage_worker(model, 0, (0, 2), peers, init_timeout=3),
               worker_process("rank 1")]
    try:
        job = json.loads(WorkerJob(WorkerConfig(model, "m", 2, 4, rank=1, peers=peers)).to_json())
        job["config"]["layer_start"] = "two"
        workers[1].send_line(json.dumps(job))
        assert workers[1].proc.wait(60) == 2
        assert "WorkerJob.config.layer_start: expected int, got 'two'" in workers[1].log_tail()
        with pytest.raises(ChildError) as err:
            workers[0].wait_ready(60)
    finally:
        for w in workers:
            w.stop()
    text = str(err.value)
    assert "rank 0 exited with code -9" in text  # the watchdog's kill
    assert ("error: could not form the ring group within 3s: rank 0 of 2, listening on "
            f"{peers[0]}, peers {peers[0]}, {peers[1]}. Is every node of the plan up and "
            "reachable?") in text


@pytest.mark.slow
def test_rank_zero_alone_times_out_naming_peers(model):
    peers = (f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}")
    job = WorkerJob(WorkerConfig(model, "m", 0, 2, peers=peers, init_timeout=2))
    r = subprocess.run([sys.executable, "-m", "omlx_node.worker"], input=job.to_json() + "\n",
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "could not form the ring group" in r.stderr and peers[1] in r.stderr


@pytest.mark.slow
def test_gateway_in_front_of_a_three_stage_pipeline(model, references, tmp_path):
    _, tok = load(str(model))
    with start_server(model, "--nodes", "3", "--split", "2,1,1", home=tmp_path / "h",
                      keepalive=None) as server:
        import httpx

        health = httpx.get(server.url + "/health", timeout=5).json()
        assert [n["layers"] for n in health["nodes"]] == [[0, 2], [2, 3], [3, 4]]
        client = OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)
        ids = tok.encode(PROMPTS[0])
        r = client.completions.create(model=server.model_id, prompt=ids, max_tokens=20,
                                      temperature=0, extra_body={"ignore_eos": True})
        assert r.choices[0].text == tok.decode(references[PROMPTS[0]])
        stream = client.chat.completions.create(
            model=server.model_id, messages=[{"role": "user", "content": "Hi"}],
            max_tokens=8, temperature=0, stream=True)
        assert sum(1 for c in stream if c.choices and c.choices[0].delta.content) >= 1


@pytest.mark.parametrize("flags, message", [
    (["--nodes", "2", "--split", "1,2"], "covers 3 layers"),
    (["--nodes", "3", "--split", "1,3"], "--split has 2 entries"),
    (["--nodes", "2", "--split", "4,0"], "at least one layer"),
])
def test_bad_split_is_refused(model, flags, message):
    r = subprocess.run(omlx_command("serve", "--model", str(model), "--port", str(free_port()),
                                    *flags), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert message in r.stderr


@pytest.mark.slow
def test_a_prompt_prefills_between_the_steps_of_a_decoding_stream(tmp_path):
    """A pipeline's head paces its prefill as one node's engine does (step_pace.py): a long
    prompt that arrives while a stream decodes is prefilled in chunks between that stream's
    steps, not in one `--prefill-chunk` pass that every decoding row waits for; both streams'
    greedy tokens stay mlx-lm's. (A wider model than the tiny one: its prompt tokens cost more
    than a pass's fixed part, as a real model's do.)"""
    model = build_model(tmp_path / "wide", "llama", num_layers=4, hidden_size=512)
    ref_model, tok = load(str(model))
    stream_ids, long_ids = tok.encode(PROMPTS[0]), tok.encode(PROMPTS[4] * 5)
    refs = [[int(t) for t, _ in generate_step(mx.array(ids), ref_model, max_tokens=n)]
            for ids, n in ((stream_ids, 400), (long_ids, 8))]
    mx.synchronize()
    assert len(long_ids) < 1024
    passes = 'omlx_node_stage_steps_total{kind="prefill"}'
    with pipeline(model, [2, 2], 2, extra=("--prefill-chunk", "1024")) as (stub, _):
        # The pace's first measurements: two passes of sizes far apart (a fit over two close
        # ones, timed on a busy machine, may take every token for the pass's fixed part).
        numbers = tok.encode(" ".join(str(i) for i in range(150)))
        for ids in (numbers[:40], numbers[40:]):
            generate(stub, ids, max_tokens=4)
        out: dict = {}
        streaming = threading.Thread(target=lambda: out.update(
            stream=generate(stub, stream_ids, max_tokens=400)))
        streaming.start()
        deadline = time.monotonic() + 60
        while worker_load(stub)["omlx_node_tokens_predicted_total"] < 60:
            assert time.monotonic() < deadline and streaming.is_alive()
            time.sleep(0.02)
        before = worker_load(stub)[passes]
        assert generate(stub, long_ids, max_tokens=8) == (refs[1], "length")
        during = worker_load(stub)[passes] - before
        streaming.join(120)
        assert out["stream"] == (refs[0], "length")
    assert during > 1, "the prompt went in one pass while the stream decoded"
