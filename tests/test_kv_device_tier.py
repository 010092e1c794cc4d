"""The prefix cache's device tier (omlx_node/kv_cache/device_tier.py): the latest prompts' blocks
kept on the device, restored without waiting for or copying from host memory.

Here on a CPU the tier is turned on explicitly (its default is off where host and device share
memory); exactness is bit-for-bit against a cold prefill, as for the other tiers."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest

import omlx_node.kv_cache.host_copy as host_copy
from omlx_node.kv_cache import device_tier
from omlx_node.kv_cache.blocks import Block
from tests.helpers.kv import (
    BS,
    cached_logits,
    cold_logits,
    make_pc,
    metric,
    rand_tokens,
    synthetic_cache,
)

HITS = "omlx_node_kv_cache_hits_total"


def cut_bytes(stage, tokens: int) -> int:
    """What the device tier holds for `tokens` tokens (whole blocks) of the stage's layers."""
    kv = stage.make_cache()
    stage(mx.array([[1] * tokens]), kv)
    return sum(c.keys[..., :tokens, :].nbytes + c.values[..., :tokens, :].nbytes for c in kv)


def test_a_device_hit_gives_the_cold_prefills_logits(stage, vocab):
    prompt = rand_tokens(5 * BS + 3, vocab, seed=1)
    with make_pc(None, device_max_bytes=1 << 30) as pc:
        cached_logits(pc, stage, prompt)
        longer = prompt + rand_tokens(2 * BS, vocab, seed=2)  # the agent's next turn
        done, logits = cached_logits(pc, stage, longer)
        assert done == 5 * BS + 2  # and the first turn's tail, from RAM (tails stay on the host)
        assert metric(pc, HITS, tier="device") == 5
        assert metric(pc, HITS, tier="ram") == 1
        assert mx.array_equal(logits, cold_logits(stage, longer)).item()
        assert metric(pc, "omlx_node_kv_cache_blocks", tier="device") == 7


def test_a_device_hit_does_not_wait_for_the_host_copy(stage, vocab, monkeypatch):
    """Agents send the next turn as soon as the last one ends: the RAM copy of its blocks may
    still be on its way (on a GPU, most of a second for 8192 tokens of an 8B model)."""
    release = threading.Event()
    copy = host_copy.host_blocks

    def slow_copy(*a):
        release.wait(30)
        return copy(*a)

    monkeypatch.setattr(host_copy, "host_blocks", slow_copy)
    prompt = rand_tokens(4 * BS + 1, vocab, seed=3)
    with make_pc(None, device_max_bytes=1 << 30) as pc:
        cached_logits(pc, stage, prompt)
        waited = threading.Event()  # MLX runs on this thread: a watchdog ends a wait instead
        watchdog = threading.Timer(10, lambda: (waited.set(), release.set()))
        watchdog.start()
        try:
            done, logits = cached_logits(pc, stage, prompt)
        finally:
            watchdog.cancel()
            release.set()
        assert not waited.is_set(), "the restore waited for the host copy"
        assert done == 4 * BS
        assert mx.array_equal(logits, cold_logits(stage, prompt)).item()


def test_whole_cuts_are_evicted_and_ram_fills_in(stage, vocab):
    """Room for one prompt's cut: the older prompt comes back from RAM, and a prompt that
    extends it restores from both tiers at once, still exactly."""
    a = rand_tokens(3 * BS + 1, vocab, seed=4)
    b = rand_tokens(3 * BS + 1, vocab, seed=5)
    with make_pc(None, device_max_bytes=cut_bytes(stage, 3 * BS)) as pc:
        cached_logits(pc, stage, a)
        cached_logits(pc, stage, b)
        assert metric(pc, "omlx_node_kv_cache_evictions_total", tier="device") == 3
        assert metric(pc, "omlx_node_kv_cache_blocks", tier="device") == 3  # b's

        longer = a + rand_tokens(2 * BS, vocab, seed=6)
        done, logits = cached_logits(pc, stage, longer)  # a from RAM; its new blocks kept
        assert (done, metric(pc, HITS, tier="ram")) == (3 * BS, 3)
        assert mx.array_equal(logits, cold_logits(stage, longer)).item()

        again = longer + rand_tokens(BS, vocab, seed=7)
        done, logits = cached_logits(pc, stage, again)  # 3 blocks from RAM, then 2 from device
        assert done == 5 * BS
        assert metric(pc, HITS, tier="ram") == 6
        assert metric(pc, HITS, tier="device") == 2
        assert mx.array_equal(logits, cold_logits(stage, again)).item()


def test_a_conversations_first_cut_outlives_its_newest(stage, vocab):
    """A cut stored by a later turn is the chain's end: another prompt evicts it, not the cut
    every turn of the conversation starts with."""
    a = rand_tokens(3 * BS + 1, vocab, seed=12)
    longer = a[:-1] + rand_tokens(2 * BS + 1, vocab, seed=13)
    with make_pc(None, device_max_bytes=cut_bytes(stage, 5 * BS)) as pc:
        cached_logits(pc, stage, a)
        cached_logits(pc, stage, longer)
        cached_logits(pc, stage, rand_tokens(2 * BS + 1, vocab, seed=14))
        assert metric(pc, "omlx_node_kv_cache_blocks", tier="device") == 5  # a's 3, the new 2
        done, logits = cached_logits(pc, stage, longer)
        assert done == 5 * BS
        assert metric(pc, HITS, tier="device") == 3 + 3  # the second turn's, then a's again
        assert metric(pc, HITS, tier="ram") == 2
        assert mx.array_equal(logits, cold_logits(stage, longer)).item()


def test_bfloat16_blocks_come_back_bit_for_bit():
    kv = synthetic_cache(4, 3 * BS, seed=8, dtype=mx.bfloat16)
    tokens = list(range(3 * BS))
    with make_pc(None, device_max_bytes=1 << 30, hot_max_bytes=0) as pc:
        pc.store(tokens, kv)
        restored = pc.restore(tokens, pc.lookup(tokens))
        assert metric(pc, HITS, tier="device") == 3
        for c, r in zip(kv, restored):
            assert r.keys.dtype == mx.bfloat16 and r.offset == 3 * BS
            assert mx.array_equal(c.keys[..., : 3 * BS, :], r.keys[..., : 3 * BS, :]).item()
            assert mx.array_equal(c.values[..., : 3 * BS, :], r.values[..., : 3 * BS, :]).item()


@pytest.mark.parametrize("copy_in_flight", [False, True])
def test_a_layout_change_drops_the_device_blocks(copy_in_flight, monkeypatch):
    """Also when the old layout's host copy is still on its way at the change (a busy
    machine): the copy is dropped as it lands, and no lookup counts it meanwhile."""
    release = threading.Event()
    copy = host_copy.host_blocks

    def held_copy(*a):
        release.wait(30)
        return copy(*a)

    if copy_in_flight:
        monkeypatch.setattr(host_copy, "host_blocks", held_copy)
    else:
        release.set()
    with make_pc(None, device_max_bytes=1 << 30) as pc:
        try:
            pc.store(list(range(2 * BS)), synthetic_cache(4, 2 * BS, seed=9))
            assert pc.lookup(list(range(2 * BS))) == 2 * BS
            pc.store(list(range(100, 100 + 2 * BS)),
                     synthetic_cache(4, 2 * BS, seed=10, dtype=mx.float16))
            assert metric(pc, "omlx_node_kv_cache_blocks", tier="device") == 2  # the new's
            assert pc.lookup(list(range(2 * BS))) == 0
        finally:
            release.set()
        pc.flush()
        assert pc.lookup(list(range(2 * BS))) == 0
        assert pc.lookup(list(range(100, 100 + 2 * BS))) == 2 * BS


def test_the_tier_is_sized_for_the_device(monkeypatch):
    assert device_tier.default_max_bytes() == 0  # this CPU shares its memory with itself
    cuda = type("Cuda", (), {"is_available": staticmethod(lambda: True)})
    monkeypatch.setattr(mx, "cuda", cuda, raising=False)
    for total, want in ((24 << 30, (24 << 30) // 16), (141 << 30, 8 << 30)):
        monkeypatch.setattr(mx, "device_info", lambda total=total: {"total_memory": total})
        assert device_tier.default_max_bytes() == want


def test_a_cut_larger_than_the_tier_is_not_kept(stage, vocab):
    prompt = rand_tokens(4 * BS + 1, vocab, seed=11)
    with make_pc(None, device_max_bytes=cut_bytes(stage, BS)) as pc:
        done, _ = cached_logits(pc, stage, prompt)
        assert metric(pc, "omlx_node_kv_cache_blocks", tier="device") == 0
        done, logits = cached_logits(pc, stage, prompt)
        assert done == 4 * BS and metric(pc, HITS, tier="ram") == 4
        assert mx.array_equal(logits, cold_logits(stage, prompt)).item()


@pytest.mark.parametrize("dtype", [np.float32, np.uint16])
def test_host_blocks_alone_keep_one_copy_per_layer(dtype):
    """Without device spans a restore is the RAM tier's single copy, as before the tier."""
    from omlx_node.kv_cache.blocks import BY_NAME, build_caches

    dt = BY_NAME["float32" if dtype is np.float32 else "bfloat16"]
    rng = np.random.default_rng(0)
    blocks = [Block(f"{i}", "", dt, [rng.integers(0, 999, (2, BS, 8)).astype(dtype)],
                    [rng.integers(0, 999, (2, BS, 8)).astype(dtype)]) for i in range(3)]
    (c,) = build_caches(blocks, 1, BS)
    assert c.offset == 3 * BS and c.keys.dtype == dt.mx
    host = np.concatenate([b.keys[0] for b in blocks], axis=1)
    got = c.keys[0, :, : 3 * BS]
    got = np.array(got.view(mx.uint16) if dtype is np.uint16 else got)
    assert np.array_equal(got, host)
