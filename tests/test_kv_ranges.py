"""A stage's KV prefix cache across layer ranges (omlx_node.kv_cache): after a re-plan a stage
reuses the blocks its sibling ranges stored, and the ranges no cache uses any more are bounded.

Exactness is bit-for-bit, as in test_kv_tiers.py: a stage that restores its blocks from other
ranges' files gives the logits of a cold run of its layers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache
from prometheus_client import CollectorRegistry
from safetensors.numpy import load_file

from omlx_node.kv_cache import block_hashes, model_dir_name
from omlx_node.stage import StageRunner
from tests.helpers.kv import (
    BS,
    MODEL_ID,
    files,
    make_pc,
    metric,
    rand_tokens,
    synthetic_cache,
)


# ---- (a) reuse across a re-plan: blocks of sibling layer ranges --------------------------------


def layer_caches(layers: tuple[int, int], tokens: int, seed=0, dtype=mx.float32) -> list[KVCache]:
    """Synthetic KV whose values depend on the absolute layer, so ranges can be mixed."""
    return [synthetic_cache(1, tokens, seed * 100 + i, dtype)[0] for i in range(*layers)]


def write_range(ssd_dir: Path, layers: tuple[int, int], tokens: list[int], blocks=None, **kw):
    """Stores the first `blocks` blocks (all whole ones by default: no tail) of `tokens` for
    `layers`."""
    pc = make_pc(ssd_dir, layers=layers, **kw)
    kv = layer_caches(layers, len(tokens), dtype=getattr(mx, kw.get("dtype") or "float32"))
    n = (len(tokens) // BS if blocks is None else blocks) * BS
    pc.store(tokens[:n], kv)
    assert pc.flush()
    pc.close()
    return pc


def assert_kv_equal(kv: list[KVCache], layers: tuple[int, int], n: int, tokens: int,
                    dtype=mx.float32):
    ref = layer_caches(layers, tokens, dtype=dtype)
    assert [c.offset for c in kv] == [n] * len(ref)
    for a, b in zip(kv, ref):
        assert mx.array_equal(a.keys[..., : a.offset, :], b.keys[..., :n, :])
        assert mx.array_equal(a.values[..., : a.offset, :], b.values[..., :n, :])


@pytest.fixture(scope="module")
def stages(tiny_model_path):
    """StageRunners by layer range, loaded once."""
    cache: dict[tuple[int, int], StageRunner] = {}

    def get(a: int, b: int) -> StageRunner:
        if (a, b) not in cache:
            cache[(a, b)] = StageRunner(tiny_model_path, a, b)
        return cache[(a, b)]

    return get


@pytest.mark.parametrize("new_range", [(1, 3), (0, 4)])
def test_replan_reuses_blocks_of_sibling_ranges(tmp_path, stages, vocab, new_range):
    """Stages [0,2) and [2,4) cached some prompts; after a re-plan a stage for [1,3) (or [0,4))
    restores them from both directories and gets exactly what a cold run of its layers gives."""
    old = [make_pc(tmp_path, layers=r) for r in ((0, 2), (2, 4))]
    base = rand_tokens(120, vocab, seed=61)
    for p in (base[:60], base[:40] + rand_tokens(30, vocab, 62)):
        todo = p[:-1]
        runners = [stages(pc.layer_start, pc.layer_end) for pc in old]
        kvs = [r.make_cache() for r in runners]
        h = mx.array([todo])
        for r, kv in zip(runners, kvs):
            h = r(h, kv)
        mx.eval([c.state for kv in kvs for c in kv])
        for pc, kv in zip(old, kvs):
            pc.store(todo, kv)
    for pc in old:
        assert pc.flush()
        pc.close()
    sibling_files = {pc.dir.name: files(pc) for pc in old}
    # 3 + 2 blocks of the 2nd prompt, and a tail of each (siblings do not serve tails)
    assert [len(f) for f in sibling_files.values()] == [7, 7]

    a, b = new_range
    runner = stages(a, b)
    prompt = base[:70] + [9, 9]
    todo = prompt[:-1]
    if a == 0:  # token ids in; the last stage: logits out
        x, last = mx.array([todo]), mx.array([[prompt[-1]]])
    else:  # a middle stage: the hidden states of layer 0 in, hidden states out
        h0 = stages(0, 1)(mx.array([prompt]), stages(0, 1).make_cache())
        mx.eval(h0)
        x, last = h0[:, :-1], h0[:, -1:]
    ref = runner.make_cache()
    runner(x, ref)
    cold = runner(last, ref)[0, -1]

    registry = CollectorRegistry()
    pc = make_pc(tmp_path, layers=new_range, metrics_registry=registry)
    assert pc.stats().ssd_blocks == 0 and pc.stats().ssd_bytes == 0  # siblings are not ours
    assert pc.stats().sibling_files == 14
    assert pc.lookup(todo) == 48
    kv = pc.restore(todo, 48)
    assert len(kv) == b - a and kv[0].offset == 48
    runner(x[:, 48:], kv)
    mx.eval([c.state for c in kv])
    pc.store(todo, kv)  # block 3 and the tail are new: an ordinary store
    warm = runner(last, kv)[0, -1]
    assert mx.array_equal(warm, cold)
    assert metric(pc, "omlx_node_kv_cache_hits_total", tier="sibling") == 3
    assert metric(pc, "omlx_node_kv_cache_hits_total", tier="ssd") == 0
    assert pc.stats().hot_blocks == 5
    # Promoted: a second restore comes from RAM.
    assert pc.lookup(todo) == 64 + 7
    pc.restore(todo, 64)
    assert metric(pc, "omlx_node_kv_cache_hits_total", tier="ram") == 4
    assert pc.flush()
    pc.close()

    # The reused blocks became ordinary files of the new range; the siblings are untouched.
    assert {pc.dir.name: files(pc) for pc in old} == sibling_files
    mine = files(pc)
    assert len(mine) == 5 and pc.dir.name == f"{a}-{b}"  # 4 blocks and the tail
    tensors = load_file(str(mine[0]))
    assert sorted(tensors) == sorted(f"{kv}.{i}" for i in range(a, b) for kv in "kv")
    again = make_pc(tmp_path, layers=new_range)
    assert again.stats().ssd_blocks == 5 and again.lookup(todo) == 64 + 7
    kv = again.restore(todo, 64)
    assert kv[0].offset == 64
    assert metric(again, "omlx_node_kv_cache_hits_total", tier="ssd") == 4
    again.close()


def test_sibling_coverage_rules(tmp_path):
    tokens = list(range(4 * BS))
    write_range(tmp_path, (0, 2), tokens)  # 4 blocks of layers 0-1

    # [0, 3): layer 2 is nowhere: a miss. [1, 2) lies inside [0, 2): a hit.
    pc = make_pc(tmp_path, layers=(0, 3))
    assert pc.lookup(tokens) == 0
    assert pc.restore(tokens, len(tokens))[0].offset == 0
    pc.close()
    pc = make_pc(tmp_path, layers=(1, 2))
    assert pc.lookup(tokens) == 4 * BS
    assert_kv_equal(pc.restore(tokens, len(tokens)), (1, 2), 4 * BS, len(tokens))
    pc.close()

    # [0, 2) + [3, 4) leave a gap at layer 2: [1, 4) is a miss. Once [2, 3) holds the first
    # 2 blocks, three files cover [1, 4) for those 2 blocks, and the chain ends there.
    write_range(tmp_path, (3, 4), tokens)
    pc = make_pc(tmp_path, layers=(1, 4))
    assert pc.lookup(tokens) == 0
    pc.close()
    write_range(tmp_path, (2, 3), tokens, blocks=2)
    pc = make_pc(tmp_path, layers=(1, 4))
    assert pc.lookup(tokens) == 2 * BS
    assert_kv_equal(pc.restore(tokens, len(tokens)), (1, 4), 2 * BS, len(tokens))
    pc.close()

    # Blocks of another dtype do not mix: a bfloat16 stage finds nothing among float32 files.
    pc = make_pc(tmp_path, layers=(1, 2), dtype="bfloat16")
    assert pc.stats().sibling_files == 0 and pc.lookup(tokens) == 0
    pc.close()
    assert len(list(tmp_path.rglob("0-2/*/*.safetensors"))) == 4  # skipped, not removed

    # bfloat16 blocks are assembled bit-exact too.
    bf = tmp_path / "bf16"
    for r in ((0, 2), (2, 4)):
        write_range(bf, r, tokens, dtype="bfloat16")
    pc = make_pc(bf, layers=(1, 3), dtype="bfloat16")
    kv = pc.restore(tokens, pc.lookup(tokens))
    assert kv[0].keys.dtype == mx.bfloat16
    assert_kv_equal(kv, (1, 3), 4 * BS, len(tokens), dtype=mx.bfloat16)
    pc.close()

    # Another model's directory is not a sibling.
    pc = make_pc(tmp_path, layers=(1, 2), model_id="someone/else")
    assert pc.stats().sibling_files == 0
    pc.close()


def test_bad_sibling_files_are_a_miss_never_a_wrong_answer(tmp_path, caplog):
    tokens = list(range(4 * BS))
    names = block_hashes(MODEL_ID, tokens, BS)
    lo, hi, wide = (
        write_range(tmp_path, r, tokens) for r in ((0, 2), (2, 4), (0, 4))
    )
    # [0, 4)'s block 0 has a flipped tensor byte (its header is fine): the cover prefers that
    # file, finds it bad, removes it and falls back to [0, 2) + [2, 4).
    raw = bytearray(wide.block_path(names[0]).read_bytes())
    raw[-5] ^= 0xFF
    wide.block_path(names[0]).write_bytes(bytes(raw))
    # Block 1: [0, 4)'s copy is gone, [2, 4)'s is truncated (caught by the header check at
    # start-up and removed): [0, 2) alone does not cover [1, 3).
    wide.block_path(names[1]).unlink()
    hi.block_path(names[1]).write_bytes(hi.block_path(names[1]).read_bytes()[:-100])
    # Block 2 and 3 are intact.

    pc = make_pc(tmp_path, layers=(1, 3))
    assert not hi.block_path(names[1]).exists()
    assert metric(pc, "omlx_node_kv_cache_ssd_rejected_files_total", reason="truncated") == 1
    assert pc.lookup(tokens) == BS  # block 1 is not covered any more
    kv = pc.restore(tokens, len(tokens))
    assert_kv_equal(kv, (1, 3), BS, len(tokens))
    assert not wide.block_path(names[0]).exists()  # really corrupt: removed
    assert lo.block_path(names[0]).exists() and hi.block_path(names[0]).exists()
    assert metric(pc, "omlx_node_kv_cache_ssd_rejected_files_total", reason="corrupt") == 1
    assert any("removing corrupt" in r.getMessage() for r in caplog.records)
    assert pc.flush()
    pc.close()

    # A sibling file that vanishes after start-up (its owner evicted it) is simply a miss.
    other = tmp_path / "other"
    lo, hi = (write_range(other, r, tokens) for r in ((0, 2), (2, 4)))
    pc = make_pc(other, layers=(1, 3))
    assert pc.lookup(tokens) == 4 * BS
    hi.block_path(names[2]).unlink()
    kv = pc.restore(tokens, len(tokens))
    assert_kv_equal(kv, (1, 3), 2 * BS, len(tokens))
    assert pc.lookup(tokens) == 2 * BS
    pc.close()


def test_sibling_not_a_wrong_answer_after_restart_with_other_shapes(tmp_path):
    """Same model id, other KV shapes (the id was reused for other weights): once the stage
    knows its KV layout, sibling files of another layout are a miss, and are left alone."""
    tokens = list(range(2 * BS))
    odd = make_pc(tmp_path, layers=(0, 2))
    c = [KVCache() for _ in range(2)]
    for x in c:
        x.update_and_fetch(mx.zeros((1, 4, 2 * BS, 4)), mx.zeros((1, 4, 2 * BS, 4)))
    odd.store(tokens, c)
    odd.close()
    pc = make_pc(tmp_path, layers=(1, 2))
    assert pc.lookup(tokens) == 2 * BS  # shapes are unknown until the first store
    pc.store([7] * BS, layer_caches((1, 2), BS, seed=1))  # learns the (2, BS, 8) layout
    kv = pc.restore(tokens, 2 * BS)
    assert kv[0].offset == 0 and pc.lookup(tokens) == 0
    assert len(files(odd)) == 2
    pc.close()


# ---- (b) old ranges: bounded, and never one a running cache uses --------------------------------


def range_dirs(ssd_dir: Path) -> list[str]:
    return sorted(d.name for d in (ssd_dir / model_dir_name(MODEL_ID)).iterdir())


def test_old_ranges_beyond_the_cap_are_pruned_least_recently_used_first(tmp_path):
    tokens = rand_tokens(3 * BS + 1, 1000, seed=71)
    old = [write_range(tmp_path, r, tokens) for r in ((0, 1), (1, 2), (2, 3))]
    size = {pc.dir.name: sum(f.stat().st_size for f in files(pc)) for pc in old}
    now = time.time()
    for pc, age in zip(old, (300, 0, 100)):  # [1,2) used last, then [2,3), then [0,1)
        for f in files(pc):
            os.utime(f, (now - age, now - age))
    pc = make_pc(tmp_path, layers=(0, 4), ssd_max_bytes=size["1-2"] + size["2-3"])
    assert range_dirs(tmp_path) == ["0-4", "1-2", "2-3"]
    # The ranges kept are still siblings; without [0,1) they cannot cover layers 0-3...
    assert pc.stats().sibling_files == 6 and pc.lookup(tokens) == 0
    pc.close()
    pc = make_pc(tmp_path, layers=(1, 3))  # ...but they cover [1,3)
    assert pc.lookup(tokens) == 3 * BS
    pc.close()


def test_a_range_a_running_cache_holds_is_never_pruned(tmp_path):
    tokens = rand_tokens(2 * BS + 1, 1000, seed=72)
    write_range(tmp_path, (0, 2), tokens)
    live = make_pc(tmp_path, layers=(2, 4))
    live.store(tokens, layer_caches((2, 4), len(tokens)))
    assert live.flush()
    pc = make_pc(tmp_path, layers=(1, 3), ssd_max_bytes=1)  # every old range is over the cap
    assert range_dirs(tmp_path) == ["1-3", "2-4"]
    pc.close()
    live.close()
    pc = make_pc(tmp_path, layers=(0, 4), ssd_max_bytes=1)
    assert range_dirs(tmp_path) == ["0-4"]  # closed now: pruned; [1,3) was empty
    pc.close()


def test_other_models_and_versions_share_the_bound_of_old_ranges(tmp_path):
    """Directories of other models, or of this model's older weights (another fingerprint, so
    another model id), that no running cache holds count against the same bound: the least
    recently used go, a model directory left empty with them; a folder that no cache made is
    never touched (--paged-ssd-cache-dir may be a folder of the user's)."""
    tokens = rand_tokens(2 * BS + 1, 1000, seed=73)
    older = write_range(tmp_path, (0, 2), tokens, model_id="m-v1")
    other = write_range(tmp_path, (0, 2), tokens, model_id="other")
    older_size = sum(f.stat().st_size for f in files(older))
    now = time.time()
    for pc, age in ((older, 300), (other, 0)):
        for f in files(pc):
            os.utime(f, (now - age, now - age))
    mine = tmp_path / "photos.0123abcd" / "2019-2020"  # looks like ours, is not
    mine.mkdir(parents=True)
    (mine / "a.jpg").write_bytes(b"x")
    pc = make_pc(tmp_path, layers=(0, 2), model_id="m-v2", ssd_max_bytes=older_size)
    assert not older.dir.parent.exists()  # least recently used: gone, its model folder too
    assert len(files(other)) == 2 and (mine / "a.jpg").exists()
    pc.close()


def test_a_range_renamed_away_before_its_lock_is_made_again(tmp_path, monkeypatch):
    """A pruner that renames a range away between its cache making it and locking it (the
    cache then waited for the pruner's lock, or came just after it): the cache locks a fresh
    directory, keeps its SSD tier and is not pruned later."""
    from omlx_node.kv_cache import siblings

    real = siblings.lock_range
    moved: list[Path] = []

    def pruned_meanwhile(range_dir: Path, exclusive: bool):
        fd = real(range_dir, exclusive)
        if not exclusive and not moved:  # renamed while the cache waited for its lock
            moved.append(range_dir.rename(range_dir.parent / ".trash-test"))
        return fd

    monkeypatch.setattr(siblings, "lock_range", pruned_meanwhile)
    pc = make_pc(tmp_path, layers=(0, 2))
    monkeypatch.setattr(siblings, "lock_range", real)
    assert moved and pc.dir.is_dir()
    tokens = list(range(2 * BS))
    pc.store(tokens, synthetic_cache(2, 2 * BS, seed=1))
    assert pc.flush() and pc.stats().ssd_writable and len(files(pc)) == 2
    make_pc(tmp_path, layers=(2, 4), ssd_max_bytes=1).close()  # its lock keeps it
    assert len(files(pc)) == 2
    pc.close()


@pytest.mark.slow
def test_a_killed_stage_lets_go_of_its_range(tmp_path):
    script = (f"import sys, time; sys.path.insert(0, {str(Path(__file__).parent.parent)!r})\n"
              "from omlx_node.kv_cache import PrefixCache\n"
              f"pc = PrefixCache({MODEL_ID!r}, (2, 4), {BS}, ssd_dir=sys.argv[1])\n"
              "print('ready', flush=True)\n"
              "time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        make_pc(tmp_path, layers=(0, 2), ssd_max_bytes=1).close()
        assert range_dirs(tmp_path) == ["0-2", "2-4"]  # held by the running stage
    finally:
        proc.kill()
        proc.wait(10)
    make_pc(tmp_path, layers=(0, 2), ssd_max_bytes=1).close()
    assert range_dirs(tmp_path) == ["0-2"]  # the OS dropped its lock with it

