"""A prompt's prefix-cache store waits for its first token (on a GPU the copy to host memory
slows the steps that compute that token) and for the step after it (while that token streams),
unless a prompt that starts alike needs it first; a sequence that ends without one keeps what it
prefilled and leaves nothing behind."""

from __future__ import annotations

from mlx_lm import load

from omlx_node.batcher import Batcher
from omlx_node.kv_cache import PrefixCache
from omlx_node.metrics import NodeMetrics
from omlx_node.sequence import SeqRequest
from omlx_node.stage import StageRunner
from tests.helpers.engine import drain, engine, reference
from tests.tiny_models import build_model

BLOCK = 4


def step_until(batcher: Batcher, done, limit: int = 200) -> None:
    for _ in range(limit):
        if done():
            return
        batcher.step()
    raise AssertionError("the engine did not get there")


def test_blocks_are_kept_a_step_after_the_first_token(tmp_path):
    """Not while the first token is being streamed: cutting and copying the blocks holds the
    GIL that the streaming thread needs."""
    path = build_model(tmp_path / "m", "llama", num_layers=3)
    model, _ = load(str(path))
    prompt = [(5 * j + 11) % (model.args.vocab_size - 10) + 10 for j in range(14)]
    ref = reference(model, prompt, 6)
    with PrefixCache("tiny/llama", (0, 3), block_size=BLOCK) as cache:
        batcher = engine(path, cache)
        assert batcher.state.defer_stores
        seq = batcher.submit(SeqRequest("a", prompt, 6))
        step_until(batcher, lambda: seq in batcher.running_seqs())
        # Prefilled and decoding, no token out yet: nothing is kept so far.
        assert seq.generated == 0
        assert cache.lookup(prompt[:-1]) == 0
        step_until(batcher, lambda: seq.generated >= 1)
        assert cache.lookup(prompt[:-1]) == 0
        step_until(batcher, lambda: seq.generated >= 2)
        assert cache.lookup(prompt[:-1]) == 13  # three whole blocks and the 1-token tail
        assert drain(batcher, [seq])[0][0] == ref
        again = batcher.submit(SeqRequest("again", prompt, 6))
        assert drain(batcher, [again])[0][0] == ref
        assert again.cached == 13


def test_a_prompt_that_starts_alike_finds_the_blocks_still_waiting(tmp_path):
    """Agents often send the same long system prompt at once: the second must not prefill it
    again because the first has no token yet."""
    path = build_model(tmp_path / "m", "llama", num_layers=3)
    model, _ = load(str(path))
    vocab = model.args.vocab_size
    shared = [(5 * j + 11) % (vocab - 10) + 10 for j in range(12)]
    first, second = shared + [21, 22], shared + [31, 32, 33, 34, 35]
    with PrefixCache("tiny/llama", (0, 3), block_size=BLOCK) as cache:
        batcher = engine(path, cache)
        a = batcher.submit(SeqRequest("a", first, 4))
        step_until(batcher, lambda: a in batcher.running_seqs())
        assert a.generated == 0
        b = batcher.submit(SeqRequest("b", second, 4))
        results = drain(batcher, [a, b])
        assert b.cached == 12
        assert [r[0] for r in results] == [reference(model, first, 4), reference(model, second, 4)]


def test_a_first_token_that_stops_still_keeps_the_prompt(tmp_path):
    path = build_model(tmp_path / "m", "llama", num_layers=3)
    model, _ = load(str(path))
    prompt = [(7 * j + 3) % (model.args.vocab_size - 10) + 10 for j in range(14)]
    stop = reference(model, prompt, 1)[0]
    with PrefixCache("tiny/llama", (0, 3), block_size=BLOCK) as cache:
        batcher = engine(path, cache)
        seq = batcher.submit(SeqRequest("a", prompt, 6, stop_token_ids=frozenset({stop})))
        toks, fin = drain(batcher, [seq])[0]
        assert toks == [] and fin.reason == "stop"
        assert cache.lookup(prompt[:-1]) == 13  # whole blocks and the tail


def test_a_one_token_answer_is_out_before_its_prompt_is_kept(tmp_path):
    """max_tokens 1 (a classifier's prompt, a probe): the token and the end of the stream go
    out first; cutting the prompt's blocks for the cache waits for them."""
    path = build_model(tmp_path / "m", "llama", num_layers=3)
    model, _ = load(str(path))
    prompt = [(5 * j + 11) % (model.args.vocab_size - 10) + 10 for j in range(14)]
    with PrefixCache("tiny/llama", (0, 3), block_size=BLOCK) as cache:
        batcher = engine(path, cache)
        seq = batcher.submit(SeqRequest("a", prompt, 1))
        seen = []
        flush = batcher.state.flush_stores

        def watched(seq_ids: list[int]) -> None:
            if seq.sid in seq_ids and seq.sid in batcher.state.deferred:
                seen.append(list(seq.events.queue))
            flush(seq_ids)

        batcher.state.flush_stores = watched
        toks, fin = drain(batcher, [seq])[0]
        assert toks == reference(model, prompt, 1) and fin.reason == "length"
        assert len(seen) == 1 and seen[0][-1] == fin  # the Finish was queued before the store
        assert cache.lookup(prompt[:-1]) == 13


def test_a_sequence_cancelled_while_prefilling_keeps_what_it_prefilled(tmp_path):
    path = build_model(tmp_path / "m", "llama", num_layers=3)
    prompt = list(range(10, 30))
    with PrefixCache("tiny/llama", (0, 3), block_size=BLOCK) as cache:
        # Chunks of 8 tokens: the prompt is cut while its first blocks are done.
        batcher = engine(path, cache, 8)
        seq = batcher.submit(SeqRequest("a", prompt, 6))
        step_until(batcher, lambda: seq.prefilled >= 8)
        assert seq not in batcher.running_seqs()
        batcher.cancel("a")
        _, fin = drain(batcher, [seq])[0]
        assert fin.reason == "cancelled"
        assert batcher.state.deferred == {}
        assert cache.lookup(prompt[:-1]) >= 8


def test_a_sequence_cancelled_before_its_first_token_is_kept_and_holds_nothing(tmp_path):
    path = build_model(tmp_path / "m", "llama", num_layers=3)
    prompt = list(range(10, 30))
    with PrefixCache("tiny/llama", (0, 3), block_size=BLOCK) as cache:
        batcher = engine(path, cache)
        seq = batcher.submit(SeqRequest("a", prompt, 6))
        step_until(batcher, lambda: seq in batcher.running_seqs())
        assert batcher.state.deferred
        batcher.cancel("a")
        _, fin = drain(batcher, [seq])[0]
        assert fin.reason == "cancelled"
        assert batcher.state.deferred == {}  # nothing left behind
        assert cache.lookup(prompt[:-1]) == 19  # what it prefilled is kept, the tail too


def test_a_sliding_window_family_stores_as_its_prefill_goes(tmp_path):
    # Its windows may drop blocks before the first token: the store cannot wait.
    path = build_model(tmp_path / "m", "gemma3_text", num_layers=3)
    with PrefixCache("tiny/gemma3", (0, 3), block_size=BLOCK) as cache:
        batcher = engine(path, cache)
        assert not batcher.state.defer_stores


def test_a_later_stage_keeps_a_prompt_once_a_decode_step_has_run_it(tmp_path):
    """A pipeline's later stage never sees tokens: its stores wait for the sequence's admission
    to a micro-batch (the decode step that runs it), then go to the cache."""
    import mlx.core as mx

    from omlx_node.stage_state import StageState

    path = build_model(tmp_path / "m", "llama", num_layers=3)
    prompt = list(range(10, 23))
    with PrefixCache("tiny/llama", (0, 3), block_size=BLOCK) as cache:
        state = StageState(StageRunner(path), NodeMetrics().profile, cache, defer_stores=True)
        waiting = StageState(StageRunner(path), NodeMetrics().profile, cache, defer_stores=True)
        for s in (state, waiting):
            assert s.lookup(1, prompt[:-1]) == 0
            s.prefill(1, mx.array([prompt[:-1]]))
        state.update(0, None, [1])
        waiting.flush_admitted()  # prefilled, not admitted: it waits
        assert cache.lookup(prompt[:-1]) == 0
        state.flush_admitted()
        assert state.deferred == {} and cache.lookup(prompt[:-1]) == 12
        assert list(waiting.deferred) == [1]
