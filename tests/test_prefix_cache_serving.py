"""The tiered prefix KV cache inside the serving path: single node, restarts, pipelines."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import httpx
import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from tests.conftest import start_server
from tests.tiny_models import build_model

pytestmark = pytest.mark.slow

BLOCK = 16
FLAGS = ("--cache-block-size", str(BLOCK), "--prefill-chunk", "24")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("kv") / "tiny-kv", "llama", num_layers=4, seed=3)


@pytest.fixture(scope="module")
def prompts(model) -> list[list[int]]:
    """Prompts sharing long prefixes (several blocks), as agents resending a context do."""
    _, tok = load(str(model))
    system = tok.encode("You are a helpful assistant. " * 12)
    return [system + tok.encode(q) for q in
            ["What is the capital of France?", "Hello there", "def add(a, b):", "x"]] + [
        system[:40], system[:BLOCK * 2 + 1]]


@pytest.fixture(scope="module")
def references(model, prompts) -> list[list[int]]:
    ref_model, _ = load(str(model))
    out = [[int(t) for t, _ in generate_step(mx.array(p), ref_model, max_tokens=12)]
           for p in prompts]
    mx.synchronize()
    # Varied outputs, so a wrong KV would show as different tokens.
    assert len({t for ref in out for t in ref}) > 8
    return out


def complete(url: str, model_id: str, ids: list[int], max_tokens: int = 12
             ) -> tuple[list[int], int]:
    """Greedy completion of token ids: (completion token ids via the text, cached tokens)."""
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": model_id, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})
    r.raise_for_status()
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def check_all(server, prompts, references, tok, concurrent: bool = False) -> list[int]:
    results: list = [None] * len(prompts)

    def one(i: int) -> None:
        results[i] = complete(server.url, server.model_id, prompts[i])

    if concurrent:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
    else:
        for i in range(len(prompts)):
            one(i)
    for (text, _), ref in zip(results, references):
        assert text == tok.decode(ref)
    return [cached for _, cached in results]


def kv_files(home: Path, layers: str) -> list[Path]:
    return list(home.glob(f"kv-cache/*/{layers}/*/*.safetensors"))


def test_single_node_hits_ram_then_ssd_after_restart(model, prompts, references, tmp_path):
    _, tok = load(str(model))
    home = tmp_path / "home"
    with start_server(model, *FLAGS, home=home, keepalive=None, node_metrics=True) as server:
        first = check_all(server, prompts, references, tok)
        assert first[0] == 0  # a cold start computes everything
        assert all(c % BLOCK == 0 for c in first)
        again = check_all(server, prompts, references, tok, concurrent=True)
        for ids, cached in zip(prompts, again):  # all of prompt[:-1]: blocks and tail
            assert cached == len(ids) - 1
        metrics = server.node_metrics()
        assert metrics['omlx_node_kv_cache_hits_total{tier="ram"}'] > 0
    assert kv_files(home, "0-4"), "nothing reached the SSD tier"

    with start_server(model, *FLAGS, home=home, keepalive=None, node_metrics=True) as server:
        after = check_all(server, prompts, references, tok)
        assert after == again  # every block came back from disk
        assert server.node_metrics()['omlx_node_kv_cache_hits_total{tier="ssd"}'] > 0


def test_device_tier_serves_every_hit_when_it_is_on(model, prompts, references, tmp_path):
    """`--device-cache-max-size` (auto-sized on a CUDA GPU, off on a CPU) through the whole
    serving path: the same answers, every reused block from the device (tails from RAM)."""
    _, tok = load(str(model))
    with start_server(model, *FLAGS, "--device-cache-max-size", "64MiB", home=tmp_path / "h",
                      keepalive=None, node_metrics=True) as server:
        check_all(server, prompts, references, tok)
        again = check_all(server, prompts, references, tok, concurrent=True)
        for ids, cached in zip(prompts, again):
            assert cached == len(ids) - 1
        metrics = server.node_metrics()
        assert metrics['omlx_node_kv_cache_hits_total{tier="device"}'] > 0
        # Only the tails come from RAM (they stay on the host).
        assert metrics['omlx_node_kv_cache_hits_total{tier="ram"}'] == sum(
            (len(ids) - 1) % BLOCK > 0 for ids in prompts)
        assert metrics['omlx_node_kv_cache_bytes{tier="device"}'] > 0


def test_cache_off_and_on_give_identical_outputs(model, prompts, references, tmp_path):
    _, tok = load(str(model))
    with start_server(model, *FLAGS, "--hot-cache-max-size", "0", home=tmp_path / "h",
                      keepalive=None) as server:
        assert check_all(server, prompts, references, tok, concurrent=True) == [0] * len(prompts)
        assert check_all(server, prompts, references, tok) == [0] * len(prompts)
    assert not (tmp_path / "h" / "kv-cache").exists()


def test_two_stage_pipeline_hits_on_both_stages(model, prompts, references, tmp_path):
    _, tok = load(str(model))
    home = tmp_path / "home"
    flags = (*FLAGS, "--nodes", "2", "--split", "1,3")
    with start_server(model, *flags, home=home, keepalive=None) as server:
        check_all(server, prompts, references, tok)
        again = check_all(server, prompts, references, tok, concurrent=True)
        assert again[0] == len(prompts[0]) - 1
    assert kv_files(home, "0-1") and kv_files(home, "1-4")

    # Stage 1 loses its blocks: the usable prefix is what *every* stage holds, so the first
    # request reuses nothing (stage 0 still has it all) and the answers stay right.
    shutil.rmtree(kv_files(home, "1-4")[0].parent.parent)
    with start_server(model, *flags, home=home, keepalive=None) as server:
        cached = check_all(server, prompts, references, tok)
        assert cached[0] == 0 and cached[1] > 0  # the first request stored them again


def test_a_queued_burst_on_a_cached_prompt_holds_few_restored_copies(model, tmp_path,
                                                                     monkeypatch):
    """Agent turns queue up behind a full batch, all resending one long cached prompt: a
    pipeline's stages hold the restored KV of only the few that may start next, not one copy
    per queued request (which grows without bound with the queue), and every answer is still
    mlx-lm's. (And the workers leave no scratch files of their group behind.)"""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    ref_model, tok = load(str(model))
    system = tok.encode("You are a coding agent working in a large repository. " * 30)
    burst = [system + tok.encode(f" Task {i}: fix bug number {i}.") for i in range(12)]
    refs = [tok.decode([int(t) for t, _ in generate_step(mx.array(p), ref_model,
                                                           max_tokens=12)]) for p in burst]
    mx.synchronize()
    flags = (*FLAGS, "--nodes", "2", "--split", "1,3", "--max-batch", "1",
             "--max-queue", "16")  # all 12 queue: the test is about what they hold
    with start_server(model, *flags, home=tmp_path / "home", keepalive=None,
                      node_metrics=True) as server:
        used = 'omlx_node_kv_cache_used_bytes'
        highest = [0.0]
        done = threading.Event()

        def watch() -> None:  # the head stage's KV, sampled while the requests run
            while not done.wait(0.02):
                highest[0] = max(highest[0], server.node_metrics().get(used, 0.0))

        assert complete(server.url, server.model_id, burst[0])[0] == refs[0]
        watcher = threading.Thread(target=watch)
        watcher.start()
        # One request on the cached prompt, restored and decoding: long enough for the watcher
        # to see it (a 12-token one, its whole prompt cached, can end between two samples).
        assert complete(server.url, server.model_id, burst[0], 48)[1] > len(system) // 2
        alone = highest[0]
        results: list = [None] * len(burst)

        def one(i: int) -> None:
            results[i] = complete(server.url, server.model_id, burst[i])

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(burst))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        done.set()
        watcher.join(10)
    assert [text for text, _ in results] == refs
    assert sum(cached > 0 for _, cached in results) >= len(burst) - 1
    # One running and up to LOOKUP_AHEAD (2) queued ones hold the prompt; were every queued
    # request looked up at once, that would be 12 copies.
    assert 0 < alone and highest[0] <= 4 * alone, (highest[0], alone)
    assert not list(scratch.glob("omlx-group-*"))
