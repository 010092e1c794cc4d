"""The device-to-host copies of a stage's stored blocks, on one background thread.

`PrefixCache.store` runs on the engine thread between a prompt's prefill and its first token. The
blocks it keeps must reach host memory (the RAM tier holds numpy arrays, the SSD writer writes
them), and on a GPU that copy, through unified memory, is the slow part: for a large model's
long prompt it takes longer than the prefill that produced the blocks. So the engine
thread only cuts the blocks out on the device (`blocks.cut_spans`, evaluated there) and hands
them over; this thread copies them to numpy and gives the host blocks to the cache.

MLX stays the engine thread's: this thread never runs an MLX op, it only reads the memory of
arrays the engine thread evaluated (`mx.eval`, so they are complete before they are handed over).
Nor does an MLX array die here: the engine thread keeps a reference to every handed-over cut
until this thread is done with it, and drops it in `reap` (an array whose last reference goes
away on a thread is freed on that thread).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from omlx_node.kv_cache.blocks import Block, DType, Spans, host_blocks

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Cut:
    """Blocks `todo` (indexes into `hashes`) of one store, as `blocks.cut_spans` cut them."""

    hashes: list[str]
    todo: list[int]
    spans: Spans
    dtype: DType
    block_size: int


class HostCopier:
    """Copies cuts to host blocks in the order they come, and hands each cut's blocks to
    `keep(cut, blocks)` (on this thread; `blocks` is None when the copy failed)."""

    def __init__(self, keep: Callable[[Cut, list[Block] | None], None]):
        self._keep = keep
        self._cv = threading.Condition()
        self._queue: deque[Cut] = deque()  # guarded by _cv; this thread's references
        self._handed = 0  # cuts submitted, guarded by _cv
        self._copied = 0  # cuts this thread is done with, guarded by _cv
        self._stop = False
        self._held: deque[Cut] = deque()  # the engine thread's references, oldest first
        self._reaped = 0  # the engine thread's
        self._thread = threading.Thread(target=self._loop, name="kv-host-copy", daemon=True)
        self._thread.start()

    def submit(self, cut: Cut) -> None:
        """Engine thread: hands over a cut whose spans are evaluated."""
        self.reap()
        self._held.append(cut)
        with self._cv:
            self._queue.append(cut)
            self._handed += 1
            self._cv.notify_all()

    def reap(self) -> None:
        """Engine thread: drops the cuts this thread is done with, so they are freed here."""
        with self._cv:
            done = self._copied
        while self._reaped < done:
            self._held.popleft()
            self._reaped += 1

    @property
    def holding(self) -> bool:
        """Engine thread: whether it still references a cut (copied or not)."""
        return bool(self._held)

    def settle(self, timeout: float | None = None) -> bool:
        """Waits until every cut submitted so far is kept (any thread); False on a timeout."""
        with self._cv:
            target = self._handed
            return self._cv.wait_for(lambda: self._copied >= target, timeout)

    def close(self, timeout: float) -> None:
        """Copies what is submitted (waiting at most `timeout`), then stops the thread."""
        self.settle(timeout)
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout)
        self.reap()

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stop or self._queue)
                if not self._queue:
                    return
                cut = self._queue.popleft()
            self._copy(cut)
            del cut  # before it counts as copied: the engine thread may drop its own then
            with self._cv:
                self._copied += 1
                self._cv.notify_all()

    def _copy(self, cut: Cut) -> None:
        try:
            self._keep(cut, host_blocks(cut.spans, cut.hashes, cut.todo, cut.block_size,
                                        cut.dtype))
        except Exception:  # a lost store costs a later prefill, never the engine
            log.exception("KV cache: keeping %d stored blocks failed", len(cut.todo))
            self._keep(cut, None)
