"""Layers whose weights stay on the SSD: read just ahead of their turn, dropped after it.

A stage whose layers do not all fit the node's memory keeps its last layers *streamed*. Their
modules hold no weights between steps: at its turn in a forward pass a streamed layer gets its
weights as fresh lazy loads of the model's own safetensors files (mx.load reads nothing until
evaluated), passed through the family's own `sanitize` as mlx-lm's loader does, computes, and is
evaluated at once, so its weights are read, used and released before the next streamed layer's
are read: at most one streamed layer is resident at a time, beside the resident ones.

Read-ahead: while a layer computes, the next streamed layer's byte ranges (in order of the
stage, wrapping to the first for the next step) are brought into the page cache, so the lazy
load that follows copies from memory rather than waiting on the SSD: where the OS has
posix_fadvise (Linux) the kernel is asked to read them (WILLNEED) and, after the layer's turn,
to drop them (DONTNEED), so the cache does not quietly hold a second copy of what is streamed;
elsewhere (macOS) a thread reads them, and the OS reclaims those clean pages under pressure.

A MoE layer's routed experts, where its files store them stacked, are not read ahead: its
router runs first, then only the experts its tokens chose are read (routed_experts.py).
"""

from __future__ import annotations

import copy
import os
import re
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from omlx_node.routed_experts import (
    ExpertBank,
    RoutedCall,
    StoredTensor,
    find_banks,
    read_experts,
    swap,
)
from omlx_shared.safetensors_header import read_header, tensor_range, weight_files

# Bytes one read-ahead call reads at a time (into one reused buffer: its contents are dropped).
READ_BYTES = 8 << 20
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class StreamError(ValueError):
    """A layer that cannot be streamed; the message says why."""


@dataclass(frozen=True)
class _Span:
    file: Path
    start: int  # absolute offsets in the file
    end: int


class LayerStream:
    """The weights of `layers` (absolute layer index -> module) of the model at `path`, whose
    parameters are named `{prefix}{index}.…`. `cast` is applied to each floating weight
    (the stage's compute dtype), None to keep them as stored."""

    def __init__(self, model: nn.Module, path: Path, prefix: str, layers: dict[int, nn.Module],
                 cast: mx.Dtype | None) -> None:
        self._layers = layers
        self._prefix = prefix
        self._cast = cast
        # Some families' sanitize changes the model it is called on (gemma3 drops its head when
        # the weights given lack one): it runs on a shallow copy, and only for a family whose
        # files need it (_check finds out).
        self._sanitize: Callable[[dict], dict] | None = (
            (lambda w: copy.copy(model).sanitize(w)) if hasattr(model, "sanitize") else None)
        self._sanitized = False
        self._files: dict[int, list[Path]] = {i: [] for i in layers}
        stored: dict[str, StoredTensor] = {}
        for f in weight_files(path):
            header = read_header(f)
            for name, info in header.tensors.items():
                m = _LAYER.search(name)
                if m is None or int(m.group(1)) not in layers:
                    continue
                i = int(m.group(1))
                if f not in self._files[i]:
                    self._files[i].append(f)
                start, end = tensor_range(name, info, f)
                stored[name] = StoredTensor(f, header.data_start + start, header.data_start + end,
                                            tuple(info.get("shape", ())), info.get("dtype", ""))
        self._banks: dict[int, list[ExpertBank]] = {
            i: find_banks(layer, lambda name, i=i: stored.get(f"{prefix}{i}.{name}"))
            for i, layer in layers.items()}
        self._routed: dict[int, set[str]] = {
            i: {f"{prefix}{i}.{n}" for b in banks for n in b.names()}
            for i, banks in self._banks.items()}
        # Every byte of a layer (dropped from the page cache after its turn), and those read
        # ahead of it: all but its routed experts, read at its turn as its tokens choose.
        self._spans: dict[int, list[_Span]] = {i: [] for i in layers}
        self._ahead_spans: dict[int, list[_Span]] = {i: [] for i in layers}
        for name, t in stored.items():
            i = int(_LAYER.search(name).group(1))
            span = _Span(t.file, t.start, t.end)
            self._spans[i].append(span)
            if name not in self._routed[i]:
                self._ahead_spans[i].append(span)
        self._spans = {i: _merged(s) for i, s in self._spans.items()}
        self._ahead_spans = {i: _merged(s) for i, s in self._ahead_spans.items()}
        self.bytes_read = 0  # what turns have read of streamed layers (routed experts: theirs)
        self._turn_s: dict[int, float] = {}
        self._order = sorted(layers)
        # What a layer's modules hold between turns: placeholders of the weights' shapes, lazy
        # and never evaluated, so they take no memory.
        self._idle: dict[int, list[tuple[str, mx.array]]] = {}
        for i in self._order:
            self._check(i)
        # What the checks read went to MLX's buffer cache: give it back now. At each turn a
        # layer's buffers are then reused by the next one's, of the same sizes.
        mx.clear_cache()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="layer-read-ahead")
        self._ahead: dict[int, Future] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of the streamed layers' weights on disk."""
        return sum(s.end - s.start for spans in self._spans.values() for s in spans)

    def largest_layer_bytes(self) -> int:
        return max((sum(s.end - s.start for s in spans) for spans in self._spans.values()),
                   default=0)

    def run(self, i: int, call: Callable[[], mx.array]) -> mx.array:
        """`call()` (the layer's forward) with layer i's weights in place, evaluated; the
        weights are released when it returns. Raises OSError when they cannot be read."""
        t0 = time.perf_counter()
        ahead = self._ahead.pop(i, None)
        if ahead is not None:
            ahead.result()  # a failed read raises here, for the requests of this step
        layer = self._layers[i]
        layer.update(tree_unflatten(self._weights(i)))
        self.bytes_read += sum(s.end - s.start for s in self._ahead_spans[i])
        nxt = self._order[(self._order.index(i) + 1) % len(self._order)]
        if nxt not in self._ahead:
            self._ahead[nxt] = self._reader.submit(self._read_ahead, nxt)
        for bank in self._banks[i]:
            swap(layer, bank.path, RoutedCall(bank, self._cast, self._count))
        try:
            h = call()
            mx.eval(h)
        finally:
            for bank in self._banks[i]:
                swap(layer, bank.path, bank.module)
            layer.update(tree_unflatten(self._idle[i]))
            self._drop(i)
        self._turn_s[i] = time.perf_counter() - t0
        return h

    @property
    def seconds_a_pass(self) -> float:
        """What the last turns of the streamed layers took, one each (reads not hidden behind
        compute and the layers' own compute): what a forward pass pays for streaming them; 0
        before any has run."""
        return sum(self._turn_s.values())

    def _count(self, n: int) -> None:
        self.bytes_read += n

    def close(self) -> None:
        self._reader.shutdown(wait=True, cancel_futures=True)

    def _weights(self, i: int) -> list[tuple[str, mx.array]]:
        raw: dict[str, mx.array] = {}
        for f in self._files[i]:
            raw.update((k, v) for k, v in mx.load(str(f)).items()
                       if (m := _LAYER.search(k)) and int(m.group(1)) == i
                       and k not in self._routed[i])
        own = f"{self._prefix}{i}."
        weights = self._sanitize(raw) if self._sanitized else raw
        out = []
        for k, v in weights.items():
            if not k.startswith(own):
                continue
            if self._cast is not None and mx.issubdtype(v.dtype, mx.floating):
                v = v.astype(self._cast)
            out.append((k[len(own):], v))
        return out

    def _check(self, i: int) -> None:
        """StreamError unless what a turn would give layer i equals, name by name and value by
        value, what mlx-lm's loader gave it (read once here, one layer at a time); then the
        module's weights are swapped for placeholders."""
        loaded = dict(tree_flatten(self._layers[i].parameters()))
        # Routed experts as a turn reads them, every expert's rows: their byte ranges checked.
        experts = {f"{b.path}.{k}": v for b in self._banks[i]
                   for k, v in read_experts(b, list(range(b.num_experts)), self._cast)[0].items()}
        given = dict(self._weights(i)) | experts
        differ = self._differ(given, loaded)
        if differ and self._sanitize is not None and not self._sanitized:
            self._sanitized = True
            try:
                given = dict(self._weights(i)) | experts
            except (KeyError, IndexError, ValueError) as e:  # it wants the whole model's tensors
                raise StreamError(f"layer {i} cannot be streamed: the family's sanitize needs "
                                  f"more than one layer's weights ({e!r})") from None
            differ = self._differ(given, loaded)
        if differ:
            raise StreamError(
                f"layer {i} cannot be streamed: its weights as read from disk differ from what "
                f"mlx-lm's loader gives it ({len(differ)} tensors, e.g. {differ[0]!r}); keep it "
                f"resident (raise the node's weights memory or add a node)")
        self._idle[i] = [(k, mx.zeros(v.shape, v.dtype)) for k, v in given.items()]
        self._layers[i].update(tree_unflatten(self._idle[i]))

    def _differ(self, given: dict[str, mx.array], loaded: dict[str, mx.array]) -> list[str]:
        def as_run(v: mx.array) -> mx.array:
            floating = self._cast is not None and mx.issubdtype(v.dtype, mx.floating)
            return v.astype(self._cast) if floating else v

        return sorted(set(given) ^ set(loaded)) or [
            k for k in sorted(given) if given[k].shape != loaded[k].shape
            or not mx.array_equal(given[k], as_run(loaded[k])).item()]

    def _read_ahead(self, i: int) -> None:
        if hasattr(os, "posix_fadvise"):  # the kernel reads them in, with no copy made here
            for span in self._ahead_spans[i]:
                fd = os.open(span.file, os.O_RDONLY)
                try:
                    if os.fstat(fd).st_size < span.end:
                        raise OSError(f"{span.file} ends before the layer {i} weights it "
                                      f"should hold (byte {span.end})")
                    os.posix_fadvise(fd, span.start, span.end - span.start,
                                     os.POSIX_FADV_WILLNEED)
                finally:
                    os.close(fd)
            return
        buf = bytearray(READ_BYTES)
        view = memoryview(buf)
        for span in self._ahead_spans[i]:
            with open(span.file, "rb", buffering=0) as f:
                pos = span.start
                f.seek(pos)
                while pos < span.end:
                    n = f.readinto(view[:min(READ_BYTES, span.end - pos)])
                    if not n:
                        raise OSError(f"{span.file}: ended at byte {pos} of the layer {i} "
                                      f"weights it should hold up to {span.end}")
                    pos += n

    def _drop(self, i: int) -> None:
        if not hasattr(os, "posix_fadvise"):
            return
        for span in self._spans[i]:
            try:
                fd = os.open(span.file, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, span.start, span.end - span.start, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _merged(spans: list[_Span]) -> list[_Span]:
    """Adjacent byte ranges of one file as one (a layer's tensors are usually stored together),
    so read-ahead reads in large sequential runs."""
    out: list[_Span] = []
    for s in sorted(spans, key=lambda s: (str(s.file), s.start)):
        if out and out[-1].file == s.file and out[-1].end == s.start:
            out[-1] = _Span(s.file, out[-1].start, s.end)
        else:
            out.append(s)
    return out
