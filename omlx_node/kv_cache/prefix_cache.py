"""Tiered KV prefix cache of one stage: hot blocks in RAM, cold blocks on SSD.

A prompt is cut into blocks of `block_size` tokens; block i is named by a SHA-256 chain over the
model id, block i-1's hash and block i's token ids, so a name stands for the whole prefix up to
the end of that block and a block is only ever reused at its own position. A block holds the keys
and values of this stage's layers for its tokens.

How the batcher uses it (all on the engine thread):

    n = cache.lookup(prompt[:-1])              # tokens whose KV is held, a multiple of block_size
    kv = cache.restore(prompt[:-1], n)         # fresh mlx-lm KVCaches, one per layer
    done = kv[0].offset                         # == n unless a file went bad in between
    ... prefill prompt[done:-1] into kv ...
    cache.store(prompt[:-1], kv)                # keeps the full blocks not held yet

Threads: lookup, restore and store run on the caller's thread and take a lock only to touch the
indexes. `store` copies the new blocks to host memory (numpy) on the caller's thread and never
touches the disk; one writer thread does all file I/O and never touches MLX. Evaluated MLX arrays
can be read from another thread on the CPU backend, but numpy has no bfloat16 (the conversion
needs an MLX op, `view`) and an MLX array whose last reference dies on the writer thread would be
freed there; handing numpy copies over keeps MLX on the engine thread only, as the batcher wants.
The copy is a memcpy of the new blocks, small next to the prefill that produced them. The RAM tier
keeps those host arrays, and the write queue shares them (no second copy waits for the disk); a
restore concatenates them and copies the result into MLX once.

Across stages the head takes the minimum of every stage's `lookup`. A block can still vanish
between `lookup` and `restore` (a corrupt file, or an eviction by the writer when the SSD tier is
tiny), so the caller must use the restored offset, not the looked-up count.

Cold tier files are ordinary safetensors (mx.load and the safetensors library read them); the
metadata says whose they are, and a file that is truncated, corrupt or foreign is removed when the
index is rebuilt or when it is loaded, so the worst a bad file costs is a re-prefill. Any OSError
while writing (a full disk, a read-only directory) turns the SSD tier's writes off with one
warning: the cache goes on in RAM (and keeps reading the blocks already on disk).

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

Old ranges. Every re-plan that moves layers starts a new range directory, so without a bound a
node that lives through many re-plans would fill its disk. A cache holds a shared lock on its
directory's `.live` file for as long as it runs (the OS drops it when the process dies); at
start-up, before it indexes its siblings, it prunes the range directories of its model that no
running cache holds: together they may keep at most `ssd_max_bytes` (on top of this range's own
cap), the most recently used first; the others, and empty ones, are removed whole (renamed away
first, so a cache starting on that range meanwhile gets a fresh directory).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import struct
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache
from prometheus_client import CollectorRegistry

from omlx_node.kv_metrics import KVCacheMetrics

log = logging.getLogger(__name__)

FORMAT = "omlx-kv-block"
FORMAT_VERSION = "1"
GiB = 1 << 30
MiB = 1 << 20
_HASH_DOMAIN = b"omlx-kv-v1\0"
_MAX_HEADER_BYTES = 1 << 20  # a real header is ~100 bytes per layer; more means garbage
_STALE_TMP_SECONDS = 600.0  # a younger temp file may belong to a writer still running
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_RANGE_DIR = re.compile(r"(\d+)-(\d+)")
_LIVE_FILE = ".live"
_TRASH_PREFIX = ".trash-"


def _lock_range(range_dir: Path, exclusive: bool) -> int | None:
    """Locks `range_dir`'s liveness file: shared (blocking) by the cache that uses the directory,
    exclusive (never blocking) by a pruner. Returns the open descriptor that holds the lock, or
    None when a running cache holds it (or the directory is gone)."""
    try:
        fd = os.open(range_dir / _LIVE_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB if exclusive else fcntl.LOCK_SH)
    except OSError:
        os.close(fd)
        return None
    return fd


@dataclass(frozen=True)
class _DType:
    name: str  # as ShardInfo.dtype spells it
    st: str  # as safetensors spells it
    np: type  # how numpy holds the bytes: bfloat16 as its raw uint16 bits
    mx: mx.Dtype


_DTYPES = (
    _DType("float32", "F32", np.float32, mx.float32),
    _DType("float16", "F16", np.float16, mx.float16),
    _DType("bfloat16", "BF16", np.uint16, mx.bfloat16),
)
_BY_NAME = {d.name: d for d in _DTYPES}
_BY_MX = {d.mx: d for d in _DTYPES}


def block_hashes(model_id: str, tokens: Sequence[int], block_size: int) -> list[str]:
    """Hex SHA-256 chain over the FULL blocks of `tokens`:
    h_i = sha256(domain, len(model_id), model_id, h_{i-1} (32 zero bytes for i = 0), block i's ids
    as little-endian int64). The length prefix keeps (model id, tokens) pairs unambiguous."""
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    n = len(tokens) // block_size
    if n == 0:
        return []
    ids = np.asarray(tokens[: n * block_size], dtype="<i8").tobytes()
    mid = model_id.encode()
    prefix = _HASH_DOMAIN + struct.pack("<I", len(mid)) + mid
    step = block_size * 8
    parent = bytes(32)
    out = []
    for i in range(n):
        parent = hashlib.sha256(prefix + parent + ids[i * step : (i + 1) * step]).digest()
        out.append(parent.hex())
    return out


def model_dir_name(model_id: str) -> str:
    """A directory name for a model id: readable, plus a short hash so that ids which sanitise
    alike ("a/b", "a--b") never share a directory (they would delete each other's files)."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", model_id.replace("/", "--")).strip("._-")[:100]
    return f"{safe or 'model'}.{hashlib.sha256(model_id.encode()).hexdigest()[:8]}"


# A block's layout: dtype name and the (kv_heads, block_size, head_dim) shape of every key and
# value tensor. Blocks are only concatenated with blocks of the same layout.
Layout = tuple[str, tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]


@dataclass(eq=False)
class _Block:
    hash: str
    parent: str  # "" for the first block of a prompt
    dtype: _DType
    keys: list[np.ndarray]  # per layer of the stage, (kv_heads, block_size, head_dim), C-contiguous
    values: list[np.ndarray]
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values)

    @property
    def layout(self) -> Layout:
        return (
            self.dtype.name,
            tuple(a.shape for a in self.keys),
            tuple(a.shape for a in self.values),
        )


class _BadFile(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason  # truncated, corrupt or foreign: the metric's label


@dataclass(frozen=True)
class _FileInfo:
    parent: str
    dtype: _DType
    tensors: list[tuple[str, tuple[int, ...], int, int]]  # name, shape, start, end (data offsets)
    tensor_sha256: str
    data_start: int


@dataclass(frozen=True)
class _SiblingFile:
    """A block file of another layer range of the same model (read-only to this cache)."""

    path: Path
    start: int  # its layer range [start, end)
    end: int
    dtype: str


@dataclass(frozen=True)
class CacheStats:
    hot_blocks: int
    hot_bytes: int
    ssd_blocks: int
    ssd_bytes: int
    queued_blocks: int
    ssd_writable: bool
    sibling_files: int = 0  # indexed files of other layer ranges (see the module docstring)


def _read_head(f) -> tuple[int, bytes]:
    """A safetensors file's size and its first bytes: the length prefix and, when that length
    is sane, the JSON header (checked by the caller)."""
    size = os.fstat(f.fileno()).st_size
    head = f.read(8)
    if len(head) == 8:
        (n,) = struct.unpack("<Q", head)
        if n <= _MAX_HEADER_BYTES:
            head += f.read(n)
    return size, head


class PrefixCache:
    """The KV prefix cache of the stage holding layers [layer_range[0], layer_range[1]).

    `model_id` names the weights, not just the model: blocks of another revision or quantization
    stored under the same id would be wrong answers, so include whatever tells them apart.
    `hot_max_bytes` caps the RAM tier, `ssd_max_bytes` the files under `ssd_dir` (None: RAM
    only). `dtype` ("float32", "bfloat16", ...: the stage's compute dtype) makes files of another
    dtype foreign, so a cache dir written by a node computing in bf16 is never mixed into an f32
    one. The writer leaves `ssd_min_free_bytes` free on the disk (default max(1 GiB, 5 %)), and at
    most `write_queue_max_bytes` of blocks wait for it (more are dropped, not waited for).
    """

    def __init__(
        self,
        model_id: str,
        layer_range: tuple[int, int],
        block_size: int = 256,
        *,
        hot_max_bytes: int = 1 * GiB,
        ssd_dir: Path | str | None = None,
        ssd_max_bytes: int = 16 * GiB,
        metrics_registry: CollectorRegistry | None = None,
        dtype: str | None = None,
        ssd_min_free_bytes: int | None = None,
        write_queue_max_bytes: int = 1 * GiB,
    ):
        start, end = layer_range
        if not 0 <= start < end:
            raise ValueError(f"bad layer range {layer_range}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if dtype is not None and dtype not in _BY_NAME:
            raise ValueError(f"unsupported KV dtype {dtype!r}; one of {sorted(_BY_NAME)}")
        self.model_id = model_id
        self.layer_start, self.layer_end = start, end
        self.n_layers = end - start
        self.block_size = block_size
        self.hot_max_bytes = hot_max_bytes
        self.ssd_max_bytes = ssd_max_bytes
        self.dtype = dtype
        self.ssd_min_free_bytes = ssd_min_free_bytes
        self.write_queue_max_bytes = write_queue_max_bytes
        self.metrics = KVCacheMetrics(metrics_registry)
        self._readers = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 2),
                                           thread_name_prefix="kv-read")
        self.last_restore_seconds = 0.0

        # One lock guards every index below; file I/O and numpy copies happen outside it.
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        self._hot: OrderedDict[str, _Block] = OrderedDict()  # LRU first
        self._hot_bytes = 0
        self._cold: OrderedDict[str, int] = OrderedDict()  # hash -> file size, LRU first
        self._cold_bytes = 0
        self._layout: Layout | None = None  # learned from the caller's caches in store()
        self._queue: deque[_Block] = deque()
        self._queued: set[str] = set()
        self._queued_bytes = 0
        self._busy = False
        self._touched: set[str] = set()  # SSD blocks used since the writer last saved recency
        self._stop = False
        self._ssd_writable = False
        self._low_space = False
        self._thread: threading.Thread | None = None
        self.dir: Path | None = None
        # Block hash -> files of other layer ranges holding some of this stage's layers.
        self._sib: dict[str, list[_SiblingFile]] = {}
        self.metrics.hits.labels(tier="sibling")
        self._live_fd: int | None = None  # the shared lock on this range's directory

        if ssd_dir is not None:
            self.dir = Path(ssd_dir) / model_dir_name(model_id) / f"{start}-{end}"
            self._ssd_writable = True
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                self._degrade(e)
            if self.dir.is_dir():
                self._live_fd = _lock_range(self.dir, exclusive=False)
                try:
                    self._rebuild_index()
                except OSError as e:  # an unreadable dir costs its blocks, not the node
                    log.warning("KV cache: cannot index %s: %s", self.dir, e)
            try:
                self._prune_old_ranges()
            except OSError as e:
                log.warning("KV cache: cannot prune the old ranges next to %s: %s", self.dir, e)
            try:
                self._index_siblings()
            except OSError as e:
                log.warning("KV cache: cannot index the siblings of %s: %s", self.dir, e)
            self._thread = threading.Thread(
                target=self._writer_loop, name=f"kv-writer-{start}-{end}", daemon=True
            )
            self._thread.start()
        self._update_gauges()

    # ---- public API ------------------------------------------------------------------------

    def lookup(self, tokens: Sequence[int]) -> int:
        """How many leading tokens (a multiple of block_size) either tier holds (or sibling layer
        ranges hold together, see the module docstring), as one unbroken chain from the first
        block. Pass prompt[:-1]: the last prompt token must still be run.
        Marks the blocks found as recently used, so they outlive the step until `restore`."""
        hashes = block_hashes(self.model_id, tokens, self.block_size)
        n = 0
        with self._lock:
            for h in hashes:
                held = False
                if h in self._hot:
                    self._hot.move_to_end(h)
                    held = True
                if h in self._cold:
                    self._cold.move_to_end(h)
                    self._touched.add(h)
                    held = True
                if not held and self._sibling_plan(h) is None:
                    break
                n += 1
            if self._touched:
                self._cv.notify_all()
        self.metrics.lookups.inc()
        self.metrics.misses.inc(len(hashes) - n)
        return n * self.block_size

    def restore(self, tokens: Sequence[int], n_tokens: int) -> list[KVCache]:
        """One fresh KVCache per layer of the stage, holding the KV of tokens[:n_tokens] (rounded
        down to whole blocks). Blocks only on SSD are read, checked and promoted to RAM; blocks
        only sibling ranges hold are assembled from their files, promoted and queued for this
        range's own directory. A block that went missing or bad since `lookup` ends the prefix
        early: the caches then hold fewer tokens, so read the count from `caches[0].offset`,
        never assume n_tokens."""
        t0 = time.perf_counter()
        n_blocks = max(0, min(n_tokens, len(tokens))) // self.block_size
        hashes = block_hashes(self.model_id, tokens[: n_blocks * self.block_size], self.block_size)
        with self._lock:
            on_disk = [h for h in hashes if h not in self._hot and h in self._cold]
        # Reading and checking SSD blocks releases the GIL (file reads, sha256): overlap them.
        loads = {h: self._readers.submit(self._load, h) for h in on_disk}
        blocks: list[_Block] = []
        try:
            self._restore_blocks(hashes, loads, blocks)
        finally:
            for f in loads.values():
                f.cancel()
        caches = self._build(blocks)
        self.last_restore_seconds = time.perf_counter() - t0
        if hashes:
            self.metrics.restore_seconds.observe(self.last_restore_seconds)
        self._update_gauges()
        return caches

    def _restore_blocks(self, hashes: list[str], loads: dict, blocks: list[_Block]) -> None:
        """Appends to `blocks` the unbroken chain of `hashes` that can be restored."""
        for h in hashes:
            tier = "ram"
            with self._lock:
                block = self._hot.get(h)
                if block is not None:
                    self._hot.move_to_end(h)
                if h in self._cold:
                    self._cold.move_to_end(h)
                    self._touched.add(h)
                    self._cv.notify_all()
            if block is None:
                tier = "ssd"
                block = loads[h].result() if h in loads else self._load(h)
                if block is None:
                    tier = "sibling"
                    block = self._load_sibling(h)
                    if block is None:
                        break
            if blocks and block.layout != blocks[0].layout:
                log.warning("KV cache: block %s does not match its prefix's layout", h[:12])
                break
            if tier != "ram":
                with self._lock:
                    self._insert_hot(block)
                    if tier == "sibling" and h not in self._cold and h not in self._queued:
                        self._enqueue(block)  # it becomes an ordinary block of this range
            blocks.append(block)
            self.metrics.hits.labels(tier=tier).inc()

    def store(self, tokens: Sequence[int], cache: Sequence[KVCache]) -> None:
        """Keeps every full block of `tokens` whose KV `cache` holds (one KVCache per layer of the
        stage, batch of one) and that no tier holds yet: in RAM now, on SSD later (the writer
        thread). Never touches the disk on this thread."""
        if len(cache) != self.n_layers:
            raise ValueError(
                f"expected {self.n_layers} layer caches for layers "
                f"[{self.layer_start}, {self.layer_end}), got {len(cache)}"
            )
        if any(c.keys is None for c in cache):
            return
        held = min(c.offset for c in cache)
        n_blocks = min(len(tokens), held) // self.block_size
        if n_blocks == 0:
            return
        hashes = block_hashes(self.model_id, tokens[: n_blocks * self.block_size], self.block_size)
        with self._lock:
            todo = [
                i
                for i, h in enumerate(hashes)
                if h not in self._hot and h not in self._cold and h not in self._queued
            ]
        if not todo:
            return
        dt = _BY_MX.get(cache[0].keys.dtype)
        if dt is None:
            raise TypeError(f"KV dtype {cache[0].keys.dtype} is not supported by the prefix cache")
        if self.dtype is not None and dt.name != self.dtype:
            raise ValueError(f"KV dtype {dt.name} differs from the cache's declared {self.dtype}")
        if cache[0].keys.shape[0] != 1:
            raise ValueError("store() takes one sequence's cache (batch size 1)")

        # All slices evaluated together (one graph), then copied out of the step-rounded buffer
        # into independent host arrays: a view would keep the whole buffer alive.
        bs = self.block_size
        slices = []
        for c in cache:
            k, v = c.keys, c.values
            if dt.mx == mx.bfloat16:
                k, v = k.view(mx.uint16), v.view(mx.uint16)
            for i in todo:
                slices.append(k[0, :, i * bs : (i + 1) * bs, :])
                slices.append(v[0, :, i * bs : (i + 1) * bs, :])
        mx.eval(slices)
        # Contiguous: a chunk that exactly fills mlx-lm's buffer can leave a transposed layout,
        # which the writer's memoryview cannot serialise.
        host = [np.ascontiguousarray(np.array(a)) for a in slices]

        new = []
        for b, i in enumerate(todo):
            at = [(j * len(todo) + b) * 2 for j in range(self.n_layers)]
            new.append(
                _Block(
                    hash=hashes[i],
                    parent=hashes[i - 1] if i else "",
                    dtype=dt,
                    keys=[host[a] for a in at],
                    values=[host[a + 1] for a in at],
                )
            )
        with self._lock:
            layout = new[0].layout
            if self._layout != layout:
                if self._layout is not None:
                    log.warning("KV cache: the stage's KV layout changed; dropping RAM blocks")
                    for h in [h for h, b in self._hot.items() if b.layout != layout]:
                        self._hot_bytes -= self._hot.pop(h).nbytes
                self._layout = layout
            for block in new:
                self._insert_hot(block)
                self._enqueue(block)
        self.metrics.stored.inc(len(new))
        self._update_gauges()

    def flush(self, timeout: float = 10.0) -> bool:
        """Waits until the writer has nothing queued (writes and recency updates); False if
        `timeout` passed first."""
        if self._thread is None:
            return True
        with self._cv:
            return self._cv.wait_for(
                lambda: not self._queue and not self._touched and not self._busy, timeout
            )

    def close(self, timeout: float = 10.0) -> None:
        """Writes what is queued (waiting at most `timeout`), then stops the writer thread and
        lets go of the range directory (a later cache may prune it)."""
        self._readers.shutdown(wait=False, cancel_futures=True)
        if self._thread is not None:
            self.flush(timeout)
            with self._cv:
                self._stop = True
                self._cv.notify_all()
            self._thread.join(timeout)
            self._thread = None
        if self._live_fd is not None:
            os.close(self._live_fd)
            self._live_fd = None

    def __enter__(self) -> PrefixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                hot_blocks=len(self._hot),
                hot_bytes=self._hot_bytes,
                ssd_blocks=len(self._cold),
                ssd_bytes=self._cold_bytes,
                queued_blocks=len(self._queue),
                ssd_writable=self._ssd_writable,
                sibling_files=sum(len(v) for v in self._sib.values()),
            )

    def hot_hashes(self) -> list[str]:
        """RAM blocks, least recently used first."""
        with self._lock:
            return list(self._hot)

    def ssd_hashes(self) -> list[str]:
        """SSD blocks, least recently used first."""
        with self._lock:
            return list(self._cold)

    def block_path(self, block_hash: str) -> Path:
        if self.dir is None:
            raise ValueError("this cache has no SSD tier")
        return self.dir / block_hash[:2] / f"{block_hash}.safetensors"

    # ---- RAM tier --------------------------------------------------------------------------

    def _insert_hot(self, block: _Block) -> None:
        if block.hash in self._hot:
            self._hot.move_to_end(block.hash)
            return
        if block.nbytes > self.hot_max_bytes:
            return  # it would evict everything and still not fit
        self._hot[block.hash] = block
        self._hot_bytes += block.nbytes
        while self._hot_bytes > self.hot_max_bytes:
            _, old = self._hot.popitem(last=False)
            self._hot_bytes -= old.nbytes
            self.metrics.evictions.labels(tier="ram").inc()

    def _build(self, blocks: list[_Block]) -> list[KVCache]:
        """One copy of the blocks into each layer's buffer, with KVCache.step tokens of spare
        room: the prefill and decode steps that follow append without copying it all again."""
        caches = [KVCache() for _ in range(self.n_layers)]
        if not blocks:
            return caches
        bs = self.block_size
        n = len(blocks) * bs
        dt = blocks[0].dtype
        arrays = []
        for j, c in enumerate(caches):
            pair = []
            for parts in ([b.keys[j] for b in blocks], [b.values[j] for b in blocks]):
                heads, _, dim = parts[0].shape
                buf = np.zeros((1, heads, n + KVCache.step, dim), parts[0].dtype)
                for i, part in enumerate(parts):
                    buf[0, :, i * bs : (i + 1) * bs] = part
                a = mx.array(buf)
                pair.append(a.view(mx.bfloat16) if dt.mx == mx.bfloat16 else a)
            c.keys, c.values = pair
            c.offset = n
            arrays += pair
        mx.eval(arrays)
        return caches

    # ---- SSD tier: files -------------------------------------------------------------------

    def _meta(self, block: _Block, tensor_sha256: str) -> dict[str, str]:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "model_id": self.model_id,
            "layer_start": str(self.layer_start),
            "layer_end": str(self.layer_end),
            "block_size": str(self.block_size),
            "token_count": str(self.block_size),
            "dtype": block.dtype.name,
            "block_hash": block.hash,
            "parent_hash": block.parent,
            "tensor_sha256": tensor_sha256,
        }

    def _tensor_order(self, layers: tuple[int, int] | None = None) -> list[str]:
        start, end = layers or (self.layer_start, self.layer_end)
        names = []
        for layer in range(start, end):
            names += [f"k.{layer}", f"v.{layer}"]
        return names

    def _encode_block(self, block: _Block) -> tuple[bytes, list[np.ndarray]]:
        """The safetensors header (length prefix included) and the tensors in file order."""
        arrays = [a for pair in zip(block.keys, block.values) for a in pair]
        digest = hashlib.sha256()
        for a in arrays:
            digest.update(memoryview(a).cast("B"))
        header: dict[str, object] = {"__metadata__": self._meta(block, digest.hexdigest())}
        offset = 0
        for name, a in zip(self._tensor_order(), arrays):
            header[name] = {
                "dtype": block.dtype.st,
                "shape": list(a.shape),
                "data_offsets": [offset, offset + a.nbytes],
            }
            offset += a.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors aligns the data section to 8 bytes
        return struct.pack("<Q", len(raw)) + raw, arrays

    def _check_header(
        self, block_hash: str, head: bytes, file_size: int, layers: tuple[int, int] | None = None
    ) -> _FileInfo:
        """Validates a file's header against this cache, or, with `layers`, against a sibling
        of this cache holding that layer range; raises _BadFile."""
        own = layers is None or layers == (self.layer_start, self.layer_end)
        start, end = layers or (self.layer_start, self.layer_end)
        if file_size < 8 or len(head) < 8:
            raise _BadFile("truncated", "shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head[:8])
        if n > _MAX_HEADER_BYTES:
            raise _BadFile("corrupt", f"header length {n}")
        if 8 + n > file_size or len(head) < 8 + n:
            raise _BadFile("truncated", "the header runs past the end of the file")
        try:
            header = json.loads(head[8 : 8 + n])
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _BadFile("corrupt", f"header is not JSON: {e}") from None
        if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
            raise _BadFile("corrupt", "no metadata")
        meta = header.pop("__metadata__")
        if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
            raise _BadFile(
                "foreign", f"format {meta.get('format')!r} v{meta.get('format_version')!r}"
            )
        want = {
            "model_id": self.model_id,
            "layer_start": str(start),
            "layer_end": str(end),
            "block_size": str(self.block_size),
            "token_count": str(self.block_size),
            "block_hash": block_hash,
        }
        for key, value in want.items():
            if meta.get(key) != value:
                raise _BadFile("foreign", f"{key} is {meta.get(key)!r}, expected {value!r}")
        dt = _BY_NAME.get(meta.get("dtype", ""))
        if dt is None:
            raise _BadFile("corrupt", f"dtype {meta.get('dtype')!r}")
        if self.dtype is not None and dt.name != self.dtype:
            raise _BadFile("foreign", f"dtype {dt.name}, expected {self.dtype}")
        parent = meta.get("parent_hash", "")
        sha = meta.get("tensor_sha256", "")
        if not isinstance(parent, str) or not (parent == "" or _HEX64.match(parent)):
            raise _BadFile("corrupt", "parent hash")
        if not isinstance(sha, str) or not _HEX64.match(sha):
            raise _BadFile("corrupt", "tensor hash")
        order = self._tensor_order((start, end))
        if set(header) != set(order):
            raise _BadFile("corrupt", f"tensors {sorted(header)[:6]}")
        itemsize = np.dtype(dt.np).itemsize
        tensors = []
        for name in order:
            t = header[name]
            shape, offs = t.get("shape"), t.get("data_offsets")
            ok = (
                t.get("dtype") == dt.st
                and isinstance(shape, list)
                and len(shape) == 3
                and all(type(d) is int and d > 0 for d in shape)
                and shape[1] == self.block_size
                and isinstance(offs, list)
                and len(offs) == 2
                and all(type(o) is int for o in offs)
                and offs[1] - offs[0] == int(np.prod(shape)) * itemsize
            )
            if not ok:
                raise _BadFile("corrupt", f"tensor {name}: {t}")
            tensors.append((name, tuple(shape), offs[0], offs[1]))
        tensors.sort(key=lambda t: t[2])
        expect = 0
        for _, _, s, e in tensors:
            if s != expect:
                raise _BadFile("corrupt", "tensor data is not contiguous")
            expect = e
        data_len = file_size - 8 - n
        if data_len < expect:
            raise _BadFile("truncated", f"{data_len} data bytes, the header says {expect}")
        if data_len > expect:
            raise _BadFile("corrupt", "trailing bytes after the tensors")
        info = _FileInfo(parent, dt, tensors, sha, 8 + n)
        if not own:
            return info  # a sibling's shapes are checked once its layers are assembled
        shapes = {name: shape for name, shape, _, _ in tensors}
        layers = range(self.layer_start, self.layer_end)
        layout = (
            dt.name,
            tuple(shapes[f"k.{i}"] for i in layers),
            tuple(shapes[f"v.{i}"] for i in layers),
        )
        if self._layout is not None and layout != self._layout:
            raise _BadFile("foreign", "tensor shapes differ from this stage's KV")
        return info

    def _read_header(
        self, path: Path, block_hash: str, layers: tuple[int, int] | None = None
    ) -> tuple[int, _FileInfo]:
        """Checks a file's header; returns its size and what the header says. Raises _BadFile
        or OSError."""
        with open(path, "rb") as f:
            size, head = _read_head(f)
        return size, self._check_header(block_hash, head, size, layers)

    def _load(self, block_hash: str) -> _Block | None:
        """Reads and verifies one SSD block; None (and the file gone) if it is missing or bad."""
        with self._lock:
            if block_hash not in self._cold:
                return None
        path = self.block_path(block_hash)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self._forget(block_hash)
            return None
        except OSError as e:
            log.warning("KV cache: cannot read %s (%s); treating it as a miss", path, e)
            self._forget(block_hash)
            return None
        try:
            info = self._check_header(block_hash, data, len(data))
            body = memoryview(data)[info.data_start :]
            if hashlib.sha256(body).hexdigest() != info.tensor_sha256:
                raise _BadFile("corrupt", "tensor bytes do not match their sha256")
        except _BadFile as e:
            self._reject(path, e, block_hash)
            return None
        arrays = {
            name: np.frombuffer(data, info.dtype.np, int(np.prod(shape)), info.data_start + s)
            .reshape(shape)
            for name, shape, s, _ in info.tensors
        }
        layers = range(self.layer_start, self.layer_end)
        return _Block(
            hash=block_hash,
            parent=info.parent,
            dtype=info.dtype,
            keys=[arrays[f"k.{i}"] for i in layers],
            values=[arrays[f"v.{i}"] for i in layers],
        )

    def _forget(self, block_hash: str) -> None:
        with self._lock:
            size = self._cold.pop(block_hash, None)
            if size is not None:
                self._cold_bytes -= size
        self._update_gauges()

    def _reject(self, path: Path, err: _BadFile, block_hash: str | None) -> None:
        log.warning("KV cache: removing %s file %s: %s", err.reason, path, err)
        self.metrics.ssd_rejected.labels(reason=err.reason).inc()
        if block_hash is not None:
            self._forget(block_hash)
        try:
            path.unlink()
        except OSError:
            pass  # a read-only dir: it stays out of the index, which is what matters

    def _rebuild_index(self) -> None:
        """Indexes the files of this (model, layer range) directory from their headers, least
        recently used first (by mtime: the writer touches files when they are used)."""
        assert self.dir is not None
        found: list[tuple[float, str, int]] = []
        now = time.time()
        for sub in self.dir.iterdir():
            if not sub.is_dir():
                continue
            for path in sub.iterdir():
                name = path.name
                try:
                    if name.endswith(".tmp"):
                        if now - path.stat().st_mtime > _STALE_TMP_SECONDS:
                            path.unlink()  # left by a writer that died mid-write
                        continue
                    if not name.endswith(".safetensors"):
                        continue  # not ours: leave it alone
                    h = name.removesuffix(".safetensors")
                    if not _HEX64.match(h) or sub.name != h[:2]:
                        raise _BadFile("foreign", "not named by a block hash")
                    size, _ = self._read_header(path, h)
                    found.append((path.stat().st_mtime, h, size))
                except _BadFile as e:
                    self._reject(path, e, None)
                except OSError as e:
                    log.warning("KV cache: cannot index %s: %s", path, e)
        found.sort()
        with self._lock:
            for _, h, size in found:
                self._cold[h] = size
                self._cold_bytes += size
            victims = self._evict_cold(0)
        self._unlink(victims)
        if found:
            log.info(
                "KV cache: %d blocks (%.1f MiB) on SSD at %s",
                len(self._cold), self._cold_bytes / MiB, self.dir,
            )

    # ---- sibling ranges (read-only) ---------------------------------------------------------

    def _prune_old_ranges(self) -> None:
        """Removes the least recently used range directories of this model that no running
        cache holds, beyond ssd_max_bytes for all of them together, and the empty ones (see the
        module docstring)."""
        assert self.dir is not None
        model_dir = self.dir.parent
        if not model_dir.is_dir():
            return
        old: list[tuple[float, int, Path]] = []
        for rdir in model_dir.iterdir():
            if rdir.name.startswith(_TRASH_PREFIX):  # a prune that died half-way
                shutil.rmtree(rdir, ignore_errors=True)
                continue
            if rdir == self.dir or not _RANGE_DIR.fullmatch(rdir.name) or not rdir.is_dir():
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
            if size and kept + size <= self.ssd_max_bytes:
                kept += size
                continue
            fd = _lock_range(rdir, exclusive=True)
            if fd is None:  # a running cache uses it
                kept += size
                continue
            try:
                trash = model_dir / f"{_TRASH_PREFIX}{uuid.uuid4().hex}"
                rdir.rename(trash)
            finally:
                os.close(fd)
            shutil.rmtree(trash, ignore_errors=True)
            log.info("KV cache: removed %s (%.1f MiB, layers a re-plan moved; the old ranges "
                     "of %s keep at most %.1f MiB)", rdir, size / MiB, model_dir.name,
                     self.ssd_max_bytes / MiB)

    def _index_siblings(self) -> None:
        """Indexes, from their headers, the block files of the other layer-range directories of
        this model directory that overlap this stage's layers. Truncated or corrupt files are
        removed (their owner would remove them too); foreign ones are skipped and left alone."""
        assert self.dir is not None
        model_dir = self.dir.parent
        if not model_dir.is_dir():
            return
        found: dict[str, list[_SiblingFile]] = {}
        n_dirs = skipped = 0
        for rdir in sorted(model_dir.iterdir()):
            m = _RANGE_DIR.fullmatch(rdir.name)
            if m is None or not rdir.is_dir():
                continue
            start, end = int(m[1]), int(m[2])
            if (start, end) == (self.layer_start, self.layer_end) or start >= end:
                continue
            if end <= self.layer_start or start >= self.layer_end:
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
                    if h == path.name or not _HEX64.match(h) or sub.name != h[:2]:
                        continue  # temp files and strangers are the owner's business
                    try:
                        _, info = self._read_header(path, h, (start, end))
                    except _BadFile as e:
                        skipped += not self._sibling_bad(path, e)
                        continue
                    except OSError as e:
                        log.warning("KV cache: cannot index sibling file %s: %s", path, e)
                        continue
                    found.setdefault(h, []).append(
                        _SiblingFile(path, start, end, info.dtype.name)
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

    def _sibling_bad(self, path: Path, err: _BadFile) -> bool:
        """A sibling file that failed a check: removed if it is broken for anyone (truncated,
        corrupt), left alone if it is only foreign to this cache. True if it was removed."""
        if err.reason == "foreign":
            log.debug("KV cache: skipping sibling file %s: %s", path, err)
            return False
        self._reject(path, err, None)
        return True

    def _sibling_plan(self, block_hash: str) -> list[tuple[_SiblingFile, int, int]] | None:
        """Lock held. Sibling files of one dtype whose ranges cover this stage's layers, each
        with the layers [lo, hi) to take from it; None if they do not cover them all."""
        files = self._sib.get(block_hash)
        if not files:
            return None
        want = self.dtype or (self._layout[0] if self._layout is not None else None)
        for dt in [want] if want is not None else sorted({f.dtype for f in files}):
            cands = [f for f in files if f.dtype == dt]
            plan: list[tuple[_SiblingFile, int, int]] = []
            pos = self.layer_start
            while pos < self.layer_end:
                # Greedy interval cover: the file reaching furthest, so the fewest files.
                best = max(
                    (f for f in cands if f.start <= pos < f.end), key=lambda f: f.end, default=None
                )
                if best is None:
                    break
                hi = min(best.end, self.layer_end)
                plan.append((best, pos, hi))
                pos = hi
            else:
                return plan
        return None

    def _drop_sibling(self, block_hash: str, file: _SiblingFile) -> None:
        with self._lock:
            files = self._sib.get(block_hash)
            if files is not None and file in files:
                files.remove(file)
                if not files:
                    del self._sib[block_hash]

    def _read_layers(
        self, file: _SiblingFile, block_hash: str, lo: int, hi: int
    ) -> tuple[_FileInfo, dict[str, np.ndarray]]:
        """Reads layers [lo, hi) of a sibling file: the header is checked, the whole tensor
        section is hashed against its sha256 (streamed, in file order) but only the wanted
        tensors are kept. Raises _BadFile or OSError."""
        wanted = set(self._tensor_order((lo, hi)))
        with open(file.path, "rb") as f:
            size, head = _read_head(f)
            info = self._check_header(block_hash, head, size, (file.start, file.end))
            if info.dtype.name != file.dtype:
                raise _BadFile("foreign", f"dtype {info.dtype.name}, indexed as {file.dtype}")
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
                        raise _BadFile("truncated", "the file ends inside its tensors")
                    got += k
                digest.update(buf)
                if arr is not None:
                    out[name] = arr
        if digest.hexdigest() != info.tensor_sha256:
            raise _BadFile("corrupt", "tensor bytes do not match their sha256")
        return info, out

    def _load_sibling(self, block_hash: str) -> _Block | None:
        """Assembles this stage's block from sibling files; None if they no longer cover its
        layers (a file vanished, went bad or turned out foreign: it leaves the index, and another
        cover is tried)."""
        while True:
            with self._lock:
                plan = self._sibling_plan(block_hash)
            if plan is None:
                return None
            arrays: dict[str, np.ndarray] = {}
            infos: list[_FileInfo] = []
            for file, lo, hi in plan:
                try:
                    info, got = self._read_layers(file, block_hash, lo, hi)
                except FileNotFoundError:
                    self._drop_sibling(block_hash, file)  # evicted by its owner: a miss
                    break
                except OSError as e:
                    log.warning("KV cache: cannot read sibling %s (%s); a miss", file.path, e)
                    self._drop_sibling(block_hash, file)
                    break
                except _BadFile as e:
                    self._sibling_bad(file.path, e)
                    self._drop_sibling(block_hash, file)
                    break
                infos.append(info)
                arrays.update(got)
            else:
                layers = range(self.layer_start, self.layer_end)
                block = _Block(
                    hash=block_hash,
                    parent=infos[0].parent,
                    dtype=infos[0].dtype,
                    keys=[arrays[f"k.{i}"] for i in layers],
                    values=[arrays[f"v.{i}"] for i in layers],
                )
                bad = None
                if any(i.parent != block.parent for i in infos):
                    bad = "its files disagree on the parent block"
                elif self._layout is not None and block.layout != self._layout:
                    bad = "its tensor shapes differ from this stage's KV"
                if bad is None:
                    return block
                # Which file is wrong cannot be told: none of them is used for this block again.
                log.warning("KV cache: not using sibling files of block %s: %s",
                            block_hash[:12], bad)
                for file, _, _ in plan:
                    self._drop_sibling(block_hash, file)
                return None

    def _evict_cold(self, incoming: int) -> list[str]:
        """Drops LRU entries until `incoming` more bytes fit under the cap (lock held)."""
        victims = []
        while self._cold and self._cold_bytes + incoming > self.ssd_max_bytes:
            h, size = self._cold.popitem(last=False)
            self._cold_bytes -= size
            victims.append(h)
        return victims

    def _unlink(self, victims: list[str]) -> None:
        for h in victims:
            try:
                self.block_path(h).unlink()
            except FileNotFoundError:
                pass
            except OSError as e:
                log.debug("KV cache: cannot remove %s: %s", h, e)
            self.metrics.evictions.labels(tier="ssd").inc()

    # ---- SSD tier: the writer thread -------------------------------------------------------

    def _enqueue(self, block: _Block) -> None:
        """Lock held. Drops the write rather than blocking the engine when the writer lags."""
        if self.dir is None:
            return
        if not self._ssd_writable:
            self.metrics.ssd_writes.labels(result="disabled").inc()
            return
        if self._queued_bytes + block.nbytes > self.write_queue_max_bytes:
            self.metrics.ssd_writes.labels(result="queue_full").inc()
            return
        self._queue.append(block)
        self._queued.add(block.hash)
        self._queued_bytes += block.nbytes
        self._cv.notify_all()

    def _writer_loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stop or self._queue or self._touched)
                if self._stop:
                    return
                block = self._queue.popleft() if self._queue else None
                touched, self._touched = self._touched, set()
                self._busy = True
            try:
                if block is not None:
                    self._write(block)
                if touched and self._ssd_writable:
                    self._save_recency(touched)
            except Exception:  # the writer must outlive any surprise; a lost block is a miss
                log.exception("KV cache: SSD writer failed")
            finally:
                with self._cv:
                    if block is not None and block.hash in self._queued:
                        self._queued.discard(block.hash)
                        self._queued_bytes -= block.nbytes
                    self._busy = False
                    self._cv.notify_all()

    def _write(self, block: _Block) -> None:
        if not self._ssd_writable:
            self.metrics.ssd_writes.labels(result="disabled").inc()
            return
        with self._lock:
            if block.hash in self._cold:
                return
        header, arrays = self._encode_block(block)
        size = len(header) + sum(a.nbytes for a in arrays)
        if size > self.ssd_max_bytes:
            self.metrics.ssd_writes.labels(result="too_large").inc()
            return
        if not self._space_for(size):
            self.metrics.ssd_writes.labels(result="low_space").inc()
            return
        with self._lock:
            victims = self._evict_cold(size)
        self._unlink(victims)
        path = self.block_path(block.hash)
        tmp = path.parent / f".{block.hash}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            path.parent.mkdir(exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(header)
                    for a in arrays:
                        f.write(memoryview(a).cast("B"))
                    f.flush()
                    os.fsync(f.fileno())
                # A reader sees the old state or the whole file, never a partial one.
                os.replace(tmp, path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
        except OSError as e:
            self.metrics.ssd_writes.labels(result="error").inc()
            self._degrade(e)
            return
        with self._lock:
            self._cold[block.hash] = size
            self._cold_bytes += size
        self.metrics.ssd_writes.labels(result="ok").inc()
        self._update_gauges()

    def _space_for(self, size: int) -> bool:
        """The disk guard: keeps max(1 GiB, 5 %) of the disk free (or ssd_min_free_bytes)."""
        try:
            usage = shutil.disk_usage(self.dir)
        except OSError:
            return True  # the write itself will tell
        reserve = self.ssd_min_free_bytes
        if reserve is None:
            reserve = max(GiB, int(usage.total * 0.05))
        if usage.free - size >= reserve:
            if self._low_space:
                log.info("KV cache: free space is back on %s; SSD writes resume", self.dir)
                self._low_space = False
            return True
        if not self._low_space:
            log.warning(
                "KV cache: %s has %.1f MiB free (reserve %.1f MiB); skipping SSD writes "
                "until space frees up", self.dir, usage.free / MiB, reserve / MiB,
            )
            self._low_space = True
        return False

    def _save_recency(self, hashes: set[str]) -> None:
        """mtime is the recency the index is rebuilt from after a restart."""
        now = time.time()
        for h in hashes:
            try:
                os.utime(self.block_path(h), (now, now))
            except OSError:
                pass

    def _degrade(self, err: OSError) -> None:
        """RAM-only from now on, with one warning: a full or read-only disk fails every write
        the same way, and per-block logs would flood."""
        with self._lock:
            if not self._ssd_writable:
                return
            self._ssd_writable = False
            for b in self._queue:
                self._queued.discard(b.hash)
                self._queued_bytes -= b.nbytes
            self._queue.clear()
        log.warning(
            "KV cache: cannot write to %s (%s); continuing with the RAM tier only "
            "(blocks already on disk are still read)", self.dir, err,
        )
        self._update_gauges()

    def _update_gauges(self) -> None:
        m = self.metrics
        with self._lock:
            m.bytes.labels(tier="ram").set(self._hot_bytes)
            m.blocks.labels(tier="ram").set(len(self._hot))
            m.bytes.labels(tier="ssd").set(self._cold_bytes)
            m.blocks.labels(tier="ssd").set(len(self._cold))
            m.ssd_enabled.set(1 if self._ssd_writable else 0)
