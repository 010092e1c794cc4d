"""The KV caches a stage keeps for its sequences: one per prefilling sequence, one batch cache per
micro-batch, and what moves between them and the prefix cache."""

from __future__ import annotations

import logging
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from omlx_node.kv_cache import PrefixCache
from omlx_node.metrics import StageProfile
from omlx_node.stage import StageRunner

log = logging.getLogger(__name__)

# MLX keeps the buffers a step frees, for its next steps, and gives none back unasked: after a
# long prompt's chunks that is their activations (GBs for an 8B model on a GPU) held on a device
# that others share (another model's worker on the node, and on a Mac the system itself), and a
# second MLX process's allocations then fail; so do a finished request's KV buffers. mlx-lm
# empties its cache after every prefill chunk and every 256 decode steps; so does each stage
# here, and once it holds no sequence.
CLEAR_CACHE_STEPS = 256

def _row(cache: KVCache, r: int) -> KVCache:
    """Row `r` of a batch's KVCache, as a one-row KVCache of its own."""
    keys, values = cache.keys_and_values()
    out = KVCache()
    out.state = (keys[r:r + 1], values[r:r + 1], cache.offset)
    return out


def _row_view(cache: KVCache | BatchKVCache, r: int) -> KVCache:
    """Row `r` of a micro-batch's layer cache as a one-row KVCache over the same buffer, its
    left padding cut off: a slice, so a store copies only the blocks it keeps of it."""
    if not isinstance(cache, BatchKVCache):
        return cache  # a micro-batch of one row keeps its plain cache
    pad = cache.left_padding[r].item()
    out = KVCache()
    out.keys = cache.keys[r:r + 1, :, pad:cache._idx]
    out.values = cache.values[r:r + 1, :, pad:cache._idx]
    out.offset = cache._idx - pad
    return out


class StageState:
    """The KV caches of one stage: one per prefilling sequence, one batch cache per micro-batch.

    Every stage of a pipeline applies the same operations in the same order, so the rows of a
    micro-batch line up across stages without ever being named on the wire after admission."""

    def __init__(self, stage: StageRunner, profile: StageProfile,
                 prefix_cache: PrefixCache | None = None, defer_stores: bool = False):
        """`profile` times (some of) the steps this stage's layers run. `defer_stores`: the
        prefix cache keeps a prompt's blocks only when `flush_stores` says so (an engine does
        once the prompt's first token is out), where the caches allow it."""
        self.stage = stage
        self.profile = profile
        if prefix_cache is not None and stage.prefix_cache_off:
            log.info("prefix cache off: %s", stage.prefix_cache_off)
            prefix_cache = None
        self.prefix_cache = prefix_cache
        # Several sequences' equal-length chunks can share one forward pass when every layer
        # keeps a plain KVCache: B rows at one offset are B independent batch-of-one caches,
        # split back along the batch axis. Other caches (windows, recurrent state) go one by one.
        self.batchable = all(type(c) is KVCache for c in stage.make_cache())
        self.prefilling: dict[int, list[KVCache]] = {}
        self.caches: dict[int, list[BatchKVCache]] = {}
        self.rows: dict[int, list[int]] = {}
        self.tokens: dict[int, list[int]] = {}  # what each prefilling sequence will store
        # On a GPU, a store's copy to host memory slows the device's next steps, a prompt's
        # first token among them (bench/results/kv-device-h200.md). Plain KVCaches keep every
        # block they stored, so the store can wait until the first token is out; a sliding
        # window may drop blocks by then, so it cannot.
        self.defer_stores = defer_stores and self.batchable
        self.deferred: dict[int, tuple[list[int], list[KVCache]]] = {}
        self._decodes = 0  # decode steps since MLX's buffer cache was last emptied
        self._chunk_computing = False  # a prefill chunk was left computing (`settle`)

    def lookup(self, seq_id: int, tokens: list[int]) -> int:
        """Restores the longest prefix of `tokens` this stage holds; returns its length."""
        if self.prefix_cache is None:
            return 0
        self.tokens[seq_id] = tokens
        bs = self.prefix_cache.block_size
        if self.deferred and len(tokens) >= bs:  # a prompt waiting to be kept may be its prefix
            self.flush_stores([s for s, (t, _) in self.deferred.items() if t[:bs] == tokens[:bs]])
        kv = self.stage.from_blocks(
            self.prefix_cache.restore(tokens, self.prefix_cache.lookup(tokens)))
        held = kv[0].offset
        if held:
            self.prefilling[seq_id] = kv
        return held

    def trim(self, seq_id: int, n: int) -> None:
        """Keeps only the first n restored tokens: the prefix every stage of the pipeline holds."""
        kv = self.prefilling.get(seq_id)
        if kv is None or kv[0].offset <= n:
            return
        if n == 0:
            del self.prefilling[seq_id]
            return
        for c in kv:
            c.trim(c.offset - n)

    def prefill(self, seq_id: int, x: mx.array, wait: bool = True) -> mx.array:
        """Runs a prompt chunk of one sequence; returns this stage's output (lazy). The prefix
        cache keeps the blocks the chunk completed right away: a sliding-window layer still
        holds them now, not at admission. `wait=False` (deferred stores only): the chunk is
        scheduled, not waited for (`StageProfile.settle` times it)."""
        if not (wait or self.defer_stores):
            raise ValueError("a prefill chunk is left computing only with deferred stores")
        cache = self.prefilling.setdefault(seq_id, self.stage.make_cache())
        out = self.profile.run("prefill", x, lambda: self.stage(x, cache, last_only=True),
                               self._prefill_results(cache), wait=wait)
        self._store(seq_id, cache)
        if wait:
            mx.clear_cache()  # the chunk is computed: what it freed goes back
        else:
            self._chunk_computing = True
        return out

    def settle(self) -> None:
        """Waits for the prompt chunk `prefill(wait=False)` left computing (timing it), and
        gives back what it freed."""
        self.profile.settle()
        if self._chunk_computing:  # (a timed step may have settled it already: still ours)
            self._chunk_computing = False
            mx.clear_cache()

    def prefill_rows(self, seq_ids: list[int], x: mx.array,
                     lengths: list[int] | None = None) -> None:
        """Runs one prompt chunk of each of `seq_ids` in one forward pass: row i of `x` holds
        lengths[i] tokens (default: all of `x`'s width), right-padded. Every layer's cache must
        be a plain KVCache (`batchable`). Each sequence then keeps its own row of the result, as
        `prefill` leaves it.

        Rows that hold equally many tokens and run as many run unpadded, so each row's attention
        is exactly a batch of one's. Others run as mlx-lm's BatchGenerator prefills a batch:
        their caches merged left-padded, their chunks right-padded, the padding masked, then
        rolled to the left and cut off (`BatchKVCache.finalize`, `extract`)."""
        width = x.shape[1]
        lengths = lengths or [width] * len(seq_ids)
        held = [self.prefilling.get(s) or self.stage.make_cache() for s in seq_ids]
        if len({h[0].offset for h in held}) == 1 and min(lengths) == width:
            cache = [KVCache() for _ in held[0]]
            if held[0][0].offset:
                for layer, c in enumerate(cache):
                    keys, values = zip(*(h[layer].keys_and_values() for h in held))
                    c.state = (mx.concatenate(keys), mx.concatenate(values),
                               held[0][layer].offset)
            padded = False
        else:
            cache = [BatchKVCache.merge(list(layer)) for layer in zip(*held)]
            for c in cache:
                c.prepare(right_padding=[width - n for n in lengths])
            padded = True
        self.profile.run("prefill", x, lambda: self.stage(x, cache, last_only=True),
                         self._prefill_results(cache))
        if padded:
            for c in cache:
                c.finalize()
            rows = {s: [c.extract(r) for c in cache] for r, s in enumerate(seq_ids)}
        else:
            rows = {s: [_row(c, r) for c in cache] for r, s in enumerate(seq_ids)}
        mx.eval([c.keys_and_values() for kv in rows.values() for c in kv])
        mx.clear_cache()
        for s, kv in rows.items():
            self.prefilling[s] = kv
            self._store(s, kv)

    def _store(self, seq_id: int, cache: list) -> None:
        """The prefix cache keeps the blocks a prefill chunk completed: now, or deferred."""
        if self.prefix_cache is None or seq_id not in self.tokens:
            return
        if self.defer_stores:
            self.deferred[seq_id] = (self.tokens[seq_id], cache)
        else:
            self._keep(self.tokens[seq_id], cache)

    def flush_stores(self, seq_ids: list[int]) -> None:
        """The deferred stores of `seq_ids`' prompts (any not deferred are skipped)."""
        for s in seq_ids:
            if (held := self.deferred.pop(s, None)) is not None:
                self._keep(*held)

    def _keep(self, tokens: list[int], cache: list) -> None:
        """The prefix cache keeps a prompt's blocks. A store that fails (a device allocation,
        say) is logged: it costs a later prefill, never the step nor its other sequences."""
        try:
            self.prefix_cache.store(tokens, cache)
        except Exception:
            log.exception("KV cache: storing a prompt's blocks failed")

    def keep_answers(self, mb: int, rows: dict[int, list[int]]) -> None:
        """The prefix cache keeps what rows of micro-batch `mb` (row index -> the tokens its KV
        holds, `Sequence.fed`) computed past their prompt: an agent sends the answer back
        with its next turn, and without it that turn would prefill the answer again. Call it
        before `update` drops the rows. Only where every layer is a plain KVCache: a window
        no longer holds a long answer's start."""
        if self.prefix_cache is None or not self.batchable or not rows:
            return
        caches = self.caches[mb]
        for r, tokens in rows.items():
            kv = [_row_view(c, r) for c in caches]
            # What the row holds, exactly: the cache keeps a tail past its last whole block
            # only for tokens it has all of (the last sampled token may not have run).
            self._keep(tokens[:kv[0].offset], kv)

    def flush_admitted(self) -> None:
        """The deferred stores of every sequence admitted to a micro-batch: on a later stage of
        a pipeline, once a decode step has run them (it never sees their tokens)."""
        admitted = {s for rows in self.rows.values() for s in rows}
        self.flush_stores([s for s in self.deferred if s in admitted])

    def _prefill_results(self, cache: list) -> Callable[[mx.array], list]:
        """What a prefill chunk is for: the KV it leaves, and on every stage but the last the
        hidden states it passes on (the last stage's logits of a prompt chunk go unused: the
        prompt's last token is decoded as the first step)."""
        if self.stage.info.is_last:
            return lambda out: [c.state for c in cache]
        return lambda out: [out, *(c.state for c in cache)]

    def free(self, seq_ids: list[int]) -> None:
        self.flush_stores(seq_ids)  # what they prefilled is still worth keeping
        for s in seq_ids:
            self.prefilling.pop(s, None)
            self.tokens.pop(s, None)

    def update(self, mb: int, keep: list[int] | None, admit: list[int]) -> None:
        """Drops the rows of micro-batch `mb` not in `keep`, then appends `admit`'s sequences.

        A micro-batch of one row keeps plain `KVCache`s: decoding through a one-row
        `BatchKVCache` (mask array, per-row offsets) measured slower on a GPU. So a
        micro-batch holds batch caches exactly when it has several rows. Each layer's cache is
        merged into the batch type mlx-lm pairs with its type (`merge`: BatchKVCache for
        KVCache, BatchRotatingKVCache for RotatingKVCache, ArraysCache for itself)."""
        rows = self.rows.get(mb, [])
        caches = self.caches.get(mb)
        if keep is not None and len(keep) < len(rows):
            rows = [rows[i] for i in keep]
            if not rows:
                caches = None
            elif len(rows) == 1:
                caches = [c.extract(keep[0]) for c in caches]
            else:
                idx = mx.array(keep)
                for c in caches:
                    c.filter(idx)
        if admit:
            # A one-token prompt has nothing to prefill: its cache starts empty here.
            new = [self.prefilling.pop(s, None) or self.stage.make_cache() for s in admit]
            for sid in admit:
                self.tokens.pop(sid, None)  # stored as its prefill went, or in `deferred`
            if not rows and len(new) == 1:
                caches = new[0]
            elif len(rows) > 1:
                for c, m in zip(caches, (l[0].merge(list(l)) for l in zip(*new))):
                    c.extend(m)
            else:
                parts = [caches, *new] if rows else new
                caches = [layer[0].merge(list(layer)) for layer in zip(*parts)]
            rows = rows + list(admit)
        if rows:
            self.caches[mb], self.rows[mb] = caches, rows
        else:
            self.caches.pop(mb, None)
            self.rows.pop(mb, None)

    def trim_rows(self, mb: int, extra: list[int]) -> None:
        """Drops each row's last extra[i] positions from micro-batch `mb`'s caches: a verified
        step's rejected draft tokens (and a short draft's filler). A one-row KVCache trims its
        offset; a BatchKVCache trims what every row drops, then shifts each row right by the
        rest, into its left padding (mlx-lm's own right-padding finalize), so no row keeps a
        rejected token."""
        common = min(extra)
        for c in self.caches[mb]:
            if common:
                c.trim(common)
            if not isinstance(c, BatchKVCache) or max(extra) == common:
                continue
            c._right_padding = mx.array([e - common for e in extra])
            c.finalize()

    def give_back_if_idle(self) -> None:
        """Once this stage holds no sequence: drops the device copies of the blocks the prefix
        cache has copied to the host, and empties MLX's buffer cache: the buffers the last
        sequences held (their KV) go back to the device."""
        if self.caches or self.prefilling:
            return
        if self.prefix_cache is not None:
            self.prefix_cache.release_device_copies()
        if mx.get_cache_memory():
            mx.clear_cache()

    def forward(self, mb: int, x: mx.array) -> mx.array:
        self._decodes += 1
        if self._decodes >= CLEAR_CACHE_STEPS:
            self._decodes = 0
            mx.clear_cache()
        return self.profile.run("decode", x, lambda: self.stage(x, self.caches[mb]))

    def kv_bytes(self) -> int:
        """Bytes of KV this stage holds, for every micro-batch and prefilling sequence."""
        return sum(c.nbytes for caches in (*self.caches.values(), *self.prefilling.values())
                   for c in caches)
