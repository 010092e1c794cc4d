"""The cold tier of a stage's KV prefix cache: block files on SSD, capped in bytes, LRU.

The files of one (model, layer range) live in `<ssd_dir>/<model dir>/<start>-<end>/`, each block
in `<first two hex digits of its hash>/<hash>.safetensors` (the format is in ssd_format.py).
Blocks are read (`load`) on the caller's threads. One writer thread does all the writing and
never touches MLX: it writes queued blocks (to a temp file, fsynced, then renamed into place, so
a reader never sees a partial file), evicts the least recently used files to stay under the byte
cap, and touches the files of used blocks, since mtime is the recency the index is rebuilt from
after a restart. Blocks wait for it in a queue of bounded bytes; one that does not fit is
dropped, never waited for.

Any OSError while writing (a full disk, a read-only directory) turns the SSD tier's writes off
with one warning: the cache goes on in RAM (and keeps reading the blocks already on disk). A
nearly full disk only pauses them: a free-space guard skips writes until space frees up.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections import OrderedDict, deque
from pathlib import Path

from omlx_node.kv_cache.blocks import Block, GiB, Layout, MiB
from omlx_node.kv_cache.metrics import KVCacheMetrics
from omlx_node.kv_cache.ssd_format import (
    HEX64,
    BadFile,
    Owner,
    decode_block,
    encode_block,
    read_header,
    remove_bad_file,
)

log = logging.getLogger(__name__)

_STALE_TMP_SECONDS = 600.0  # a younger temp file may belong to a writer still running


def model_dir_name(model_id: str) -> str:
    """A directory name for a model id: readable, plus a short hash so that ids which sanitise
    alike ("a/b", "a--b") never share a directory (they would delete each other's files)."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", model_id.replace("/", "--")).strip("._-")[:100]
    return f"{safe or 'model'}.{hashlib.sha256(model_id.encode()).hexdigest()[:8]}"


class SsdTier:
    """The block files of `owner`'s range directory `dir` (None: no SSD tier, which then holds
    nothing). `lock` is the cache's lock: it guards the index and the queue below, and methods
    said to need it are called with it held. The writer leaves `min_free_bytes` free on the disk
    (None: max(1 GiB, 5 %)), and at most `write_queue_max_bytes` of blocks wait for it."""

    def __init__(
        self,
        dir: Path | None,
        owner: Owner,
        lock: threading.RLock,
        metrics: KVCacheMetrics,
        *,
        max_bytes: int,
        min_free_bytes: int | None,
        write_queue_max_bytes: int,
    ):
        self.dir = dir
        self.owner = owner
        self.metrics = metrics
        self.max_bytes = max_bytes
        self.min_free_bytes = min_free_bytes
        self.write_queue_max_bytes = write_queue_max_bytes
        self._lock = lock
        self._cv = threading.Condition(lock)
        self.files: OrderedDict[str, int] = OrderedDict()  # hash -> file size, LRU first
        self.nbytes = 0
        self.queue: deque[Block] = deque()
        self._queued: set[str] = set()
        self._queued_bytes = 0
        self._busy = False
        # SSD blocks used since the writer last saved recency, least recently used first
        self._touched: dict[str, None] = {}
        self._stamp = 0  # the last mtime (ns) the writer gave a file
        self._stop = False
        self.writable = dir is not None
        self._low_space = False
        self._thread: threading.Thread | None = None
        if dir is not None:
            try:
                dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            except OSError as e:
                self._degrade(e)

    def start(self) -> None:
        """Starts the writer thread."""
        self._thread = threading.Thread(
            target=self._writer_loop,
            name=f"kv-writer-{self.owner.layer_start}-{self.owner.layer_end}",
            daemon=True,
        )
        self._thread.start()

    def __contains__(self, block_hash: str) -> bool:
        return block_hash in self.files

    def holds(self, block_hash: str) -> bool:
        """Lock held. On disk, or queued for it."""
        return block_hash in self.files or block_hash in self._queued

    def touch(self, block_hash: str) -> bool:
        """Lock held. Marks a block on disk as recently used (the writer saves that in its
        file's mtime); False if it is not on disk."""
        if block_hash not in self.files:
            return False
        self.files.move_to_end(block_hash)
        self._touched.pop(block_hash, None)
        self._touched[block_hash] = None
        self._cv.notify_all()
        return True

    def block_path(self, block_hash: str) -> Path:
        if self.dir is None:
            raise ValueError("this cache has no SSD tier")
        return self.dir / block_hash[:2] / f"{block_hash}.safetensors"

    def flush(self, timeout: float) -> bool:
        """Waits until the writer has nothing queued (writes and recency updates); False if
        `timeout` passed first."""
        if self._thread is None:
            return True
        with self._cv:
            return self._cv.wait_for(
                lambda: not self.queue and not self._touched and not self._busy, timeout
            )

    def close(self, timeout: float) -> None:
        """Writes what is queued (waiting at most `timeout`), then stops the writer thread."""
        if self._thread is not None:
            self.flush(timeout)
            with self._cv:
                self._stop = True
                self._cv.notify_all()
            self._thread.join(timeout)
            self._thread = None

    # ---- reading -----------------------------------------------------------------------------

    def load(self, block_hash: str, layout: Layout | None) -> Block | None:
        """Reads and verifies one SSD block (against the stage's KV `layout`, once known); None
        (and the file gone) if it is missing or bad."""
        with self._lock:
            if block_hash not in self.files:
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
            return decode_block(self.owner, block_hash, data, layout)
        except BadFile as e:
            self._forget(block_hash)
            remove_bad_file(path, e, self.metrics)
            return None

    def _forget(self, block_hash: str) -> None:
        with self._lock:
            size = self.files.pop(block_hash, None)
            if size is not None:
                self.nbytes -= size
        self.update_gauges()

    def rebuild_index(self) -> None:
        """Indexes the files of this (model, layer range) directory from their headers, least
        recently used first (by mtime: the writer touches files when they are used)."""
        assert self.dir is not None
        found: list[tuple[int, str, int]] = []
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
                    if not HEX64.match(h) or sub.name != h[:2]:
                        raise BadFile("foreign", "not named by a block hash")
                    size, _ = read_header(self.owner, path, h)
                    found.append((path.stat().st_mtime_ns, h, size))
                except BadFile as e:
                    remove_bad_file(path, e, self.metrics)
                except OSError as e:
                    log.warning("KV cache: cannot index %s: %s", path, e)
        found.sort()
        with self._lock:
            for _, h, size in found:
                self.files[h] = size
                self.nbytes += size
            victims = self._evict(0)
        self._unlink(victims)
        if found:
            log.info(
                "KV cache: %d blocks (%.1f MiB) on SSD at %s",
                len(self.files), self.nbytes / MiB, self.dir,
            )

    # ---- the byte cap ------------------------------------------------------------------------

    def _evict(self, incoming: int, disk_short: int = 0) -> list[str]:
        """Drops LRU entries until `incoming` more bytes fit under the cap and `disk_short`
        bytes are freed for the disk's reserve (lock held)."""
        victims, freed = [], 0
        while self.files and (self.nbytes + incoming > self.max_bytes or freed < disk_short):
            h, size = self.files.popitem(last=False)
            self.nbytes -= size
            freed += size
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

    # ---- the writer thread -------------------------------------------------------------------

    def enqueue(self, blocks: list[Block]) -> None:
        """Lock held. Queues consecutive blocks of one chain for writing, or the leading ones
        that fit: the writer lagging drops writes rather than blocking the engine. They are
        queued last block first, so the chain's first block is the most recently used file and
        the cap evicts a chain from its end (the prefix left is still one a prompt can use)."""
        if self.dir is None or not blocks:
            return
        if not self.writable:
            self.metrics.ssd_writes.labels(result="disabled").inc(len(blocks))
            return
        room, n = self.write_queue_max_bytes - self._queued_bytes, 0
        while n < len(blocks) and blocks[n].nbytes <= room:
            room -= blocks[n].nbytes
            n += 1
        if n < len(blocks):
            self.metrics.ssd_writes.labels(result="queue_full").inc(len(blocks) - n)
        for block in reversed(blocks[:n]):
            self.queue.append(block)
            self._queued.add(block.hash)
            self._queued_bytes += block.nbytes
        if n:
            self._cv.notify_all()

    def _writer_loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stop or self.queue or self._touched)
                if self._stop:
                    return
                block = self.queue.popleft() if self.queue else None
                touched, self._touched = self._touched, {}
                self._busy = True
            try:
                if block is not None:
                    self._write(block)
                if touched and self.writable:
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

    def _write(self, block: Block) -> None:
        if not self.writable:
            self.metrics.ssd_writes.labels(result="disabled").inc()
            return
        with self._lock:
            if block.hash in self.files:
                return
        header, arrays = encode_block(self.owner, block)
        size = len(header) + sum(a.nbytes for a in arrays)
        if size > self.max_bytes:
            self.metrics.ssd_writes.labels(result="too_large").inc()
            return
        short = self._disk_short(size)
        with self._lock:
            # A disk filled by others: the cache's own oldest blocks make room for its newest,
            # rather than its content freezing until something else frees space.
            fits = short <= self.nbytes
            victims = self._evict(size, short) if fits else []
        if not self._low_space_now(not fits, short):
            self.metrics.ssd_writes.labels(result="low_space").inc()
            return
        self._unlink(victims)
        path = self.block_path(block.hash)
        tmp = path.parent / f".{block.hash}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            path.parent.mkdir(mode=0o700, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(header)
                    for a in arrays:
                        f.write(memoryview(a).cast("B"))
                    f.flush()
                    os.fsync(f.fileno())
                os.utime(tmp, ns=self._next_stamp())
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
            self.files[block.hash] = size
            self.nbytes += size
        self.metrics.ssd_writes.labels(result="ok").inc()
        self.update_gauges()

    def _disk_short(self, size: int) -> int:
        """The bytes to free for `size` more to leave the disk guard's reserve free: max(1 GiB,
        5 %) of the disk, or min_free_bytes."""
        try:
            usage = shutil.disk_usage(self.dir)
        except OSError:
            return 0  # the write itself will tell
        reserve = self.min_free_bytes
        if reserve is None:
            reserve = max(GiB, int(usage.total * 0.05))
        return max(0, reserve - (usage.free - size))

    def _low_space_now(self, low: bool, short: int) -> bool:
        """Says (once) when writes stop for want of space, and when they resume; whether to
        write."""
        if low and not self._low_space:
            log.warning(
                "KV cache: %s is %.1f MiB short of its free-space reserve, more than the "
                "cache's own %.1f MiB; skipping SSD writes until space frees up", self.dir,
                short / MiB, self.nbytes / MiB,
            )
        elif not low and self._low_space:
            log.info("KV cache: free space is back on %s; SSD writes resume", self.dir)
        self._low_space = low
        return not low

    def _save_recency(self, hashes: dict[str, None]) -> None:
        """mtime is the recency the index is rebuilt from after a restart."""
        for h in hashes:
            try:
                os.utime(self.block_path(h), ns=self._next_stamp())
            except OSError:
                pass

    def _next_stamp(self) -> tuple[int, int]:
        """A strictly later (atime, mtime) in ns than the writer gave before: the blocks of one
        prompt are written and used in one burst, faster than the clock ticks, and their order
        (a chain's last block least recently used) must survive a restart."""
        self._stamp = max(time.time_ns(), self._stamp + 1)
        return self._stamp, self._stamp

    def _degrade(self, err: OSError) -> None:
        """RAM-only from now on, with one warning: a full or read-only disk fails every write
        the same way, and per-block logs would flood."""
        with self._lock:
            if not self.writable:
                return
            self.writable = False
            for b in self.queue:
                self._queued.discard(b.hash)
                self._queued_bytes -= b.nbytes
            self.queue.clear()
        log.warning(
            "KV cache: cannot write to %s (%s); continuing with the RAM tier only "
            "(blocks already on disk are still read)", self.dir, err,
        )
        self.update_gauges()

    def update_gauges(self) -> None:
        m = self.metrics
        with self._lock:
            m.bytes.labels(tier="ssd").set(self.nbytes)
            m.blocks.labels(tier="ssd").set(len(self.files))
            m.ssd_enabled.set(1 if self.writable else 0)
