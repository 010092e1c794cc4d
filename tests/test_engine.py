"""Stage runner and continuous batcher against mlx-lm's own model code and generation."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load

from omlx_node.batcher import Batcher
from omlx_node.kv_cache import PrefixCache
from omlx_node.metrics import NodeMetrics
from omlx_node.sampling import SamplingParams
from omlx_node.sequence import Finish, SeqRequest
from omlx_node.stage import StageError, StageRunner
from tests.helpers.engine import drain, reference
from tests.tiny_models import build_model

PROMPTS = [
    "The capital of France is",
    "Hello",
    "x",
    "def add(a, b):\n    return",
    "A pipeline splits the layers of a model across several machines. " * 6,
]


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2", "qwen3"])
def family_model(request, tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp(request.param), request.param, num_layers=4)


def test_stage_split_matches_whole_model(family_model):
    model, tok = load(str(family_model))
    ids = mx.array([tok.encode("The capital of France is")])
    ref = model(ids)
    whole = StageRunner(family_model)
    a, b = StageRunner(family_model, 0, 1), StageRunner(family_model, 1, 4)
    assert mx.array_equal(whole(ids, whole.make_cache()), ref)
    assert mx.array_equal(b(a(ids, a.make_cache()), b.make_cache()), ref)
    assert a.embed_tokens is not None and a.norm is None
    assert b.norm is not None and len(b.layers) == 3


@pytest.mark.parametrize("chunk", [5, 512])  # one prompt per chunk; all admitted together
def test_greedy_batched_matches_mlx_lm(family_model, chunk):
    model, tok = load(str(family_model))
    n = 16
    prompts = [tok.encode(p) for p in PROMPTS]
    refs = [reference(model, p, n) for p in prompts]
    batcher = Batcher(StageRunner(family_model), NodeMetrics(), prefill_chunk=chunk)
    seqs = [batcher.submit(SeqRequest(str(i), p, n)) for i, p in enumerate(prompts)]
    for (toks, fin), ref in zip(drain(batcher, seqs), refs):
        assert toks == ref
        assert fin.reason == "length"


def test_late_joiners_and_alone_match(tmp_path):
    """Sequences admitted while others decode, or alone, give the same greedy tokens."""
    path = build_model(tmp_path / "m", "llama", num_layers=3)
    model, tok = load(str(path))
    batcher = Batcher(StageRunner(path), NodeMetrics(), prefill_chunk=3)
    prompts = [tok.encode(p) for p in PROMPTS]
    first = batcher.submit(SeqRequest("first", prompts[4], 24))
    for _ in range(30):  # let it prefill and decode a while before others arrive
        batcher.step()
    late = [batcher.submit(SeqRequest(f"late{i}", p, 10)) for i, p in enumerate(prompts[:4])]
    results = drain(batcher, [first, *late])
    assert results[0][0] == reference(model, prompts[4], 24)
    for (toks, _), p in zip(results[1:], prompts[:4]):
        assert toks == reference(model, p, 10)


def test_a_lone_prompts_first_token_waits_for_no_build_but_its_own(tmp_path, monkeypatch):
    """A prompt's last chunk is left computing while its first step is built (nothing waits
    for the device in between), and its first token is streamed before the step after it is
    built: the same tokens as mlx-lm, every chunk still timed."""
    path = build_model(tmp_path / "m", "llama", num_layers=3)
    model, tok = load(str(path))
    prompt = tok.encode(PROMPTS[4])
    metrics = NodeMetrics()
    batcher = Batcher(StageRunner(path), metrics, prefill_chunk=8)
    seq = batcher.submit(SeqRequest("alone", prompt, 6))
    log: list[tuple] = []
    state, forward, prefill = batcher.state, batcher.state.forward, batcher.state.prefill
    monkeypatch.setattr(state, "forward", lambda mb, x: (
        log.append(("step", seq.events.qsize())), forward(mb, x))[1])
    monkeypatch.setattr(state, "prefill", lambda sid, x, wait=True: (
        log.append(("chunk", wait)), prefill(sid, x, wait), log.append(("built",)))[1])
    for name in ("eval", "synchronize"):
        monkeypatch.setattr(mx, name, lambda *a, _real=getattr(mx, name), _name=name: (
            log.append((_name,)), _real(*a))[1])
    toks, _ = drain(batcher, [seq])[0]
    monkeypatch.undo()
    assert toks == reference(model, prompt, 6)
    chunks = -(-(len(prompt) - 1) // 8)
    assert [e[1] for e in log if e[0] == "chunk"] == [True] * (chunks - 1) + [False]
    built = log.index(("built",), log.index(("chunk", False)))
    assert log[built + 1:log.index(("step", 0))] == [], "the first step waited for the last chunk"
    steps = [e[1] for e in log if e[0] == "step"]
    assert steps[:2] == [0, 1], "the first token waited for the step after it to be built"
    assert metrics.registry.get_sample_value(
        "omlx_node_stage_compute_seconds_count", {"kind": "prefill"}) == chunks


def test_stop_tokens_cancel_and_errors(tmp_path):
    path = build_model(tmp_path / "m", "qwen2", num_layers=2)
    model, tok = load(str(path))
    ids = tok.encode("Hello world")
    ref = reference(model, ids, 12)
    stop_at = ref[5]
    metrics = NodeMetrics()
    batcher = Batcher(StageRunner(path), metrics)
    stopped = batcher.submit(SeqRequest("s", ids, 12, stop_token_ids=frozenset({stop_at})))
    cancelled = batcher.submit(SeqRequest("c", ids, 1000))
    waiting = batcher.submit(SeqRequest("w", ids, 5))
    batcher.cancel("w")  # cancelled while still queued
    for _ in range(6):
        batcher.step()
    batcher.cancel("c")
    (s_toks, s_fin), (c_toks, c_fin), (w_toks, w_fin) = drain(batcher, [stopped, cancelled, waiting])
    assert s_toks == ref[: ref.index(stop_at)] and s_fin.reason == "stop"
    assert c_fin.reason == "cancelled" and len(c_toks) < 20
    assert w_toks == [] and w_fin.reason == "cancelled"
    assert batcher.running == 0  # KV released:
    assert not batcher.state.caches and not batcher.state.prefilling
    for bad, msg in [
        (SeqRequest("e", [], 4), "empty"),
        (SeqRequest("e", ids, 0), "max_tokens"),
        (SeqRequest("e", [10**6], 4), "vocabulary"),
        (SeqRequest("e", ids, 5000), "context"),
    ]:
        with pytest.raises(ValueError, match=msg):
            batcher.submit(bad)


def test_seeded_sampling_is_reproducible_and_independent_of_batch(tmp_path):
    path = build_model(tmp_path / "m", "llama", num_layers=2)
    _, tok = load(str(path))
    ids = tok.encode("The capital of France is")
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    batcher = Batcher(StageRunner(path), NodeMetrics())
    alone = drain(batcher, [batcher.submit(SeqRequest("a", ids, 20, params))])[0][0]
    crowd = [batcher.submit(SeqRequest(f"o{i}", tok.encode(p), 20,
                                       SamplingParams(temperature=0.8, seed=i)))
             for i, p in enumerate(PROMPTS)]
    again = batcher.submit(SeqRequest("b", ids, 20, params))
    results = drain(batcher, [*crowd, again])
    assert results[-1][0] == alone
    other = drain(batcher, [batcher.submit(
        SeqRequest("c", ids, 20, SamplingParams(temperature=1.0, seed=99)))])[0][0]
    assert other != alone


def test_quantized_model_runs_dequantized_on_cpu(tmp_path):
    path = build_model(tmp_path / "q", "llama", num_layers=2, quantize_bits=4)
    model, tok = load(str(path))  # mlx-lm keeps it quantized
    ids = tok.encode("Hello world")
    stage = StageRunner(path)
    assert stage.info.dtype == "float32"
    ours = stage(mx.array([ids]), stage.make_cache())
    ref = model(mx.array([ids]))
    assert mx.allclose(ours, ref.astype(mx.float32), atol=1e-3, rtol=1e-3)


def test_unsupported_family_and_range(tmp_path):
    path = build_model(tmp_path / "m", "llama", num_layers=2)
    config = (path / "config.json").read_text()
    (path / "config.json").write_text(config.replace('"model_type": "llama"', '"model_type": "gpt2"'))
    with pytest.raises(StageError, match="cannot load this 'gpt2' model"):
        StageRunner(path)
    (path / "config.json").write_text(config)
    with pytest.raises(StageError, match=r"\[1, 5\)"):
        StageRunner(path, 1, 5)


@pytest.mark.slow
def test_the_engine_gives_freed_buffers_back_to_the_device(tmp_path):
    """MLX keeps freed buffers for reuse and never returns them unasked: a long prompt's chunks
    and a finished request's KV would stay held on a device another model's worker shares.
    Chunk by chunk, and once no sequence runs, the engine empties MLX's cache, and its greedy
    tokens are still mlx-lm's."""
    path = build_model(tmp_path, "llama", num_layers=4)
    model, _ = load(str(path))
    prompt = [(7 * i) % 200 + 3 for i in range(1500)]
    ref = reference(model, prompt, 6)
    batcher = Batcher(StageRunner(path), NodeMetrics(), prefill_chunk=256)
    mx.clear_cache()
    peaks = []
    seq = batcher.submit(SeqRequest("long", prompt, 6))
    while not batcher.idle:
        batcher.step()
        peaks.append(mx.get_cache_memory())
    [(tokens, finish)] = drain(batcher, [seq])
    assert tokens == ref and finish.reason == "length"
    # A chunk's activations (its attention scores over the prompt so far) are many times the
    # prompt's KV (4 layers, float32 keys and values); no two steps in a row keep that much
    # cached: the last chunk, left computing while the first step is built, gives its back at
    # the next step.
    a = model.args
    kv = 4 * 2 * 1500 * a.num_key_value_heads * (a.hidden_size // a.num_attention_heads) * 4
    high = [c >= 2 * kv for c in peaks]
    assert any(high) and not any(x and y for x, y in zip(high, high[1:])), (peaks, kv)
    assert mx.get_cache_memory() == 0  # idle: nothing held back


def test_idle_engine_lets_go_of_the_device_copies_of_stored_blocks(tmp_path):
    """The prefix cache copies a prompt's blocks to the host on a thread of its own, from device
    arrays the engine keeps until the copy is done. Once the engine is idle those go too: a
    node between requests holds no device memory for the last prompt (on a GPU, gigabytes for
    a long one), and the blocks stay in the cache."""
    path = build_model(tmp_path / "m", "llama", num_layers=3)
    cache = PrefixCache("m", (0, 3), block_size=16, hot_max_bytes=1 << 30)
    batcher = Batcher(StageRunner(path), NodeMetrics(), prefill_chunk=512, prefix_cache=cache)
    mx.synchronize()
    mx.clear_cache()
    baseline = mx.get_active_memory()
    prompt = [11 + (i * 7) % 300 for i in range(2000)]
    [(tokens, finish)] = drain(batcher, [batcher.submit(SeqRequest("a", prompt, 3))])
    assert len(tokens) == 3 and finish.reason == "length"
    batcher.step()  # an idle iteration, as the engine's loop runs between requests
    assert mx.get_active_memory() - baseline < 64 << 10, mx.get_active_memory() - baseline
    # Its 125 whole blocks are kept: the last one was completed by its answer's first tokens.
    assert cache.lookup(prompt) == 2000
    cache.close()


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])  # stores deferred, and at once
def test_a_failed_prefix_cache_store_costs_no_request(tmp_path, family):
    """Keeping a prompt's blocks can fail (a device allocation for the cut, say): that prompt
    is simply not cached; neither it nor the requests in its batch fail, and their tokens are
    mlx-lm's."""
    path = build_model(tmp_path / family, family, num_layers=3)
    model, _ = load(str(path))
    cache = PrefixCache("m", (0, 3), block_size=4, hot_max_bytes=1 << 30)
    store = cache.store

    def failing_store(tokens, kv) -> None:
        if tokens[:2] == [99, 98]:
            raise RuntimeError("[malloc] Unable to allocate 1073741824 bytes")
        store(tokens, kv)

    cache.store = failing_store
    batcher = Batcher(StageRunner(path), NodeMetrics(), prefill_chunk=64, prefix_cache=cache)
    prompts = [[20 + i for i in range(20)], [99, 98] + [30 + i for i in range(20)]]
    seqs = [batcher.submit(SeqRequest(str(i), p, 5)) for i, p in enumerate(prompts)]
    for (tokens, finish), p in zip(drain(batcher, seqs), prompts):
        assert (tokens, finish.reason) == (reference(model, p, 5), "length")
    # Whole blocks and the prompt's tail; with plain caches its answer completed the last
    # block (a sliding window keeps no answers: StageState.keep_answers).
    assert cache.lookup(prompts[0]) == (20 if family == "llama" else 19)
    assert cache.lookup(prompts[1]) == 0
    cache.close()


def test_a_request_that_arrives_as_the_engine_stops_is_aborted(tmp_path):
    """A request that reached the engine during its last step ends "aborted" like the running
    ones (the gateway runs it again elsewhere), never without an end."""
    path = build_model(tmp_path, "llama", num_layers=2)
    batcher = Batcher(StageRunner(path), NodeMetrics())
    running = batcher.submit(SeqRequest("running", [5, 6, 7], 1000))
    batcher.step()
    late = batcher.submit(SeqRequest("late", [8, 9], 10))
    batcher.stop()
    batcher.run()
    for seq in (running, late):
        events = []
        while not seq.events.empty():
            events.append(seq.events.get_nowait())
        assert isinstance(events[-1], Finish) and events[-1].reason == "aborted", events
