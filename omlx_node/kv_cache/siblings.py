"""The other layer-range directories of a model: blocks reused from them, and their bound.

Sibling ranges. Files live under `<ssd_dir>/<model dir>/<start>-<end>/`, one directory per layer
range, and name their tensors by absolute layer (k.{layer}, v.{layer}). After a re-plan moves
layers (a node died or joined) a stage's new range differs from the one its files were written
for, and other local stages (`serve --nodes N` on one ssd_dir) hold other ranges of the same
model. So a cache for [a, b) also indexes, at start-up and from headers only, the files of every
other range directory of its model directory that overlaps [a, b): its *siblings*. A block is
held when the cache's own tiers hold it, or when, for every layer of [a, b), some sibling file of
that block (all of one dtype) holds that layer: a union of ranges such as [0, 2) + [2, 4) covers
[1, 3). `restore` then reads from each chosen file just the layers it needs (the read streams
through the whole file to check its sha256, as for an own file, but keeps only those layers),
assembles the block for [a, b), promotes it to the RAM tier and queues it for the writer, which
makes it an ordinary block file of this range. Sibling hits are counted as
`hits{tier="sibling"}` (not as "ssd"), so a dashboard can tell reuse across a re-plan apart.

The sibling index is read-only: sibling files are never evicted, touched or counted against this
cache's byte cap (they belong to the cache of their own range, which may be running in another
process). A sibling file that vanished since start-up is a miss; one that is truncated or corrupt
(a bad header, a sha256 mismatch) is removed, as its owner would remove it; one that is merely
foreign to this cache (another dtype, other KV shapes, metadata not matching its directory) is
skipped and left alone. Files that other processes write into sibling directories after this
cache started are not seen: a cache sees its siblings as they were when it was created (a
re-plan restarts the stages, which re-indexes them).

Old ranges. Every re-plan that moves layers starts a new range directory, and new weights of a
model (another fingerprint) a new model directory, so without a bound a node that lives through
many re-plans and models would fill its disk. A cache holds a shared lock on its directory's
`.live` file for as long as it runs (the OS drops it when the process dies); at start-up, before
it indexes its siblings, it prunes the range directories under the cache root, of every model,
that no running cache holds: together they may keep at most `ssd_max_bytes` (on top of this
range's own cap), the most recently used first; the others, and empty ones, are removed whole
(renamed away first; a cache starting on that range meanwhile checks that its lock is on the
directory still there, and makes a fresh one if not: `hold_range`).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import logging
import os
import re
import shutil
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from omlx_node.kv_cache.blocks import Block, Layout, MiB
from omlx_node.kv_cache.metrics import KVCacheMetrics
from omlx_node.kv_cache.ssd_format import (
    HEX64,
    BadFile,
    FileInfo,
    Owner,
    check_header,
    read_head,
    read_header,
    remove_bad_file,
    tensor_names,
)

log = logging.getLogger(__name__)

_RANGE_DIR = re.compile(r"(\d+)-(\d+)")
_MODEL_DIR = re.compile(r".+\.[0-9a-f]{8}")  # ssd_tier.model_dir_name's
_LIVE_FILE = ".live"
_TRASH_PREFIX = ".trash-"


def lock_range(range_dir: Path, exclusive: bool) -> int | None:
    """Locks `range_dir`'s liveness file: shared (blocking) by the cache that uses the directory,
    exclusive (never blocking) by a pruner. Returns the open descriptor that holds the lock, or
    None when a running cache holds it (or the directory is gone)."""
    try:
        fd = os.open(range_dir / _LIVE_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB if exclusive else fcntl.LOCK_SH)
    except OSError:
        os.close(fd)
        return None
    return fd


def hold_range(range_dir: Path) -> int | None:
    """The shared lock a running cache holds on its range directory (made if missing), on the
    directory that is there: a pruner may rename a directory away between its making and this
    lock (or while this waits for the pruner's own lock), and a lock on what went to the trash
    would hold nothing. None when the directory cannot be made or locked."""
    for _ in range(3):
        try:
            range_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            return None
        fd = lock_range(range_dir, exclusive=False)
        if fd is None:
            continue
        try:
            if os.fstat(fd).st_ino == os.stat(range_dir / _LIVE_FILE).st_ino:
                return fd
        except OSError:
            pass
        os.close(fd)
    return None


def prune_old_ranges(own_dir: Path, max_bytes: int) -> None:
    """Removes the least recently used range directories under the cache root that no running
    cache holds (this model's other ranges, and other models' or other versions' of this one:
    a model's directory is named by its weights' fingerprint), beyond `max_bytes` for all of
    them together, and the empty ones (see the module docstring)."""
    root = own_dir.parent.parent
    if not root.is_dir():
        return
    old: list[tuple[float, int, Path]] = []
    for model_dir in root.iterdir():
        if not model_dir.is_dir() or not _MODEL_DIR.fullmatch(model_dir.name):
            continue
        for rdir in model_dir.iterdir():
            if rdir.name.startswith(_TRASH_PREFIX):  # a prune that died half-way
                shutil.rmtree(rdir, ignore_errors=True)
                continue
            # Only what a cache made (its .live): --paged-ssd-cache-dir may be a folder of
            # the user's, with anything else in it.
            if (rdir == own_dir or not _RANGE_DIR.fullmatch(rdir.name)
                    or not (rdir / _LIVE_FILE).is_file()):
                continue
            size, newest = 0, 0.0
            for f in rdir.glob("*/*.safetensors"):
                try:
                    st = f.stat()
                except OSError:
                    continue  # removed meanwhile by its owner
                size, newest = size + st.st_size, max(newest, st.st_mtime)
            old.append((newest, size, rdir))
    kept = 0
    for newest, size, rdir in sorted(old, key=lambda o: o[0], reverse=True):
        if size and kept + size <= max_bytes:
            kept += size
            continue
        fd = lock_range(rdir, exclusive=True)
        if fd is None:  # a running cache uses it
            kept += size
            continue
        try:
            trash = rdir.parent / f"{_TRASH_PREFIX}{uuid.uuid4().hex}"
            rdir.rename(trash)
        finally:
            os.close(fd)
        shutil.rmtree(trash, ignore_errors=True)
        try:
            rdir.parent.rmdir()  # a model directory left empty goes too
        except OSError:
            pass  # it holds other ranges (or a cache starting on it made one meanwhile)
        log.info("KV cache: removed %s (%.1f MiB; the ranges no running cache holds keep at "
                 "most %.1f MiB together)", rdir, size / MiB, max_bytes / MiB)


@dataclass(frozen=True)
class SiblingFile:
    """A block file of another layer range of the same model (read-only to this cache)."""

    path: Path
    start: int  # its layer range [start, end)
    end: int
    dtype: str


def sibling_owner(owner: Owner, start: int, end: int) -> Owner:
    """What the files of the sibling range [start, end) of `owner`'s cache say."""
    return dataclasses.replace(owner, layer_start=start, layer_end=end)


def read_layers(
    owner: Owner, file: SiblingFile, block_hash: str, lo: int, hi: int
) -> tuple[FileInfo, dict[str, np.ndarray]]:
    """Reads layers [lo, hi) of a sibling file: the header is checked, the whole tensor
    section is hashed against its sha256 (streamed, in file order) but only the wanted
    tensors are kept. Raises BadFile or OSError."""
    wanted = set(tensor_names(lo, hi))
    with open(file.path, "rb") as f:
        size, head = read_head(f)
        info = check_header(sibling_owner(owner, file.start, file.end), block_hash, head, size)
        if info.dtype.name != file.dtype:
            raise BadFile("foreign", f"dtype {info.dtype.name}, indexed as {file.dtype}")
        f.seek(info.data_start)
        digest = hashlib.sha256()
        # Tensors not wanted are read into one scratch buffer, only to be hashed.
        scratch = bytearray(
            max((e - s for name, _, s, e in info.tensors if name not in wanted), default=0)
        )
        out = {}
        for name, shape, s, e in info.tensors:  # in file order, contiguous from 0
            if name in wanted:
                arr = np.empty(shape, info.dtype.np)
                buf = memoryview(arr).cast("B")
            else:
                arr, buf = None, memoryview(scratch)[: e - s]
            got = 0
            while got < len(buf):
                k = f.readinto(buf[got:])
                if not k:
                    raise BadFile("truncated", "the file ends inside its tensors")
                got += k
            digest.update(buf)
            if arr is not None:
                out[name] = arr
    if digest.hexdigest() != info.tensor_sha256:
        raise BadFile("corrupt", "tensor bytes do not match their sha256")
    return info, out


class Siblings:
    """The read-only index of the sibling files of the cache `owner` describes. `lock` is the
    cache's lock, which guards the index."""

    def __init__(self, owner: Owner, lock: threading.RLock, metrics: KVCacheMetrics):
        self.owner = owner
        self.metrics = metrics
        self._lock = lock
        # Block hash -> files of other layer ranges holding some of this stage's layers.
        self._sib: dict[str, list[SiblingFile]] = {}

    def count(self) -> int:
        """Indexed files (lock held)."""
        return sum(len(v) for v in self._sib.values())

    def index(self, model_dir: Path) -> None:
        """Indexes, from their headers, the block files of the other layer-range directories of
        `model_dir` that overlap this stage's layers. Truncated or corrupt files are removed
        (their owner would remove them too); foreign ones are skipped and left alone."""
        if not model_dir.is_dir():
            return
        own = self.owner
        found: dict[str, list[SiblingFile]] = {}
        n_dirs = skipped = 0
        for rdir in sorted(model_dir.iterdir()):
            m = _RANGE_DIR.fullmatch(rdir.name)
            if m is None or not rdir.is_dir():
                continue
            start, end = int(m[1]), int(m[2])
            if (start, end) == (own.layer_start, own.layer_end) or start >= end:
                continue
            if end <= own.layer_start or start >= own.layer_end:
                continue  # none of our layers
            n_dirs += 1
            try:
                subs = [sub for sub in rdir.iterdir() if sub.is_dir()]
            except OSError as e:
                log.warning("KV cache: cannot index sibling %s: %s", rdir, e)
                continue
            for sub in subs:
                try:
                    paths = list(sub.iterdir())
                except OSError as e:
                    log.warning("KV cache: cannot index sibling %s: %s", sub, e)
                    continue
                for path in paths:
                    h = path.name.removesuffix(".safetensors")
                    if h == path.name or not HEX64.match(h) or sub.name != h[:2]:
                        continue  # temp files and strangers are the owner's business
                    try:
                        _, info = read_header(sibling_owner(own, start, end), path, h)
                    except BadFile as e:
                        skipped += not self._bad(path, e)
                        continue
                    except OSError as e:
                        log.warning("KV cache: cannot index sibling file %s: %s", path, e)
                        continue
                    found.setdefault(h, []).append(
                        SiblingFile(path, start, end, info.dtype.name)
                    )
        with self._lock:
            self._sib = found
        if skipped:
            log.info("KV cache: skipped %d sibling files under %s that do not fit this cache "
                     "(another dtype or weights)", skipped, model_dir)
        if found:
            log.info(
                "KV cache: %d sibling files of %d blocks in %d other layer ranges of %s",
                sum(len(v) for v in found.values()), len(found), n_dirs, model_dir,
            )

    def _bad(self, path: Path, err: BadFile) -> bool:
        """A sibling file that failed a check: removed if it is broken for anyone (truncated,
        corrupt), left alone if it is only foreign to this cache. True if it was removed."""
        if err.reason == "foreign":
            log.debug("KV cache: skipping sibling file %s: %s", path, err)
            return False
        remove_bad_file(path, err, self.metrics)
        return True

    def plan(
        self, block_hash: str, layout: Layout | None
    ) -> list[tuple[SiblingFile, int, int]] | None:
        """Lock held. Sibling files of one dtype whose ranges cover this stage's layers, each
        with the layers [lo, hi) to take from it; None if they do not cover them all. `layout`
        is the stage's KV layout, once known."""
        files = self._sib.get(block_hash)
        if not files:
            return None
        own = self.owner
        want = own.dtype or (layout[0] if layout is not None else None)
        for dt in [want] if want is not None else sorted({f.dtype for f in files}):
            cands = [f for f in files if f.dtype == dt]
            plan: list[tuple[SiblingFile, int, int]] = []
            pos = own.layer_start
            while pos < own.layer_end:
                # Greedy interval cover: the file reaching furthest, so the fewest files.
                best = max(
                    (f for f in cands if f.start <= pos < f.end), key=lambda f: f.end, default=None
                )
                if best is None:
                    break
                hi = min(best.end, own.layer_end)
                plan.append((best, pos, hi))
                pos = hi
            else:
                return plan
        return None

    def _drop(self, block_hash: str, file: SiblingFile) -> None:
        with self._lock:
            files = self._sib.get(block_hash)
            if files is not None and file in files:
                files.remove(file)
                if not files:
                    del self._sib[block_hash]

    def load(self, block_hash: str, layout: Layout | None) -> Block | None:
        """Assembles this stage's block from sibling files; None if they no longer cover its
        layers (a file vanished, went bad or turned out foreign: it leaves the index, and another
        cover is tried)."""
        while True:
            with self._lock:
                plan = self.plan(block_hash, layout)
            if plan is None:
                return None
            arrays: dict[str, np.ndarray] = {}
            infos: list[FileInfo] = []
            for file, lo, hi in plan:
                try:
                    info, got = read_layers(self.owner, file, block_hash, lo, hi)
                except FileNotFoundError:
                    self._drop(block_hash, file)  # evicted by its owner: a miss
                    break
                except OSError as e:
                    log.warning("KV cache: cannot read sibling %s (%s); a miss", file.path, e)
                    self._drop(block_hash, file)
                    break
                except BadFile as e:
                    self._bad(file.path, e)
                    self._drop(block_hash, file)
                    break
                infos.append(info)
                arrays.update(got)
            else:
                layers = range(self.owner.layer_start, self.owner.layer_end)
                block = Block(
                    hash=block_hash,
                    parent=infos[0].parent,
                    dtype=infos[0].dtype,
                    keys=[arrays[f"k.{i}"] for i in layers],
                    values=[arrays[f"v.{i}"] for i in layers],
                )
                bad = None
                if any(i.parent != block.parent for i in infos):
                    bad = "its files disagree on the parent block"
                elif layout is not None and block.layout != layout:
                    bad = "its tensor shapes differ from this stage's KV"
                if bad is None:
                    return block
                # Which file is wrong cannot be told: none of them is used for this block again.
                log.warning("KV cache: not using sibling files of block %s: %s",
                            block_hash[:12], bad)
                for file, _, _ in plan:
                    self._drop(block_hash, file)
                return None
