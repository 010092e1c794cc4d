"""Penalties, logprobs and llguidance grammars on the node: the single-node batcher against
mlx-lm's own generation, and a two-stage pipeline (separate worker processes) against both."""

from __future__ import annotations

import queue
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import llguidance
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors

from omlx_node import wire
from omlx_node.batcher import Batcher
from omlx_node.constraints import Grammars, Verdict, fill_masks
from omlx_node.metrics import NodeMetrics
from omlx_node.sampling import SamplingParams
from omlx_node.sequence import SeqRequest
from omlx_node.session import Session
from omlx_node.stage import StageRunner
from proto import omlx_pb2 as pb
from tests.helpers.constraints import GRAMMAR, generate, parse, tokens_of, two_stages
from tests.helpers.engine import assert_logprobs_match, drain, reference, reference_logprobs
from tests.helpers.pipeline import run_concurrently

BAD_GRAMMAR = llguidance.LLMatcher.grammar_from_lark("start: undefined_rule")
PENALTIES = [
    {"repetition_penalty": 1.5},
    {"presence_penalty": 0.8},
    {"frequency_penalty": 0.6},
    {"repetition_penalty": 1.2, "presence_penalty": 0.3, "frequency_penalty": 0.4},
]
PROMPTS = ["Hello world", "The capital of France is", "x", "the the the cat cat cat"]


@pytest.fixture(scope="module")
def mlx_lm_model(llama_2_layers):
    return load(str(llama_2_layers))


@pytest.fixture(scope="module")
def batcher(llama_2_layers) -> Batcher:
    return Batcher(StageRunner(llama_2_layers), NodeMetrics(), grammars=Grammars(llama_2_layers))


def penalized_reference(model, ids: list[int], n: int, **penalties) -> list[int]:
    out = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=n,
                                            logits_processors=make_logits_processors(**penalties))]
    mx.synchronize()
    return out


def test_constrained_rows_follow_the_schema_and_leave_the_batch_alone(batcher, mlx_lm_model):
    model, tok = mlx_lm_model
    prompts = [tok.encode(p) for p in PROMPTS]
    plain = [batcher.submit(SeqRequest(f"u{i}", p, 12)) for i, p in enumerate(prompts)]
    greedy = [batcher.submit(SeqRequest(f"g{i}", p, 64, grammar=GRAMMAR))
              for i, p in enumerate(prompts[:2])]
    sampled = batcher.submit(SeqRequest("s", prompts[0], 64, SamplingParams(
        temperature=1.0, top_p=0.9, seed=7), grammar=GRAMMAR))
    results = drain(batcher, [*plain, *greedy, sampled])
    for (tokens, fin), p in zip(results, prompts):
        assert tokens == reference(model, p, 12) and fin.reason == "length"
    for tokens, fin in results[len(plain):]:
        assert fin.reason == "stop", fin
        parse(tok, tokens)
    assert batcher.running == 0 and not batcher.state.caches


def test_constrained_greedy_takes_the_argmax_of_the_allowed_tokens(batcher, mlx_lm_model):
    model, tok = mlx_lm_model
    ids = tok.encode(PROMPTS[0])
    (tokens, _), = drain(batcher, [batcher.submit(SeqRequest("g", ids, 64, grammar=GRAMMAR))])
    matcher = batcher.grammars.matcher(GRAMMAR)
    cache = make_prompt_cache(model)
    logits = model(mx.array([ids]), cache=cache)[0, -1]
    for t in tokens:
        vocab = logits.shape[0]
        bits = np.unpackbits(fill_masks([matcher], vocab).view(np.uint8),
                             bitorder="little")[:vocab]
        assert t == int(np.argmax(np.where(bits, np.array(logits), -np.inf)))
        assert matcher.advance(t) in (Verdict.GO, Verdict.LAST)
        logits = model(mx.array([[t]]), cache=cache)[0, -1]


def test_resumed_request_continues_under_its_grammar(batcher, mlx_lm_model):
    _, tok = mlx_lm_model
    ids = tok.encode(PROMPTS[1])
    (whole, _), = drain(batcher, [batcher.submit(SeqRequest("w", ids, 64, grammar=GRAMMAR))])
    k = len(whole) // 2
    (rest, fin), = drain(batcher, [batcher.submit(SeqRequest(
        "r", ids + whole[:k], 64 - k, grammar=GRAMMAR, resumed_tokens=k))])
    assert whole[:k] + rest == whole and fin.reason == "stop"


def test_penalties_match_mlx_lm(batcher, mlx_lm_model):
    model, tok = mlx_lm_model
    ids = tok.encode(PROMPTS[3])
    n = 12
    seqs = [batcher.submit(SeqRequest(f"p{i}", ids, n, SamplingParams(**p)))
            for i, p in enumerate(PENALTIES)]
    seqs.append(batcher.submit(SeqRequest("plain", ids, n)))
    results = drain(batcher, seqs)
    refs = [penalized_reference(model, ids, n, **p) for p in PENALTIES]
    assert [r[0] for r in results[:-1]] == refs
    assert results[-1][0] == reference(model, ids, n)
    assert any(r != results[-1][0] for r in refs)  # the penalties do change the output


def test_logprobs_match_mlx_lm(batcher, mlx_lm_model):
    model, tok = mlx_lm_model
    ids = tok.encode(PROMPTS[3])
    n = 8
    cases = [(5, {}), (0, {}), (20, PENALTIES[3])]
    seqs = [batcher.submit(SeqRequest(f"l{i}", ids, n, SamplingParams(logprobs=k, **p)))
            for i, (k, p) in enumerate(cases)]
    plain = batcher.submit(SeqRequest("plain", ids, n))
    results = drain(batcher, [*seqs, plain])
    for seq, (tokens, _), (k, p) in zip(seqs, results, cases):
        got = [(t, lp.logprob, lp.top_ids, lp.top_logprobs) for t, lp in zip(tokens, seq.logprobs)]
        assert len(seq.logprobs) == len(tokens)
        assert_logprobs_match(got, reference_logprobs(model, ids, n, **p), k)
    assert not plain.logprobs and results[-1][0] == reference(model, ids, n)


def test_bad_grammar_fails_only_its_own_request(llama_2_layers, batcher, mlx_lm_model):
    model, tok = mlx_lm_model
    ids = tok.encode(PROMPTS[0])
    running = batcher.submit(SeqRequest("ok", ids, 30))
    for _ in range(5):
        batcher.step()
    for grammar, resumed, message in [
        (BAD_GRAMMAR, 0, "undefined_rule"),
        ("{not json", 0, "grammar cannot be used"),
        (GRAMMAR, 1, "resumed tokens do not follow the grammar"),  # the prompt is not JSON
    ]:
        with pytest.raises(ValueError, match=message):
            batcher.submit(SeqRequest("bad", ids, 8, grammar=grammar, resumed_tokens=resumed))
    no_grammars = Batcher(StageRunner(llama_2_layers), NodeMetrics())
    with pytest.raises(ValueError, match="does not apply grammars"):
        no_grammars.submit(SeqRequest("bad", ids, 8, grammar=GRAMMAR))
    assert drain(batcher, [running])[0][0] == reference(model, ids, 30)


def test_a_grammar_request_dropped_while_its_compile_waits_is_never_compiled(batcher,
                                                                             mlx_lm_model):
    """A session's requests with a grammar wait for the compiler's threads; one cancelled, or
    whose session ended, meanwhile is dropped there: no compile, no sequence, nothing sent."""
    _, tok = mlx_lm_model
    ids = tok.encode(PROMPTS[0])
    compiler = ThreadPoolExecutor(1)
    busy = threading.Event()
    compiler.submit(busy.wait, 30)  # another request's long compile
    session = Session(batcher, 8, compiler)
    submitted = batcher.metrics.registry.get_sample_value("omlx_node_requests_total")
    for rid in ("cancelled", "left-behind"):
        session._take(pb.GenerateRequest(request_id=rid, prompt_tokens=ids, max_tokens=8,
                                         grammar=GRAMMAR))
    session._cancel("cancelled")
    session.close("the call ended")
    busy.set()
    compiler.shutdown(wait=True)
    batcher.step()
    assert batcher.metrics.registry.get_sample_value("omlx_node_requests_total") == submitted
    assert batcher.idle
    assert session.outbox.get_nowait() is None  # the session's end, and nothing else
    with pytest.raises(queue.Empty):
        session.outbox.get_nowait()


def test_matcher_verdicts(llama_2_layers, mlx_lm_model):
    _, tok = mlx_lm_model
    grammars = Grammars(llama_2_layers)
    digits = grammars.matcher(llguidance.LLMatcher.grammar_from_regex("[0-9]+"))
    one = tok.encode("1")
    assert len(one) == 1
    assert digits.advance(one[0]) == Verdict.GO  # "1" may go on: not stopped yet
    assert digits.advance(tok.eos_token_id) == Verdict.END
    closed = grammars.matcher(llguidance.LLMatcher.grammar_from_lark('start: "x"'))
    assert closed.advance(tok.encode("x")[0]) == Verdict.LAST
    wrong = grammars.matcher(llguidance.LLMatcher.grammar_from_lark('start: "x"'))
    assert wrong.advance(tok.encode("y")[0]) == Verdict.ERROR and wrong.error
    assert not wrong.active


def test_admission_records_cost_only_what_rows_ask():
    plain = wire.Admit(7, SamplingParams(temperature=0.5, seed=3))
    assert len(plain.encode()) == 8
    # Floats a float32 holds exactly: they travel as float32.
    full = wire.Admit(9, SamplingParams(temperature=0.75, top_p=0.5, top_k=4, min_p=0.25,
                                        seed=2**40, presence_penalty=0.5, frequency_penalty=0.25,
                                        repetition_penalty=1.5, logprobs=3),
                      context=[1, 2, 3], grammar=GRAMMAR + "é", resumed=[4, 5])
    for admit in (plain, full):
        sent = wire.Step(wire.DECODE, keep=[0], admits=[admit, plain])
        got = wire.Step(wire.DECODE)
        got.load(sent.payload())
        assert got == sent


# ---- a two-stage pipeline --------------------------------------------------------------------


@pytest.mark.slow  # two shard worker processes
def test_pipeline_applies_grammars_penalties_and_logprobs_on_its_tail(llama_2_layers, batcher,
                                                                      mlx_lm_model):
    model, tok = mlx_lm_model
    prompts = [tok.encode(p) for p in PROMPTS]
    # The single node's constrained outputs: the pipeline computes the same logits.
    single = [t for t, _ in drain(batcher, [batcher.submit(SeqRequest(str(i), p, 64,
                                                                      grammar=GRAMMAR))
                                            for i, p in enumerate(prompts)])]
    penalized = pb.SamplingParams(repetition_penalty=1.2, presence_penalty=0.3,
                                  frequency_penalty=0.4)
    jobs = (
        [("grammar", p, {"grammar": GRAMMAR}) for p in prompts]
        + [("plain", p, {}) for p in prompts]
        + [("sampled", prompts[0], {"grammar": GRAMMAR, "sampling": pb.SamplingParams(
            temperature=1.0, has_seed=True, seed=5)})]
        + [("logprobs", prompts[3], {"logprobs": True, "top_logprobs": 4, "sampling": penalized})]
    )
    with two_stages(llama_2_layers, llama_2_layers, micro_batches=2) as stub:
        outs = run_concurrently(lambda job: generate(stub, job[1], 64 if job[2] else 12,
                                                     **job[2]), jobs)
        for (kind, ids, _), chunks in zip(jobs, outs):
            tokens, reason = tokens_of(chunks), chunks[-1].finish_reason
            if kind == "grammar":
                assert tokens == single[prompts.index(ids)] and reason == "stop"
                parse(tok, tokens)
            elif kind == "plain":
                assert tokens == reference(model, ids, 12) and reason == "length"
            elif kind == "sampled":
                assert reason == "stop"
                parse(tok, tokens)
            else:
                got = [(t, lp.logprob, lp.top_ids, lp.top_logprobs)
                       for t, lp in zip(tokens, (lp for c in chunks for lp in c.logprobs))]
                assert len(got) == len(tokens) == 64
                ref = reference_logprobs(model, ids, 64, repetition_penalty=1.2,
                                         presence_penalty=0.3, frequency_penalty=0.4)
                assert_logprobs_match(got, ref, 4)
            if kind != "logprobs":
                assert not any(c.logprobs for c in chunks)

        whole = single[1]
        k = len(whole) // 2
        rest = generate(stub, prompts[1] + whole[:k], 64 - k, grammar=GRAMMAR, resumed_tokens=k)
        assert whole[:k] + tokens_of(rest) == whole and rest[-1].finish_reason == "stop"
        with pytest.raises(grpc.RpcError) as err:
            generate(stub, prompts[0], 8, grammar=BAD_GRAMMAR)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "undefined_rule" in err.value.details()
        assert tokens_of(generate(stub, prompts[0], 12)) == reference(model, prompts[0], 12)


@pytest.mark.slow
def test_grammar_failing_on_the_tail_ends_only_its_request(llama_2_layers, mlx_lm_model, tmp_path):
    """A tail whose folder has no tokenizer cannot compile the grammar the head accepted: that
    request ends with the tail's error; the others in its micro-batch go on."""
    model, tok = mlx_lm_model
    tail = tmp_path / "no-tokenizer"
    tail.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(llama_2_layers / f, tail / f)
    ids = tok.encode(PROMPTS[0])
    with two_stages(llama_2_layers, tail, micro_batches=1) as stub:  # both rows in one
        plain, constrained = run_concurrently(
            lambda fields: generate(stub, ids, 12, **fields), [{}, {"grammar": GRAMMAR}])
        assert tokens_of(plain) == reference(model, ids, 12)
        assert constrained[-1].finish_reason == "error" and not tokens_of(constrained)
        assert "grammars are unavailable" in constrained[-1].error
