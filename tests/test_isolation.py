"""A request that fails the engine fails alone: the batch, its other rows and the engine's state
(KV, mx.random's key) go on as if it had never come. In process (the single-node engine), on a
two-stage pipeline of worker processes (the tail samples and reports a row's failure), and a
fuzzer over every sampling field against live servers with greedy bystanders streaming."""

from __future__ import annotations

import json
import threading
import time

import httpx
import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm import load
from mlx_lm.sample_utils import apply_top_k

from omlx_node.batcher import Batcher, Engine
from omlx_node.metrics import NodeMetrics
from omlx_node.sampling import SamplingParams
from omlx_node.sequence import SeqRequest
from omlx_node.stage import StageRunner
from proto import omlx_pb2 as pb
from tests.conftest import start_server
from tests.helpers.constraints import GRAMMAR, generate, parse, tokens_of, two_stages
from tests.helpers.engine import drain, reference
from tests.helpers.pipeline import run_concurrently

PROMPTS = ["Hello world", "The capital of France is", "x", "def add(a, b):\n    return"]
# Parameters mlx-lm's samplers refuse: only the gateway's checks and clamp keep them from a node.
POISON = [SamplingParams(temperature=1.0, top_k=100_000),
          SamplingParams(temperature=0.7, min_p=1.5, logprobs=3, seed=1)]


@pytest.fixture(scope="module")
def mlx_lm_model(llama_2_layers):
    return load(str(llama_2_layers))


def test_a_failing_row_ends_alone_and_the_batch_goes_on(llama_2_layers, mlx_lm_model):
    model, tok = mlx_lm_model
    batcher = Batcher(StageRunner(llama_2_layers), NodeMetrics())
    prompts = [tok.encode(p) for p in PROMPTS]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=11)
    alone = drain(batcher, [batcher.submit(SeqRequest("a", prompts[0], 16, seeded))])[0][0]
    greedy = [batcher.submit(SeqRequest(f"g{i}", p, 16)) for i, p in enumerate(prompts)]
    for _ in range(5):  # the bystanders are decoding when the poison arrives
        batcher.step()
    with_seed = batcher.submit(SeqRequest("s", prompts[0], 16, seeded))
    poison = [batcher.submit(SeqRequest(f"p{i}", prompts[1], 16, p)) for i, p in enumerate(POISON)]
    # A seed no PRNG key takes (the wire's uint64 keeps it from a worker): no sampler at all.
    unmade = batcher.submit(SeqRequest("k", prompts[1], 16, SamplingParams(temperature=1.0,
                                                                           seed=2**64)))
    results = drain(batcher, [*greedy, with_seed, *poison, unmade])
    (tokens, fin) = results.pop()
    assert fin.reason == "error" and not tokens
    assert fin.error.startswith("sampling cannot start: TypeError: key()")
    for (tokens, fin), p in zip(results, prompts):
        assert tokens == reference(model, p, 16) and fin.reason == "length"
    assert results[len(greedy)][0] == alone  # its key was not advanced by the failed probes
    for (tokens, fin), params in zip(results[-len(POISON):], POISON):
        assert fin.reason == "error" and not tokens
        assert fin.error.startswith("sampling failed: ValueError:")
    assert "top_k" in results[-2][1].error and "min_p" in results[-1][1].error
    assert batcher.ready and batcher.running == 0 and not batcher.state.caches
    # mx.random's key is whole: unseeded sampling works ("array without a primitive" before).
    (tokens, fin), = drain(batcher, [batcher.submit(SeqRequest(
        "u", prompts[2], 8, SamplingParams(temperature=1.0)))])
    assert fin.reason == "length" and len(tokens) == 8


def test_a_step_no_row_explains_fails_the_batch_once_and_recovers(llama_2_layers, mlx_lm_model):
    """mx.random's key left a placeholder (what a compiled mlx-lm sampler that raises while
    tracing leaves behind) before a step: the step fails, not any one request's fault. Every
    sequence ends once with a message that names no request, and the engine serves again."""
    model, tok = mlx_lm_model
    batcher = Batcher(StageRunner(llama_2_layers), NodeMetrics())
    ids = tok.encode(PROMPTS[0])
    seqs = [batcher.submit(SeqRequest("g", ids, 16)),
            batcher.submit(SeqRequest("u", ids, 16, SamplingParams(temperature=0.9, top_k=7)))]
    for _ in range(4):
        batcher.step()
    with pytest.raises(ValueError):
        apply_top_k(mx.zeros((1, 8)), 100)  # on the engine's thread, as a sampler would
    results = drain(batcher, seqs)
    for _, fin in results:
        assert (fin.reason, fin.error) == ("error", Engine.failure_message)
    assert batcher.ready and batcher.status == "ready"
    (tokens, fin), (sampled, sfin) = drain(batcher, [
        batcher.submit(SeqRequest("g2", ids, 16)),
        batcher.submit(SeqRequest("u2", ids, 16, SamplingParams(temperature=1.0)))])
    assert tokens == reference(model, ids, 16) and fin.reason == sfin.reason == "length"


@pytest.mark.slow
def test_a_row_failing_on_the_tail_ends_alone(llama_2_layers, mlx_lm_model):
    """The tail samples: it reports the failed rows in its answer, the head ends them with their
    own error, and the others (greedy, logprobs, a grammar) stream on unchanged."""
    model, tok = mlx_lm_model
    prompts = [tok.encode(p) for p in PROMPTS]
    poison = [
        {"sampling": pb.SamplingParams(temperature=1.0, top_k=100_000)},
        {"sampling": pb.SamplingParams(temperature=1.0, min_p=1.5), "logprobs": True,
         "top_logprobs": 4, "grammar": GRAMMAR},
    ]
    jobs = ([("plain", p, {}) for p in prompts]
            + [("logprobs", prompts[3], {"logprobs": True, "top_logprobs": 2})]
            + [("grammar", prompts[1], {"grammar": GRAMMAR})]
            + [("poison", prompts[0], f) for f in poison])
    # every row in one batch
    with two_stages(llama_2_layers, llama_2_layers, micro_batches=1) as stub:
        alone = tokens_of(generate(stub, prompts[1], 64, grammar=GRAMMAR))
        outs = run_concurrently(lambda job: generate(stub, job[1], 64 if job[2] else 12,
                                                     **job[2]), jobs)
        for (kind, ids, _), chunks in zip(jobs, outs):
            reason = chunks[-1].finish_reason
            if kind == "plain":
                assert tokens_of(chunks) == reference(model, ids, 12) and reason == "length"
            elif kind == "logprobs":
                assert tokens_of(chunks) == reference(model, ids, 64)
                assert sum(len(c.logprobs) for c in chunks) == 64
            elif kind == "grammar":
                assert tokens_of(chunks) == alone and reason == "stop"
                parse(tok, tokens_of(chunks))
            else:
                assert reason == "error" and not tokens_of(chunks), chunks
                assert chunks[-1].error.startswith("sampling failed: ValueError:")
        assert "top_k" in outs[-2][-1].error and "min_p" in outs[-1][-1].error
        sampled = generate(stub, prompts[0], 12, sampling=pb.SamplingParams(temperature=1.0))
        assert sampled[-1].finish_reason == "length" and len(tokens_of(sampled)) == 12
        assert stub.Health(pb.HealthRequest(), timeout=5).ready


# ---- fuzzing every sampling field against a live server ----------------------------------------

BYSTANDERS = 8
BYSTANDER_TOKENS = 48
FUZZ_EXAMPLES = 20

_floats = st.floats(allow_nan=False, allow_infinity=False, width=32)
# Each field: values a client may send, valid or not, near and past the edges.
SAMPLING_FIELDS = {
    "temperature": st.one_of(st.floats(0, 2), st.sampled_from([-1.0, 1e-45, 2.5, 1e308])),
    "top_p": st.one_of(st.floats(0, 1), st.sampled_from([-0.5, 1e-30, 1.5])),
    "top_k": st.one_of(st.integers(-2, 400), st.sampled_from([2**31 - 1, 2**31, 100_000])),
    "min_p": st.one_of(st.floats(0, 1), st.sampled_from([-0.1, 1.5])),
    "seed": st.one_of(st.none(), st.integers(-1, 2**64)),
    "presence_penalty": st.one_of(st.floats(-2, 2), _floats),
    "frequency_penalty": st.one_of(st.floats(-2, 2), _floats),
    "repetition_penalty": st.one_of(st.floats(0, 3), st.sampled_from([-1.0, 1e30, 1e-30])),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(-1, 25),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    "max_tokens": st.integers(1, 8),
}


def _chat(model_id: str, i: int) -> dict:
    return {"model": model_id, "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)] + f" {i}"}],
            "max_tokens": BYSTANDER_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True}


def _stream_text(url: str, body: dict) -> str:
    text = ""
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                if event["choices"]:
                    text += event["choices"][0]["delta"].get("content") or ""
    return text


def fuzz_with_bystanders(url: str, model_id: str) -> None:
    refs = run_concurrently(lambda i: _stream_text(url, _chat(model_id, i)),
                            list(range(BYSTANDERS)))
    assert all(refs), refs
    done = threading.Event()
    runs = [0] * BYSTANDERS
    wrong: list[str] = []

    def bystander(i: int) -> None:  # streams again and again until the fuzzing is over
        while not done.is_set():
            try:
                text = _stream_text(url, _chat(model_id, i))
            except AssertionError as e:
                wrong.append(f"bystander {i}: {e}")
                return
            if text != refs[i]:
                wrong.append(f"bystander {i}: {text!r} != {refs[i]!r}")
            runs[i] += 1

    threads = [threading.Thread(target=bystander, args=(i,)) for i in range(BYSTANDERS)]
    for t in threads:
        t.start()
    seen: dict[int, int] = {}

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.fixed_dictionaries({}, optional=SAMPLING_FIELDS))
    def one(fields: dict) -> None:
        body = {"model": model_id, "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 8, **fields}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        # Refused (400), served, or failed on its own (500, the node's words about it): never
        # the node lost (503), nor another request's error.
        assert r.status_code in (200, 400, 500), (fields, r.text)
        if r.status_code == 500:
            assert r.json()["error"]["message"].startswith("generation failed on the node"), r.text
        if r.status_code == 200:
            assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")

    try:
        deadline = time.monotonic() + 30
        while min(runs) == 0 and not wrong and time.monotonic() < deadline:
            time.sleep(0.05)  # every bystander has streamed once: they are all in the batch
        one()
    finally:
        done.set()
        for t in threads:
            t.join(120)
    assert not wrong, wrong
    assert seen.get(200) and seen.get(400), seen  # the fuzzer reached the node and the checks
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": model_id, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8,
        "temperature": 0.8, "top_p": 0.9, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
    assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"


@pytest.mark.slow
@pytest.mark.parametrize("nodes", [1, 2])
def test_fuzzed_sampling_fields_never_disturb_bystanders(llama_2_layers, tmp_path, nodes):
    with start_server(llama_2_layers, "--nodes", str(nodes), home=tmp_path / "h",
                      keepalive=None) as server:
        fuzz_with_bystanders(server.url, server.model_id)
        assert "Traceback" not in server.log_tail(400), server.log_tail(100)
