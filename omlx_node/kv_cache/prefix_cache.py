"""Tiered KV prefix cache of one stage: the latest prompts' blocks on the device, hot blocks in
RAM, cold blocks on SSD.

A prompt is cut into blocks of `block_size` tokens, each named by a hash chain that stands for
the whole prefix up to its end (blocks.py), and a block holds the keys and values of this stage's
layers for its tokens. `PrefixCache` composes the device tier (device_tier.py: on by default
only where the device has memory of its own), the RAM tier (ram_tier.py), the SSD tier
(ssd_tier.py, its files as ssd_format.py says) and the blocks that other layer ranges of the same
model left on the same disk (siblings.py).

How the batcher uses it (all on the engine thread):

    n = cache.lookup(prompt[:-1])              # tokens whose KV is held (blocks, then a tail)
    kv = cache.restore(prompt[:-1], n)         # fresh mlx-lm KVCaches, one per layer
    done = kv[0].offset                         # == n unless a file went bad in between
    ... prefill prompt[done:-1] into kv, a chunk at a time; after each chunk:
    cache.store(prompt[:end], kv)               # keeps the full blocks not held yet

Threads: lookup, restore and store run on the caller's (engine) thread and take a lock only to
touch the indexes. `store` runs the MLX ops (cutting the new blocks out on the device, evaluated)
and returns: it sits between a prompt's prefill and its first token, and the copy to host memory,
slow on a GPU, is the copier thread's (host_copy.py), which never runs MLX ops and never frees an
MLX array. One writer thread does all file I/O and never touches MLX. A block on its way to host
memory counts as held: `lookup` counts it, `restore` waits for it, and `stats`, `flush` and the
hash lists wait for every store made before them, so readers see the cache as if `store` had
copied synchronously. The RAM tier keeps the host arrays, and the write queue shares them (no
second copy waits for the disk); a restore concatenates them and copies the result into MLX once.

Tails: an agent re-sends its conversation each turn, and the prompt's last partial block and
the end of the model's answer are not a whole block. When a store's cache holds all of its tokens
(the end of a prompt's prefill, or a finished answer), the tokens past its last full block (fewer
than block_size) are kept as a tail: a block of its own length named by `tail_hash` (its parent
block and its tokens), in the RAM and SSD tiers like any block (not the device tier, and not
assembled from sibling ranges). A lookup that ends its chain at block n then looks for the
longest tail after it that the prompt starts with, so a re-sent turn is reused to its last token.

Every tier evicts least recently used first, and a chain's blocks are marked used last block
first (`_mark_used`): what a tier evicts is the end of a chain, so what it keeps is always a
prefix some prompt can reach, even of a prompt larger than the tier.

Across stages the head takes the minimum of every stage's `lookup`. A block can still vanish
between `lookup` and `restore` (a corrupt file, or an eviction by the writer when the SSD tier is
tiny), so the caller must use the restored offset, not the looked-up count.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from mlx_lm.models.cache import KVCache
from prometheus_client import CollectorRegistry

from omlx_node.kv_cache.blocks import (
    BY_MX,
    BY_NAME,
    Block,
    DeviceSpan,
    GiB,
    Layout,
    build_caches,
    cache_layout,
    cut_range,
    cut_spans,
    held_tokens,
    span_layout,
    with_tokens,
)
from omlx_node.kv_cache.device_tier import DeviceTier
from omlx_node.kv_cache.host_copy import Cut, HostCopier
from omlx_node.kv_cache.metrics import KVCacheMetrics
from omlx_node.kv_cache.ram_tier import RamTier
from omlx_node.kv_cache.siblings import Siblings, hold_range, prune_old_ranges
from omlx_node.kv_cache.ssd_format import Owner
from omlx_node.kv_cache.ssd_tier import SsdTier, model_dir_name
from omlx_shared.block_hashes import block_hashes, tail_hash

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheStats:
    hot_blocks: int
    hot_bytes: int
    ssd_blocks: int
    ssd_bytes: int
    queued_blocks: int
    ssd_writable: bool
    sibling_files: int = 0  # indexed files of other layer ranges (see siblings.py)


class PrefixCache:
    """The KV prefix cache of the stage holding layers [layer_range[0], layer_range[1]).

    `model_id` names the weights, not just the model: blocks of another revision or quantization
    stored under the same id would be wrong answers, so include whatever tells them apart.
    `hot_max_bytes` caps the RAM tier, `ssd_max_bytes` the files under `ssd_dir` (None: RAM
    only), `device_max_bytes` the device tier (0: none; see device_tier.default_max_bytes).
    `dtype` ("float32", "bfloat16", ...: the stage's compute dtype) makes files of another
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
        device_max_bytes: int = 0,
        layout: Layout | None = None,
    ):
        start, end = layer_range
        if not 0 <= start < end:
            raise ValueError(f"bad layer range {layer_range}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if dtype is not None and dtype not in BY_NAME:
            raise ValueError(f"unsupported KV dtype {dtype!r}; one of {sorted(BY_NAME)}")
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
        # The stage's blocks' layout: given (blocks.cache_layout), so that a block on disk of
        # another layout is a miss from the first lookup on, or learned in store().
        self._layout: Layout | None = layout
        self._copying: set[str] = set()  # blocks stored but still on their way to host memory
        self._copier = HostCopier(self._keep)
        self.dir: Path | None = None
        if ssd_dir is not None:
            self.dir = Path(ssd_dir) / model_dir_name(model_id) / f"{start}-{end}"
        owner = Owner(model_id, start, end, block_size, dtype)
        self._device = DeviceTier(device_max_bytes, self.metrics)
        self._ram = RamTier(hot_max_bytes, self.metrics)
        self._ssd = SsdTier(
            self.dir, owner, self._lock, self.metrics, max_bytes=ssd_max_bytes,
            min_free_bytes=ssd_min_free_bytes, write_queue_max_bytes=write_queue_max_bytes,
        )
        self._siblings = Siblings(owner, self._lock, self.metrics)
        self.metrics.hits.labels(tier="sibling")
        self._live_fd: int | None = None  # the shared lock on this range's directory

        if self.dir is not None:
            if self.dir.is_dir():
                self._live_fd = hold_range(self.dir)
                try:
                    self._ssd.rebuild_index()
                except OSError as e:  # an unreadable dir costs its blocks, not the node
                    log.warning("KV cache: cannot index %s: %s", self.dir, e)
            try:
                prune_old_ranges(self.dir, ssd_max_bytes)
            except OSError as e:
                log.warning("KV cache: cannot prune the old ranges next to %s: %s", self.dir, e)
            try:
                self._siblings.index(self.dir.parent)
            except OSError as e:
                log.warning("KV cache: cannot index the siblings of %s: %s", self.dir, e)
            self._ssd.start()
        self._update_gauges()

    # ---- public API ------------------------------------------------------------------------

    def lookup(self, tokens: Sequence[int], restoring: bool = True) -> int:
        """How many leading tokens either tier holds (or sibling layer ranges hold together, see
        siblings.py), as one unbroken chain from the first block, then the longest tail after
        it. Pass prompt[:-1]: the last prompt token must still be run.
        Marks the blocks found as recently used, so they outlive the step until `restore`;
        `restoring=False` (a look ahead, e.g. to order waiting prompts) neither marks them nor
        counts as a lookup in the hit metrics."""
        self._copier.reap()
        hashes = block_hashes(self.model_id, tokens, self.block_size)
        n = 0
        with self._lock:
            for h in hashes:
                if (not (h in self._ram or h in self._ssd or h in self._copying
                         or h in self._device)
                        and self._siblings.plan(h, self._layout) is None):
                    break
                n += 1
            tail = self._find_tail(tokens, hashes[:n])
            if not restoring:
                return n * self.block_size + (tail[1] if tail else 0)
            self._mark_used(hashes[:n] + ([tail[0]] if tail else []))
        self.metrics.lookups.inc()
        self.metrics.misses.inc(len(hashes) - n)
        return n * self.block_size + (tail[1] if tail else 0)

    def _find_tail(self, tokens: Sequence[int], chain: list[str]) -> tuple[str, int] | None:
        """Lock held. The longest tail held after the blocks `chain` that `tokens` go on with:
        (its name, its tokens), or None."""
        at = len(chain) * self.block_size
        parent = chain[-1] if chain else ""
        for k in range(min(self.block_size - 1, len(tokens) - at), 0, -1):
            h = tail_hash(self.model_id, parent, tokens[at : at + k])
            if h in self._ram or h in self._ssd or h in self._copying:
                return h, k
        return None

    def restore(self, tokens: Sequence[int], n_tokens: int) -> list[KVCache]:
        """One fresh KVCache per layer of the stage, holding the KV of tokens[:n_tokens] (rounded
        down to whole blocks). Blocks only on SSD are read, checked and promoted to RAM; blocks
        only sibling ranges hold are assembled from their files, promoted and queued for this
        range's own directory. A block that went missing or bad since `lookup` ends the prefix
        early: the caches then hold fewer tokens, so read the count from `caches[0].offset`,
        never assume n_tokens. Past the whole blocks, the tail of exactly the rest (`lookup`
        counts it) if every block came back."""
        t0 = time.perf_counter()
        n_tokens = max(0, min(n_tokens, len(tokens)))
        n_blocks = n_tokens // self.block_size
        hashes = block_hashes(self.model_id, tokens[: n_blocks * self.block_size], self.block_size)
        rest = n_tokens - n_blocks * self.block_size
        tail = (tail_hash(self.model_id, hashes[-1] if hashes else "",
                          tokens[n_tokens - rest : n_tokens]) if rest else None)
        on_host = [h for h in hashes if h not in self._device] + ([tail] if tail else [])
        with self._lock:
            copying = not self._copying.isdisjoint(on_host)
        if copying:
            self._copier.settle()  # a copy in flight ends well before a prefill would
        self._copier.reap()
        with self._lock:
            on_disk = [h for h in on_host if h not in self._ram and h in self._ssd]
        # Reading and checking SSD blocks releases the GIL (file reads, sha256): overlap them.
        loads = {h: self._readers.submit(self._ssd.load, h, self._layout_of(h, tail, rest))
                 for h in on_disk}
        blocks: list[Block | DeviceSpan] = []
        try:
            self._restore_blocks(hashes, loads, blocks)
            if tail and len(blocks) == len(hashes):
                self._restore_tail(tail, rest, loads, blocks)
        finally:
            for f in loads.values():
                f.cancel()
        with self._lock:  # blocks read from SSD or siblings are promoted to RAM here
            self._mark_used((hashes + [tail])[: len(blocks)],
                            {b.hash: b for b in blocks if isinstance(b, Block)})
        caches = build_caches(blocks, self.n_layers, self.block_size)
        self.last_restore_seconds = time.perf_counter() - t0
        if hashes:
            self.metrics.restore_seconds.observe(self.last_restore_seconds)
        self._update_gauges()
        return caches

    def _layout_of(self, h: str, tail: str | None, rest: int) -> Layout | None:
        """The layout block (or tail) `h` must have."""
        if h == tail and self._layout is not None:
            return with_tokens(self._layout, rest)
        return self._layout

    def _restore_tail(self, tail: str, rest: int, loads: dict,
                      blocks: list[Block | DeviceSpan]) -> None:
        """Appends to `blocks` the tail `tail` of `rest` tokens, from RAM or SSD, if held."""
        with self._lock:
            block = self._ram.get(tail)
        tier = "ram"
        if block is None:
            tier = "ssd"
            block = (loads[tail].result() if tail in loads
                     else self._ssd.load(tail, self._layout_of(tail, tail, rest)))
        first = next((b.layout for b in blocks if isinstance(b, Block)), None)
        if block is None or block.tokens != rest or (
                first is not None and block.layout != with_tokens(first, rest)):
            return
        blocks.append(block)
        self.metrics.hits.labels(tier=tier).inc()

    def _restore_blocks(self, hashes: list[str], loads: dict,
                        blocks: list[Block | DeviceSpan]) -> None:
        """Appends to `blocks` the unbroken chain of `hashes` that can be restored."""
        for h in hashes:
            tier = "ram"
            with self._lock:
                block = self._ram.get(h)
            span = self._device.span(h)
            if span is not None:
                blocks.append(span)
                self.metrics.hits.labels(tier="device").inc()
                continue
            if block is None:
                tier = "ssd"
                block = loads[h].result() if h in loads else self._ssd.load(h, self._layout)
                if block is None:
                    tier = "sibling"
                    block = self._siblings.load(h, self._layout)
                    if block is None:
                        break
            first = next((b.layout for b in blocks if isinstance(b, Block)), None)
            if first is not None and block.layout != first:
                log.warning("KV cache: block %s does not match its prefix's layout", h[:12])
                break
            if tier == "sibling":
                with self._lock:
                    if not self._ssd.holds(h):
                        self._ssd.enqueue([block])  # it becomes an ordinary block of this range
            blocks.append(block)
            self.metrics.hits.labels(tier=tier).inc()

    def store(self, tokens: Sequence[int], cache: Sequence[KVCache]) -> None:
        """Keeps every full block of `tokens` whose KV `cache` holds (one KVCache, or a
        sliding-window RotatingKVCache, per layer of the stage, batch of one) and that no tier
        holds yet: in RAM once the copier thread has it in host memory (it counts as held from
        now on), on SSD later (the writer thread). On this thread only the device work: it never
        waits for a host copy or the disk. A block some sliding-window layer no longer holds is
        not kept."""
        if len(cache) != self.n_layers:
            raise ValueError(
                f"expected {self.n_layers} layer caches for layers "
                f"[{self.layer_start}, {self.layer_end}), got {len(cache)}"
            )
        if any(c.keys is None for c in cache):
            return
        start, held = held_tokens(cache)
        n_blocks = min(len(tokens), held) // self.block_size
        first = -(-start // self.block_size)  # the first block every layer still holds whole
        hashes = block_hashes(self.model_id, tokens[: n_blocks * self.block_size], self.block_size)
        # The tail only once the cache holds every token (a prompt's prefill done, an answer
        # finished): the tails of a prompt's chunks along the way would never be asked for.
        rest = len(tokens) - n_blocks * self.block_size if held >= len(tokens) else 0
        tail = (tail_hash(self.model_id, hashes[-1] if hashes else "", tokens[-rest:])
                if rest and start <= len(tokens) - rest else None)
        with self._lock:
            todo = [
                i for i, h in enumerate(hashes)
                if i >= first and not self._holds(h)
            ]
            if tail is not None and self._holds(tail):
                tail = None
        if not (todo or tail):
            return
        dt = BY_MX.get(cache[0].keys.dtype)
        if dt is None:
            raise TypeError(f"KV dtype {cache[0].keys.dtype} is not supported by the prefix cache")
        if self.dtype is not None and dt.name != self.dtype:
            raise ValueError(f"KV dtype {dt.name} differs from the cache's declared {self.dtype}")
        if cache[0].keys.shape[0] != 1:
            raise ValueError("store() takes one sequence's cache (batch size 1)")

        spans = cut_spans(cache, todo, self.block_size, dt) if todo else None
        layout = (span_layout(spans, dt, self.block_size) if spans
                  else cache_layout(cache, self.block_size))
        with self._lock:
            if self._layout != layout:
                if self._layout is not None:
                    log.warning("KV cache: the stage's KV layout changed; dropping RAM blocks")
                    self._ram.drop_other_layouts(layout)
                    self._device.clear()
                    # Copies in flight are of the old layout, which _keep drops as they land:
                    # a lookup meanwhile must not count them as held.
                    self._copying.clear()
                self._layout = layout
            self._copying.update(hashes[i] for i in todo)
            if tail is not None:
                self._copying.add(tail)
        if tail is not None:  # a cut of one block of `rest` tokens whose parent is hashes[-1]
            self._copier.submit(Cut([hashes[-1] if hashes else "", tail], [1],
                                    cut_range(cache, len(tokens) - rest, len(tokens), dt), dt,
                                    rest))
        if not todo:
            return
        self._copier.submit(Cut(hashes, todo, spans, dt, self.block_size))
        if self._device.max_bytes > 0:  # a cut of its own: the copier's moves to the host
            self._device.keep(hashes, todo[0], todo[-1] + 1,
                              cut_spans(cache, todo, self.block_size, dt), dt)
            self._device.update_gauges()

    def _holds(self, h: str) -> bool:
        """Lock held. Whether a block (or tail) is kept or on its way to being kept."""
        return h in self._ram or self._ssd.holds(h) or h in self._copying

    def _mark_used(self, hashes: list[str], promote: dict[str, Block] | None = None) -> None:
        """Lock held. Marks a chain's blocks as recently used in every tier, its last block
        first: each tier's LRU then evicts a chain from its end, and what it keeps is a prefix a
        later prompt can still use (first block first would leave an unreachable tail, and one
        prompt larger than a tier would keep none of its prefix). `promote`: blocks (by hash) to
        put in RAM, restored from SSD or siblings."""
        self._ram.mark_chain(hashes, promote)
        for h in reversed(hashes):
            self._ssd.touch(h)
        self._device.mark_chain(hashes)

    def _keep(self, cut: Cut, blocks: list[Block] | None) -> None:
        """The copier thread's: the host copies of a cut's blocks go into the tiers."""
        with self._lock:
            self._copying.difference_update(cut.hashes[i] for i in cut.todo)
            # Blocks of a layout the stage left while they were copied would never be used.
            blocks = [b for b in blocks or [] if self._layout is not None
                      and b.layout == with_tokens(self._layout, b.tokens)]
            self._ram.mark_chain(cut.hashes, {b.hash: b for b in blocks})
            self._ssd.enqueue(blocks)
        self.metrics.stored.inc(len(blocks))
        self._update_gauges()

    def release_device_copies(self, timeout: float = 1.0) -> None:
        """Engine thread, once its stage holds no sequence: waits for the host copies in
        flight (at most `timeout`; they end well before a next prompt's prefill would) and drops
        the device arrays they were made from. Otherwise the last prompts' blocks would stay on
        the device until the next request's lookup."""
        if self._copier.holding:
            self._copier.settle(timeout)
            self._copier.reap()

    def flush(self, timeout: float = 10.0) -> bool:
        """Waits until the writer has nothing queued (writes and recency updates); False if
        `timeout` passed first."""
        deadline = time.monotonic() + timeout
        return (self._copier.settle(timeout)
                and self._ssd.flush(max(0.0, deadline - time.monotonic())))

    def close(self, timeout: float = 10.0) -> None:
        """Writes what is queued (waiting at most `timeout`), then stops the writer thread and
        lets go of the range directory (a later cache may prune it)."""
        self._readers.shutdown(wait=False, cancel_futures=True)
        self._copier.close(timeout)
        self._ssd.close(timeout)
        if self._live_fd is not None:
            os.close(self._live_fd)
            self._live_fd = None

    def __enter__(self) -> PrefixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> CacheStats:
        """What the tiers hold, every block stored so far counted where it went."""
        self._copier.settle()
        with self._lock:
            return CacheStats(
                hot_blocks=len(self._ram.blocks),
                hot_bytes=self._ram.nbytes,
                ssd_blocks=len(self._ssd.files),
                ssd_bytes=self._ssd.nbytes,
                queued_blocks=len(self._ssd.queue),
                ssd_writable=self._ssd.writable,
                sibling_files=self._siblings.count(),
            )

    def hot_hashes(self) -> list[str]:
        """RAM blocks, least recently used first."""
        self._copier.settle()
        with self._lock:
            return list(self._ram.blocks)

    def ssd_hashes(self) -> list[str]:
        """SSD blocks, least recently used first."""
        self._copier.settle()
        with self._lock:
            return list(self._ssd.files)

    def block_path(self, block_hash: str) -> Path:
        return self._ssd.block_path(block_hash)

    def _update_gauges(self) -> None:
        self._device.update_gauges()
        with self._lock:
            self._ram.update_gauges()
            self._ssd.update_gauges()
