"""Tensor x pipeline (omlx_node/sub_group.py): two stages of two tensor-parallel ranks each, as
four worker processes over mx.distributed's ring on loopback, against mlx-lm's own greedy
generation on a tiny random fp32 llama."""

from __future__ import annotations


import httpx
import pytest
from mlx_lm import load

from proto import omlx_pb2 as pb
from tests.conftest import start_server
from tests.helpers.failover import run_and_kill
from tests.helpers.pipeline import PROMPTS, pipeline
from tests.helpers.session import generate_chunks
from tests.helpers.speculation import (
    SPECULATE,
    assert_answered,
    drafted,
    metrics_at,
    requests,
    run_all,
)
from tests.helpers.tensor_reference import (TOKENS, assert_matches, assert_serves_like_mlx_lm,
                                            reference, shard_bytes)
from tests.tiny_models import build_model

pytestmark = pytest.mark.slow


def test_two_stages_of_two_ranks_match_mlx_lm(model):
    """One stream alone, then every prompt at once twice over (continuous batching, chunked
    prefill past the 8-token chunk, two micro-batches), logprobs, and a prompt seen before
    (every rank's prefix cache holds its own heads of its own layers)."""
    _, tok = load(str(model))
    refs = reference(model, PROMPTS)
    with pipeline(model, [2, 2], ranks=2, extra=("--hot-cache-max-size", "64MB")) as (stub,
                                                                                      workers):
        whole = (model / "model.safetensors").stat().st_size
        for w in workers:  # a quarter of the layers and the embedding or the head, no more
            held = shard_bytes(w.wait_ready(1)["metrics_port"])
            assert held < whole * 0.6, (held, whole)
        assert_serves_like_mlx_lm(stub, tok, refs)
        chunks = generate_chunks(stub, pb.GenerateRequest(
            request_id="again", prompt_tokens=tok.encode(PROMPTS[4]), max_tokens=TOKENS))
        assert max(c.cached_tokens for c in chunks) > 0  # restored on every rank
        assert_matches([t for c in chunks for t in c.tokens], refs[PROMPTS[4]], PROMPTS[4])
        for w in workers:  # a clean stop: rank 0's STOP ends every other rank
            w.stop()
            assert w.proc.returncode == 0, w.log_tail()


@pytest.mark.parametrize("drafter", ["ngram", "draft"])
def test_two_stages_of_two_ranks_speculate_as_mlx_lm(model, drafter):
    """Eight streams at once mixing rows that draft (by prompt lookup, or a draft model on
    rank 0: the model itself, whose drafts all stand), rows that draft from a prediction (one
    of them stopped inside a run of drafts) and plain rows, over two micro-batches: the head
    stage's rank 0 drafts, the last stage's last rank verifies, and all four ranks trim what
    did not stand; every row's tokens and logprobs are mlx-lm's, and drafts stood (rank 0's
    /metrics, and a prediction's rows' usage). Rank 1 runs with `--speculative off`, as a node
    joined with other flags may: the head's stage still agrees to measure its costs."""
    reqs, expected, refs = requests(model)
    mode = SPECULATE if drafter == "ngram" else ("--speculative", f"draft={model}",
                                                  *SPECULATE[2:])
    with pipeline(model, [2, 2], ranks=2, extra=mode,
                  rank_flags={1: ("--speculative", "off")}) as (stub, workers):
        results = run_all(stub, reqs)
        metrics = metrics_at(workers[0].wait_ready(1)["metrics_port"])
        for w in workers:  # every rank still agrees with rank 0: a clean stop ends them all
            w.stop()
            assert w.proc.returncode == 0, w.log_tail()
    assert drafted(metrics, "accepted") > 0, metrics
    assert drafted(metrics, "draft") >= drafted(metrics, "accepted")
    by_source = {k.partition('source="')[2].partition('"')[0] for k, v in metrics.items()
                 if k.startswith("omlx_node_speculative_accepted_tokens_total") and v > 0}
    assert by_source == {drafter, "prediction"}, metrics
    assert_answered(results, reqs, expected, refs)


@pytest.mark.parametrize("victim", ["worker", "agent"])
def test_gateway_serves_two_stages_of_two_ranks_and_survives_a_killed_rank(tmp_path, victim):
    """`serve --nodes 4 --parallel tensor-pipeline`: the planner cuts the four nodes into two
    tensor stages of two (equal local nodes: halving a stage's reads pays, a rank alone does
    not), status says so; then eight streams run, and mid-stream a rank of the second stage is
    SIGKILLed (its worker: the same nodes are planned again; or its whole node: the three
    survivors are, a stage of two and one alone), and every stream ends as it did
    undisturbed."""
    model = build_model(tmp_path / "tiny-fo", "llama", num_layers=4, hidden_size=256, seed=5)
    with start_server(model, "--nodes", "4", "--parallel", "tensor-pipeline",
                      home=tmp_path / "h", keepalive=None) as server:
        status = httpx.get(server.url + "/cluster/status", timeout=10).json()
        assert status["parallel"] == "tensor x2 > tensor x2 over ring"
        ranges = [(s["layer_start"], s["layer_end"]) for s in status["plan"]["stages"]]
        assert ranges[0] == ranges[1] and ranges[2] == ranges[3]
        assert ranges[0][0] == 0 and ranges[1][1] == ranges[2][0] and ranges[3][1] == 4
        refs, outs, after = run_and_kill(server, lambda h: h["nodes"][3][f"{victim}_pid"],
                                         max_tokens=64)
        assert outs == refs
        assert after["epoch"] == 2
        if victim == "worker":
            assert after["parallel"] == "tensor x2 > tensor x2 over ring"
            assert all(n["healthy"] for n in after["nodes"])
        else:
            assert after["parallel"] in ("tensor x2 > 1 node over ring",
                                         "1 node > tensor x2 over ring")
            assert [n["id"] for n in after["nodes"] if not n["alive"]] == ["local3"]
