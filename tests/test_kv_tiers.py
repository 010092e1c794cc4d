"""The tiered KV prefix cache of one stage (omlx_node.kv_cache), on tiny random models.

Exactness is bit-for-bit: restoring cached blocks and prefilling the rest must give the same
logits as a cold prefill of the whole prompt. The full-disk and read-only tests mount small tmpfs
file systems (root only); they skip, saying why, where mounting is not allowed. Blocks across
layer ranges (a re-plan's siblings, old ranges) are test_kv_ranges.py's.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache
from prometheus_client import CollectorRegistry
from safetensors.numpy import load_file

from omlx_node.kv_cache import PrefixCache, block_hashes, model_dir_name
from omlx_node.stage import StageRunner
from tests.helpers import disks
from tests.helpers.disks import tmpfs_unavailable
from tests.helpers.kv import (
    BIG,
    BS,
    MODEL_ID,
    cached_logits,
    cold_logits,
    files,
    make_pc,
    metric,
    rand_tokens,
    synthetic_cache,
)

WARN_DEGRADED = "continuing with the RAM tier only"


# ---- fixtures and helpers ------------------------------------------------------------------


def degraded_warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if WARN_DEGRADED in r.getMessage()]


@contextmanager
def tmpfs(path: Path, size: str):
    """A tmpfs of `size` mounted at `path`; skips the test when mounting is not permitted."""
    if (why := tmpfs_unavailable()) is not None:
        pytest.skip(why)
    with disks.tmpfs(path, size) as mounted:
        yield mounted


def remount_ro(path: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True, capture_output=True)


def fill_disk(path: Path, leave: int) -> None:
    """Writes a filler file so that about `leave` bytes stay free."""
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    with open(path / "filler", "wb") as f:
        f.write(b"\0" * max(0, free - leave))


# ---- hashing -------------------------------------------------------------------------------


def test_block_hashes_chain_and_prefix_property():
    a = block_hashes("m", list(range(40)), 16)
    assert len(a) == 2 and all(len(h) == 64 for h in a)  # the partial third block is not hashed
    # A block's name depends on everything before it: same block tokens, other prefix, other name.
    b = block_hashes("m", [99] + list(range(1, 40)), 16)
    assert b[0] != a[0] and b[1] != a[1]
    assert block_hashes("m", list(range(32)) + [7] * 16, 16)[:2] == a
    assert block_hashes("other", list(range(40)), 16) != a
    assert block_hashes("m", list(range(15)), 16) == []
    assert model_dir_name("a/b") != model_dir_name("a--b")


# ---- (a) exactness ---------------------------------------------------------------------------


def test_restore_then_prefill_matches_cold_prefill(stage, vocab):
    registry = CollectorRegistry()
    pc = make_pc(None, metrics_registry=registry)
    base = rand_tokens(120, vocab, seed=1)
    prompts = [
        base[:70] + rand_tokens(9, vocab, 2),  # cold
        base[:70] + rand_tokens(30, vocab, 3),  # shares 4 blocks
        base[:100] + rand_tokens(3, vocab, 4),  # shares 4 blocks, then 2 of its own
        base[:48] + [5],  # prompt[:-1] is exactly 3 blocks: nothing left to prefill
        base[:8] + rand_tokens(20, vocab, 5),  # shares less than a block
        base[:101] + rand_tokens(3, vocab, 4),  # 6 blocks held
    ]
    restored = []
    for p in prompts:
        n, logits = cached_logits(pc, stage, p)
        restored.append(n)
        assert mx.array_equal(logits, cold_logits(stage, p)), f"prompt of {len(p)} tokens"
    assert restored == [0, 64, 64, 48, 0, 96]
    assert metric(pc, "omlx_node_kv_cache_hits_total", tier="ram") == 4 + 4 + 3 + 6
    assert metric(pc, "omlx_node_kv_cache_hits_total", tier="ssd") == 0
    assert metric(pc, "omlx_node_kv_cache_bytes", tier="ram") == pc.stats().hot_bytes > 0
    assert metric(pc, "omlx_node_kv_cache_restore_seconds_count") == 4


def test_decoding_on_a_restored_cache_matches(stage, vocab):
    """Greedy decoding past the restored prefix (the cache grows beyond what was restored)."""
    pc = make_pc(None)
    prompt = rand_tokens(70, vocab, seed=7)
    cached_logits(pc, stage, prompt)

    def greedy(kv, first_logits, steps=5):
        out, logits = [], first_logits
        for _ in range(steps):
            tok = int(mx.argmax(logits).item())
            out.append(tok)
            logits = stage(mx.array([[tok]]), kv)[0, -1]
        return out

    todo = prompt[:-1]
    ref = stage.make_cache()
    stage(mx.array([todo]), ref)
    want = greedy(ref, stage(mx.array([[prompt[-1]]]), ref)[0, -1])
    assert pc.lookup(todo) == len(todo)  # the whole blocks, then the tail the store kept
    for n in (64, len(todo)):  # the blocks alone (the rest prefilled), and with the tail
        kv = pc.restore(todo, n)
        assert kv[0].offset == n
        if n < len(todo):
            stage(mx.array([todo[n:]]), kv)
        assert greedy(kv, stage(mx.array([[prompt[-1]]]), kv)[0, -1]) == want


def test_a_turns_tail_is_reused_whole_or_not_at_all(tmp_path, stage, vocab):
    """An agent's turn ends mid-block: the next turn re-sends it and reuses it to its last token,
    from RAM and, after a restart, from SSD; a prompt that agrees with only part of a tail
    reuses the blocks before it, and of two tails the longest it goes on with."""
    base = rand_tokens(120, vocab, seed=81)
    cases = ((base[:60], 44), (base[:40] + [7, 7], 37), (base[:35] + [7] + base[36:60], 32))
    for i, (prompt, held) in enumerate(cases):
        for source in ("ram", "ssd"):
            pc = make_pc(tmp_path / f"{i}{source}")
            cached_logits(pc, stage, base[:38])  # 2 blocks and a 5-token tail: base[32:37]
            cached_logits(pc, stage, base[:45])  # and a 12-token tail: base[32:44]
            if source == "ssd":  # a new process: everything comes from the files
                assert pc.flush()
                pc.close()
                pc = make_pc(tmp_path / f"{i}{source}")
            hits = metric(pc, "omlx_node_kv_cache_hits_total", tier=source)
            n, logits = cached_logits(pc, stage, prompt)
            assert n == held, (source, i)
            assert mx.array_equal(logits, cold_logits(stage, prompt))
            # the blocks and the tail, from where they were
            assert metric(pc, "omlx_node_kv_cache_hits_total", tier=source) - hits == (
                -(-held // BS))
            pc.close()


def test_bfloat16_blocks_round_trip_bit_exact(tmp_path):
    pc = make_pc(tmp_path, layers=(0, 2), dtype="bfloat16")
    src = synthetic_cache(2, 40, seed=3, dtype=mx.bfloat16)
    tokens = list(range(40))
    pc.store(tokens, src)
    assert pc.flush()
    pc.close()
    pc = make_pc(tmp_path, layers=(0, 2), dtype="bfloat16")
    kv = pc.restore(tokens, pc.lookup(tokens))
    assert kv[0].offset == 40 and kv[0].keys.dtype == mx.bfloat16  # 2 blocks and the tail
    for a, b in zip(kv, src):
        # Up to the offset: the restored buffers have room to grow.
        assert mx.array_equal(a.keys[..., : a.offset, :], b.keys[..., :40, :])
        assert mx.array_equal(a.values[..., : a.offset, :], b.values[..., :40, :])
    # The files are plain safetensors: MLX reads them as bfloat16.
    loaded = [mx.load(str(f))["k.0"] for f in files(pc)]
    assert {a.dtype for a in loaded} == {mx.bfloat16}
    assert sorted(a.shape for a in loaded) == [(2, 8, 8), (2, BS, 8), (2, BS, 8)]
    # A float32 stage must not take them.
    pc32 = make_pc(tmp_path, layers=(0, 2), dtype="float32")
    assert pc32.lookup(tokens) == 0 and files(pc32) == []
    pc.close()
    pc32.close()


# ---- (b) restart -----------------------------------------------------------------------------


def test_blocks_survive_a_restart(tmp_path, stage, vocab):
    base = rand_tokens(90, vocab, seed=11)
    first = make_pc(tmp_path)
    cached_logits(first, stage, base[:81] + [3])
    assert first.flush()
    first.close()
    assert len(files(first)) == 6  # 5 blocks and the 1-token tail

    registry = CollectorRegistry()
    again = make_pc(tmp_path, metrics_registry=registry)  # a new process, an empty RAM tier
    assert again.stats().hot_blocks == 0 and again.stats().ssd_blocks == 6
    prompt = base[:85] + rand_tokens(4, vocab, 12)
    n, logits = cached_logits(again, stage, prompt)
    assert n == 81
    assert mx.array_equal(logits, cold_logits(stage, prompt))
    assert metric(again, "omlx_node_kv_cache_hits_total", tier="ssd") == 6
    # Loaded blocks were promoted: the next restore comes from RAM, with the tail the last
    # store kept (the whole of prompt[:-1]).
    n, _ = cached_logits(again, stage, prompt)
    assert n == len(prompt) - 1 and metric(again, "omlx_node_kv_cache_hits_total",
                                           tier="ram") == 6
    again.close()


def test_a_prefill_that_fills_the_buffer_exactly_reaches_the_ssd(tmp_path, stage, vocab):
    """256 tokens in one chunk fill mlx-lm's KV buffer exactly; its slices were not contiguous
    and the writer could not serialise them (the blocks never reached the disk)."""
    prompt = rand_tokens(257, vocab, seed=21)
    pc = make_pc(tmp_path)
    cached_logits(pc, stage, prompt)
    assert pc.flush()
    pc.close()
    assert len(files(pc)) == 256 // BS
    again = make_pc(tmp_path)
    n, logits = cached_logits(again, stage, prompt)
    assert n == 256 and mx.array_equal(logits, cold_logits(stage, prompt))
    again.close()


def test_recency_survives_a_restart(tmp_path):
    pc = make_pc(tmp_path, layers=(0, 2))
    prompts = [[i] * BS for i in range(3)]
    for i, p in enumerate(prompts):
        pc.store(p, synthetic_cache(2, BS, seed=i))
        assert pc.flush()
    time.sleep(0.01)
    assert pc.lookup(prompts[0]) == BS  # used: it becomes the most recent
    assert pc.flush()
    pc.close()
    order = make_pc(tmp_path, layers=(0, 2)).ssd_hashes()
    assert order == [block_hashes(MODEL_ID, p, BS)[0] for p in (prompts[1], prompts[2], prompts[0])]


# ---- (c) caps and LRU --------------------------------------------------------------------------


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_ram_blocks_hold_only_their_own_bytes(kv_heads):
    """Each block the RAM tier keeps owns a copy of its slice, also with one KV head (MLA
    models, Gemma 3 1B), where a block's slice is contiguous in the whole prompt's copy: a view
    would keep that copy alive, uncounted, for as long as any one block of it stays."""
    caches = []
    for j in range(4):
        c = KVCache()
        k = mx.random.normal((1, kv_heads, 4 * BS, 8), key=mx.random.key(j))
        c.update_and_fetch(k, k + 1)
        caches.append(c)
    mx.eval([c.state for c in caches])
    with make_pc(None) as pc:
        pc.store(list(range(4 * BS)), caches)
        pc.flush()
        arrays = [a for b in pc._ram.blocks.values() for a in b.keys + b.values]
        assert len(arrays) == 4 * 2 * 4
        assert all(a.base is None and a.flags.owndata for a in arrays)
        assert pc.stats().hot_bytes == sum(a.nbytes for a in arrays)


def test_ram_cap_and_lru_order():
    one = 2 * 2 * (2 * BS * 8 * 4)  # layers x (k, v) x a (2, BS, 8) float32 tensor
    pc = make_pc(None, layers=(0, 2), hot_max_bytes=3 * one + 100)
    prompts = [[i] * BS for i in range(6)]
    name = [block_hashes(MODEL_ID, p, BS)[0] for p in prompts]
    for i in range(4):
        pc.store(prompts[i], synthetic_cache(2, BS, seed=i))
        assert pc.stats().hot_bytes <= pc.hot_max_bytes
    assert pc.hot_hashes() == name[1:4]  # block 0 was the least recently used
    assert pc.lookup(prompts[1]) == BS  # touch 1: 2 is now the oldest
    pc.store(prompts[4], synthetic_cache(2, BS, seed=4))
    assert pc.hot_hashes() == [name[3], name[1], name[4]]
    pc.restore(prompts[3], BS)
    pc.store(prompts[5], synthetic_cache(2, BS, seed=5))
    assert pc.hot_hashes() == [name[4], name[3], name[5]]
    assert pc.stats().hot_bytes == 3 * one
    assert metric(pc, "omlx_node_kv_cache_evictions_total", tier="ram") == 3
    assert pc.lookup(prompts[0]) == 0 and pc.lookup(prompts[2]) == 0


def test_ssd_cap_and_lru_order(tmp_path):
    probe = make_pc(tmp_path / "probe", layers=(0, 2))
    probe.store([0] * BS, synthetic_cache(2, BS, seed=0))
    probe.close()
    size = files(probe)[0].stat().st_size

    pc = make_pc(tmp_path / "ssd", layers=(0, 2), hot_max_bytes=0, ssd_max_bytes=3 * size + 10)
    prompts = [[i] * BS for i in range(6)]
    name = [block_hashes(MODEL_ID, p, BS)[0] for p in prompts]

    def on_disk() -> int:
        return sum(f.stat().st_size for f in pc.dir.rglob("*") if f.is_file())

    for i in range(4):
        pc.store(prompts[i], synthetic_cache(2, BS, seed=i))
        assert pc.flush()
        assert on_disk() <= pc.ssd_max_bytes and pc.stats().ssd_bytes <= pc.ssd_max_bytes
    assert pc.stats().hot_blocks == 0  # a zero RAM cap: SSD only
    assert pc.ssd_hashes() == name[1:4]
    assert pc.lookup(prompts[1]) == BS
    pc.store(prompts[4], synthetic_cache(2, BS, seed=4))
    assert pc.flush()
    assert pc.ssd_hashes() == [name[3], name[1], name[4]]
    assert {f.stem for f in files(pc)} == {name[3], name[1], name[4]}
    assert on_disk() <= pc.ssd_max_bytes
    assert metric(pc, "omlx_node_kv_cache_evictions_total", tier="ssd") == 2
    # A restart with a smaller cap trims the oldest files.
    pc.close()
    small = make_pc(tmp_path / "ssd", layers=(0, 2), ssd_max_bytes=2 * size)
    assert small.ssd_hashes() == [name[1], name[4]] and len(files(small)) == 2
    small.close()


ONE_BLOCK = 2 * 2 * (2 * BS * 8 * 4)  # 2 layers x (k, v) x a (2, BS, 8) float32 tensor


def test_a_prompt_larger_than_the_ram_tier_keeps_its_first_blocks():
    """An agent's long prompt can outgrow --hot-cache-max-size: what stays is its prefix (a
    lookup reaches it), never its tail."""
    prompt = list(range(5 * BS))
    chain = block_hashes(MODEL_ID, prompt, BS)
    with make_pc(None, layers=(0, 2), hot_max_bytes=3 * ONE_BLOCK) as pc:
        pc.store(prompt, synthetic_cache(2, 5 * BS, seed=0))
        assert set(pc.hot_hashes()) == set(chain[:3])
        assert pc.lookup(prompt) == 3 * BS


def test_eviction_takes_a_chain_from_its_end():
    a, b = [1] * (3 * BS), [2] * (3 * BS)
    with make_pc(None, layers=(0, 2), hot_max_bytes=4 * ONE_BLOCK) as pc:
        pc.store(a, synthetic_cache(2, 3 * BS, seed=1))
        pc.store(b, synthetic_cache(2, 3 * BS, seed=2))
        assert set(pc.hot_hashes()) == {block_hashes(MODEL_ID, a, BS)[0],
                                        *block_hashes(MODEL_ID, b, BS)}
        assert pc.lookup(a) == BS and pc.lookup(b) == 3 * BS


def test_a_growing_conversation_keeps_its_start_over_its_newest_turn():
    """Turn 2 resends turn 1 and adds to it: the new blocks are the chain's end, the first to
    go, though they are the last stored."""
    turn1 = list(range(2 * BS))
    turn2 = turn1 + list(range(100, 100 + 2 * BS))
    with make_pc(None, layers=(0, 2), hot_max_bytes=3 * ONE_BLOCK) as pc:
        pc.store(turn1, synthetic_cache(2, 2 * BS, seed=3))
        assert pc.lookup(turn2) == 2 * BS
        kv = pc.restore(turn2, 2 * BS)
        assert kv[0].offset == 2 * BS
        pc.store(turn2, synthetic_cache(2, 4 * BS, seed=3))
        assert pc.hot_hashes()[-1] == block_hashes(MODEL_ID, turn1, BS)[0]  # the most recent
        assert pc.lookup(turn2) == 3 * BS


def test_blocks_promoted_from_ssd_keep_the_prefix_in_ram(tmp_path):
    prompt = list(range(4 * BS))
    chain = block_hashes(MODEL_ID, prompt, BS)
    with make_pc(tmp_path, layers=(0, 2), hot_max_bytes=2 * ONE_BLOCK) as pc:
        pc.store(prompt, synthetic_cache(2, 4 * BS, seed=4))
        assert pc.flush() and set(pc.hot_hashes()) == set(chain[:2])
        assert pc.restore(prompt, pc.lookup(prompt))[0].offset == 4 * BS  # 2 blocks from SSD
        assert metric(pc, "omlx_node_kv_cache_hits_total", tier="ssd") == 2
        assert set(pc.hot_hashes()) == set(chain[:2])


def test_a_prompt_larger_than_the_ssd_tier_keeps_its_first_blocks(tmp_path):
    prompt = list(range(5 * BS))
    chain = block_hashes(MODEL_ID, prompt, BS)
    probe = make_pc(tmp_path / "probe", layers=(0, 2))
    probe.store(prompt, synthetic_cache(2, 5 * BS, seed=5))
    probe.close()
    size = {f.stem: f.stat().st_size for f in files(probe)}
    first = [size[h] for h in chain]
    pc = make_pc(tmp_path / "ssd", layers=(0, 2), hot_max_bytes=0,
                 ssd_max_bytes=sum(first[:3]) + 10)
    pc.store(prompt, synthetic_cache(2, 5 * BS, seed=5))
    assert pc.flush()
    assert pc.lookup(prompt) == 3 * BS
    pc.close()
    again = make_pc(tmp_path / "ssd", layers=(0, 2), hot_max_bytes=0,
                    ssd_max_bytes=sum(first[:2]))
    assert set(again.ssd_hashes()) == set(chain[:2])  # mtime keeps the order over a restart
    again.close()


# ---- (d) bad files -----------------------------------------------------------------------------


def _write_blocks(ssd_dir: Path, tokens: list[int], layers=(0, 2), seed=0, **kw) -> PrefixCache:
    pc = make_pc(ssd_dir, layers=layers, **kw)
    pc.store(tokens, synthetic_cache(layers[1] - layers[0], len(tokens), seed=seed))
    assert pc.flush()
    pc.close()
    return pc


def test_corrupt_truncated_and_garbage_files_are_removed(tmp_path, caplog):
    tokens = list(range(4 * BS))
    names = block_hashes(MODEL_ID, tokens, BS)
    pc = _write_blocks(tmp_path, tokens)
    paths = [pc.block_path(h) for h in names]

    # Block 3: header damaged (a metadata byte flipped): caught when indexing.
    raw = bytearray(paths[3].read_bytes())
    at = raw.index(b'"model_id":"') + len(b'"model_id":"')
    raw[at] ^= 0x01
    paths[3].write_bytes(bytes(raw))
    # Block 2: truncated, as a crash without the atomic rename would leave it.
    paths[2].write_bytes(paths[2].read_bytes()[:-100])
    # Block 1: one tensor byte flipped: the header is fine, the sha256 is not.
    raw = bytearray(paths[1].read_bytes())
    raw[-5] ^= 0xFF
    paths[1].write_bytes(bytes(raw))
    # Garbage under a block name, a stale temp file, a young one, a file that is not ours.
    junk = pc.dir / "ab" / ("ab" + "0" * 62 + ".safetensors")
    junk.parent.mkdir(exist_ok=True)
    junk.write_bytes(os.urandom(300))
    stale = paths[0].parent / ".x.1.abc.tmp"
    stale.write_bytes(b"half")
    os.utime(stale, (time.time() - 3600,) * 2)
    young = paths[0].parent / ".y.1.abc.tmp"
    young.write_bytes(b"half")
    notes = pc.dir / "ab" / "README"
    notes.write_text("hello")

    pc = make_pc(tmp_path, layers=(0, 2))
    assert not paths[3].exists() and not paths[2].exists() and not junk.exists()
    assert not stale.exists() and young.exists() and notes.exists()
    assert pc.ssd_hashes() == names[:2]
    assert metric(pc, "omlx_node_kv_cache_ssd_rejected_files_total", reason="truncated") == 1
    assert metric(pc, "omlx_node_kv_cache_ssd_rejected_files_total", reason="foreign") == 1
    assert metric(pc, "omlx_node_kv_cache_ssd_rejected_files_total", reason="corrupt") == 1

    # Block 1 looks fine until loaded; the restore stops before it and removes it.
    assert pc.lookup(tokens) == 2 * BS
    kv = pc.restore(tokens, 2 * BS)
    assert kv[0].offset == BS and not paths[1].exists()
    src = synthetic_cache(2, len(tokens), seed=0)
    assert mx.array_equal(kv[1].values[..., : kv[1].offset, :], src[1].values[..., :BS, :])
    assert pc.lookup(tokens) == BS
    assert metric(pc, "omlx_node_kv_cache_ssd_rejected_files_total", reason="corrupt") == 2
    assert any("removing" in r.getMessage() for r in caplog.records)
    pc.close()


def _rewrite_header(path: Path, change) -> None:
    """`path` with its header JSON replaced by `change(header)`'s, the tensor data kept."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = change(json.loads(raw[8 : 8 + n]))
    text = header.encode() if isinstance(header, str) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def test_headers_of_any_other_json_shape_are_removed_never_fatal(tmp_path):
    """JSON that parses but is not the format's (a tensor entry that is a string, a list for
    the dtype, nesting deeper than the parser goes) is a corrupt file: removed when the cache
    starts, and a miss when it turns up after indexing, never a worker that cannot start or a
    failed step."""
    tokens = list(range(4 * BS))
    names = block_hashes(MODEL_ID, tokens, BS)
    pc = _write_blocks(tmp_path, tokens)
    paths = [pc.block_path(h) for h in names]
    _rewrite_header(paths[3], lambda h: {**h, "k.0": "x"})
    _rewrite_header(paths[2], lambda h: {**h, "__metadata__": {**h["__metadata__"],
                                                               "dtype": ["F32"]}})
    _rewrite_header(paths[1], lambda h: "[" * 5000 + "]" * 5000)
    pc = make_pc(tmp_path, layers=(0, 2))
    assert pc.ssd_hashes() == names[:1] and not any(p.exists() for p in paths[1:])
    assert metric(pc, "omlx_node_kv_cache_ssd_rejected_files_total", reason="corrupt") == 3
    # Block 0 indexed, then its header changed under the running cache.
    _rewrite_header(paths[0], lambda h: {**h, "v.1": ["x"]})
    assert pc.lookup(tokens) == BS
    assert pc.restore(tokens, BS)[0].offset == 0 and not paths[0].exists()
    pc.close()


def test_foreign_files_are_removed(tmp_path):
    tokens = list(range(2 * BS))
    ours = block_hashes(MODEL_ID, tokens, BS)
    other_model = _write_blocks(tmp_path / "x", tokens, model_id="someone/else")
    other_layers = _write_blocks(tmp_path / "y", tokens, layers=(2, 4))
    target = make_pc(tmp_path / "ssd", layers=(0, 2))
    target.close()
    # Planted under the names our lookups ask for, as a mixed-up copy would leave them.
    for h_ours, src in [
        (ours[0], other_model.block_path(block_hashes("someone/else", tokens, BS)[0])),
        (ours[1], other_layers.block_path(ours[1])),
    ]:
        dst = target.block_path(h_ours)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, dst)
    pc = make_pc(tmp_path / "ssd", layers=(0, 2))
    assert pc.ssd_hashes() == [] and files(pc) == []
    assert pc.lookup(tokens) == 0
    assert metric(pc, "omlx_node_kv_cache_ssd_rejected_files_total", reason="foreign") == 2
    pc.close()


def test_shape_mismatch_is_removed_on_load(tmp_path):
    """Same model id and layers, other KV shapes (the id was reused for other weights): the file
    is consistent on its own, and rejected once the cache knows this stage's KV shapes."""
    tokens = list(range(BS))
    odd = make_pc(tmp_path / "odd", layers=(0, 2))
    c = [KVCache() for _ in range(2)]
    for x in c:
        x.update_and_fetch(mx.zeros((1, 4, BS, 4)), mx.zeros((1, 4, BS, 4)))
    odd.store(tokens, c)
    odd.close()
    pc = make_pc(tmp_path / "ssd", layers=(0, 2))
    pc.store([7] * BS, synthetic_cache(2, BS, seed=1))  # learns the (2, BS, 8) layout
    pc.flush()
    dst = pc.block_path(block_hashes(MODEL_ID, tokens, BS)[0])
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(odd.block_path(block_hashes(MODEL_ID, tokens, BS)[0]), dst)
    pc.close()
    pc = make_pc(tmp_path / "ssd", layers=(0, 2))  # indexes it: nothing wrong on its own
    assert pc.lookup(tokens) == BS
    pc.store([8] * BS, synthetic_cache(2, BS, seed=2))
    kv = pc.restore(tokens, BS)
    assert kv[0].offset == 0 and kv[0].keys is None
    assert not dst.exists() and pc.lookup(tokens) == 0
    pc.close()


# ---- (e) full and read-only disks ------------------------------------------------------------


def test_full_disk_degrades_to_ram_only(tmp_path, stage, vocab, caplog, monkeypatch):
    with tmpfs(tmp_path / "mnt", "512k") as mnt:
        fill_disk(mnt, leave=24 * 1024)  # room for one 16 KiB block file, not two
        # The free-space guard would stop the writes before the disk fills; make it see plenty
        # of room (as when another process fills the disk between its check and the write).
        real_usage = shutil.disk_usage
        monkeypatch.setattr(
            shutil, "disk_usage", lambda p: real_usage(p)._replace(free=1 << 40, total=1 << 41)
        )
        pc = make_pc(mnt, ssd_min_free_bytes=0)
        caplog.set_level(logging.WARNING, logger="omlx_node.kv_cache")
        base = rand_tokens(100, vocab, seed=21)
        prompts = [base[:70] + [1, 2], base[:90] + [3], base[:40] + rand_tokens(40, vocab, 22)]
        for p in prompts:
            _, logits = cached_logits(pc, stage, p)
            assert pc.flush()
            assert mx.array_equal(logits, cold_logits(stage, p))
        assert not pc.stats().ssd_writable
        assert len(degraded_warnings(caplog)) == 1
        assert "No space left" in degraded_warnings(caplog)[0].getMessage()
        assert list(mnt.rglob("*.tmp")) == []  # the failed write cleaned up after itself
        # 7 blocks and 3 tails; base[:90]'s tail after its 5 blocks is found
        assert pc.stats().hot_blocks == 10 and pc.lookup(base[:99]) == 90
        assert metric(pc, "omlx_node_kv_cache_ssd_writes_total", result="error") == 1
        assert metric(pc, "omlx_node_kv_cache_ssd_writes_total", result="disabled") > 0
        assert metric(pc, "omlx_node_kv_cache_ssd_writable") == 0
        pc.close()


def test_low_space_guard_skips_writes(tmp_path, stage, vocab, caplog):
    with tmpfs(tmp_path / "mnt", "512k") as mnt:
        pc = make_pc(mnt)  # default reserve max(1 GiB, 5 %): more than this disk has
        caplog.set_level(logging.WARNING, logger="omlx_node.kv_cache")
        for seed in (31, 32):
            p = rand_tokens(50, vocab, seed)
            _, logits = cached_logits(pc, stage, p)
            assert pc.flush()
            assert mx.array_equal(logits, cold_logits(stage, p))
        assert files(pc) == [] and pc.stats().ssd_writable  # skipped, not broken
        assert len([r for r in caplog.records if "skipping SSD writes" in r.getMessage()]) == 1
        # 3 blocks and a tail of each prompt
        assert metric(pc, "omlx_node_kv_cache_ssd_writes_total", result="low_space") == 8
        pc.close()


def test_a_disk_filled_by_others_makes_room_from_the_oldest_blocks(tmp_path, caplog):
    """Other files leave the cache less than its cap: its oldest blocks make room for its
    newest (the reserve kept), rather than its content freezing at what it held when the disk
    filled up."""
    reserve = 64 * 1024
    with tmpfs(tmp_path / "mnt", "1m") as mnt:
        fill_disk(mnt, leave=reserve + 160 * 1024)  # a dozen block files or so, not 40
        pc = make_pc(mnt, layers=(0, 2), hot_max_bytes=0, ssd_min_free_bytes=reserve)
        caplog.set_level(logging.WARNING, logger="omlx_node.kv_cache")
        prompts = [[1000 * k + i for i in range(4 * BS)] for k in range(10)]
        for k, p in enumerate(prompts):
            pc.store(p, synthetic_cache(2, 4 * BS, seed=k))
            assert pc.flush()
        assert pc.lookup(prompts[-1]) == 4 * BS and pc.lookup(prompts[0]) == 0
        assert metric(pc, "omlx_node_kv_cache_ssd_writes_total", result="low_space") == 0
        assert metric(pc, "omlx_node_kv_cache_ssd_writes_total", result="ok") == 40
        assert shutil.disk_usage(mnt).free >= reserve
        assert not [r for r in caplog.records if "skipping SSD writes" in r.getMessage()]
        pc.close()


def test_read_only_dir_degrades_to_ram_only(tmp_path, stage, vocab, caplog):
    with tmpfs(tmp_path / "mnt", "4m") as mnt:
        base = rand_tokens(100, vocab, seed=41)
        # The guard's reserve off: this small disk is what the test has, not a full one.
        first = make_pc(mnt, ssd_min_free_bytes=0)
        cached_logits(first, stage, base[:50])  # 3 blocks and a 1-token tail on disk
        first.close()
        remount_ro(mnt)
        caplog.set_level(logging.WARNING, logger="omlx_node.kv_cache")

        pc = make_pc(mnt, ssd_min_free_bytes=0)
        assert pc.stats().ssd_blocks == 4  # the blocks already there are still read
        for p in (base[:90] + [4], base[:95] + [5, 6]):
            n, logits = cached_logits(pc, stage, p)
            assert pc.flush()
            assert n >= 48 and mx.array_equal(logits, cold_logits(stage, p))
        assert not pc.stats().ssd_writable
        assert len(degraded_warnings(caplog)) == 1
        assert "Read-only" in degraded_warnings(caplog)[0].getMessage()
        pc.close()

        # A cache dir that cannot even be created: RAM-only from the start.
        caplog.clear()
        pc = make_pc(mnt / "new", ssd_min_free_bytes=0)
        p = base[:60]
        cached_logits(pc, stage, p)
        n, logits = cached_logits(pc, stage, p)
        assert n == 59 and mx.array_equal(logits, cold_logits(stage, p))  # 3 blocks, a tail
        assert not pc.stats().ssd_writable and len(degraded_warnings(caplog)) == 1
        pc.close()


# ---- (f) store() stays off the disk ----------------------------------------------------------

_AUDIT: dict = {"on": False, "events": []}
_AUDITED = {"open", "os.rename", "os.remove", "os.mkdir", "os.utime", "os.truncate", "os.chmod"}


def _audit(event: str, args: tuple) -> None:
    if _AUDIT["on"] and event in _AUDITED:
        _AUDIT["events"].append((threading.get_ident(), event, str(args[0]) if args else ""))


def test_store_does_no_disk_io_on_the_calling_thread(tmp_path, monkeypatch):
    if not _AUDIT.get("installed"):
        sys.addaudithook(_audit)  # audit hooks cannot be removed: this one is gated by "on"
        _AUDIT["installed"] = True
    real_fsync, disk_free = os.fsync, threading.Event()

    def stuck_fsync(fd: int) -> None:  # a disk that hangs until the test lets it go
        disk_free.wait(timeout=10)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", stuck_fsync)
    pc = make_pc(tmp_path, layers=(0, 2))
    tokens = list(range(8 * BS))
    caches = synthetic_cache(2, len(tokens), seed=5)
    _AUDIT["events"].clear()
    _AUDIT["on"] = True
    try:
        pc.store(tokens, caches)  # returns although the writer is stuck in its first fsync
        assert pc.lookup(tokens) == len(tokens)
        kv = pc.restore(tokens, len(tokens))
        caller = [e for e in _AUDIT["events"] if e[0] == threading.get_ident()]
        assert files(pc) == [] and pc.stats().ssd_blocks == 0
        disk_free.set()
        assert pc.flush(timeout=20)
    finally:
        disk_free.set()
        _AUDIT["on"] = False
    assert caller == []
    assert kv[0].offset == len(tokens)
    writer = [e for e in _AUDIT["events"] if e[0] != threading.get_ident()]
    assert sum(1 for e in writer if e[1] == "os.rename") == 8  # temp file -> block, atomically
    assert len(files(pc)) == 8
    pc.close()


# ---- (g) a middle stage ------------------------------------------------------------------------


def test_middle_stage_caches_only_its_layers(tmp_path, tiny_model_path, stage, vocab):
    stages = [StageRunner(tiny_model_path, a, b) for a, b in ((0, 1), (1, 3), (3, 4))]
    caches = [make_pc(tmp_path, layers=(s.info.layer_start, s.info.layer_end)) for s in stages]

    def run(prompt: list[int]) -> tuple[int, mx.array]:
        """A three-stage pipeline; every stage restores the prefix all of them hold."""
        todo = prompt[:-1]
        n = min(pc.lookup(todo) for pc in caches)
        kvs = [pc.restore(todo, n) for pc in caches]
        assert all(kv[0].offset == n for kv in kvs)
        if n < len(todo):
            h = mx.array([todo[n:]])
            for s, kv in zip(stages, kvs):
                h = s(h, kv)
            mx.eval([c.state for kv in kvs for c in kv])
        for pc, kv in zip(caches, kvs):
            pc.store(todo, kv)
        h = mx.array([[prompt[-1]]])
        for s, kv in zip(stages, kvs):
            h = s(h, kv)
        return n, h[0, -1]

    base = rand_tokens(80, vocab, seed=51)
    run(base[:60])
    prompt = base[:70] + [9, 9]
    n, logits = run(prompt)
    assert n == 59  # 3 blocks, and the first prompt's tail: base[48:59]
    assert mx.array_equal(logits, cold_logits(stage, prompt))

    middle = caches[1]
    assert middle.dir.name == "1-3" and middle.dir.parent.name == model_dir_name(MODEL_ID)
    assert len(middle.restore(prompt[:-1], 48)) == 2
    for pc in caches:
        assert pc.flush()
    f = next(f for f in files(middle) if mx.load(str(f))["k.1"].shape[1] == BS)  # not a tail
    tensors = mx.load(str(f))
    assert sorted(tensors) == ["k.1", "k.2", "v.1", "v.2"]
    # The reference safetensors reader agrees.
    assert {k: v.shape for k, v in load_file(str(f)).items()} == {
        k: tuple(v.shape) for k, v in tensors.items()
    }
    n_kv_heads, head_dim = 2, 64 // 4
    assert tensors["k.1"].shape == (n_kv_heads, BS, head_dim)
    header = json.loads(f.read_bytes()[8 : 8 + struct.unpack("<Q", f.read_bytes()[:8])[0]])
    meta = header["__metadata__"]
    assert (meta["model_id"], meta["layer_start"], meta["layer_end"]) == (MODEL_ID, "1", "3")
    assert meta["block_size"] == str(BS) and meta["dtype"] == stage.info.dtype
    with pytest.raises(ValueError, match="expected 2 layer caches"):
        middle.store(prompt, stage.make_cache())
    for pc in caches:
        pc.close()


# ---- (h) blocks of other shapes on disk after a restart ------------------------------------


def test_a_block_of_other_shapes_on_disk_is_a_miss_before_any_store(tmp_path, tiny_model_path,
                                                                      stage, vocab):
    """A worker knows its blocks' shapes from its first forward pass: a block on disk under
    the same model, layers and dtype but of other shapes (an mlx-lm that kept the family's KV
    otherwise wrote it) is a miss for the first request after a restart, which gets mlx-lm's
    answer, not a failed step."""
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    from omlx_node.batcher import Batcher
    from omlx_node.metrics import NodeMetrics
    from omlx_node.sequence import SeqRequest
    from omlx_node.worker import make_prefix_cache, weights_fingerprint
    from omlx_node.worker_config import WorkerConfig
    from omlx_shared.engine_config import EngineConfig

    config = WorkerConfig(model_path=tiny_model_path, model_id="tiny", layer_start=0,
                          layer_end=None,
                          engine=EngineConfig(cache_block_size=BS, hot_cache_bytes=BIG,
                                              ssd_cache_dir=str(tmp_path), ssd_cache_bytes=BIG,
                                              device_cache_bytes=0))
    prompt = rand_tokens(3 * BS + 1, vocab, seed=11)
    odd = PrefixCache(f"tiny@{weights_fingerprint(tiny_model_path)}", (0, stage.info.num_layers),
                      BS, ssd_dir=tmp_path, dtype=stage.info.dtype)
    c = [KVCache() for _ in range(stage.info.num_layers)]
    for x in c:
        x.update_and_fetch(mx.zeros((1, 3, 3 * BS, 5)), mx.zeros((1, 3, 3 * BS, 5)))
    odd.store(prompt, c)
    assert odd.flush() and len(files(odd)) == 3
    odd.close()

    cache = make_prefix_cache(config, stage, NodeMetrics())
    batcher = Batcher(stage, NodeMetrics(), prefill_chunk=64, prefix_cache=cache)
    seq = batcher.submit(SeqRequest("after-restart", prompt, 6))
    while not batcher.idle:
        batcher.step()
    events = []
    while not seq.events.empty():
        events.append(seq.events.get_nowait())
    model, _ = load(str(tiny_model_path))
    assert events[:-1] == [int(t) for t, _ in generate_step(mx.array(prompt), model,
                                                             max_tokens=6)]
    assert events[-1].reason == "length" and seq.cached == 0
    cache.close()
