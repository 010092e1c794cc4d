"""A streamed MoE layer's routed experts, read from disk only for the experts a step routes to.

mlx-lm keeps a MoE layer's routed experts stacked: one SwitchGLU (or SwitchMLP) whose
projections are tensors of shape (num_experts, ...), stored that way in the safetensors files
of converted models. Expert e's part of such a tensor is one contiguous byte range, so a
streamed layer (layer_stream.py) need not read them all: its router runs first, then only the
rows of the experts its tokens chose are read (runs of adjacent experts in one read each), and
the module computes with those rows and the tokens' choices renumbered into them. gather_mm and
gather_qmm then pick the very matrices they would have picked from the whole stack: the same
numbers as mlx-lm. At batch 1 a decode step reads top_k / num_experts of the experts; a batch
reads the union of its rows' choices, a long prefill usually all of them.

Files whose experts are stored one tensor per expert (the Hugging Face layout, stacked by the
family's sanitize at load) have no such bank: their layers are read whole.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

# safetensors dtypes as numpy reads their bytes (bfloat16 as its bits, viewed back in MLX).
_NUMPY = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U32": np.uint32,
          "I32": np.int32, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16}


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor's bytes are: `file` from absolute offset `start` to `end`, `dtype` as
    safetensors names it."""

    file: Path
    start: int
    end: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def readable(self) -> bool:
        """Whether its bytes are its shape's elements of a dtype read here, nothing else."""
        return self.dtype in _NUMPY and self.nbytes == int(np.prod(self.shape)) * np.dtype(
            _NUMPY[self.dtype]).itemsize


@dataclass(frozen=True)
class ExpertBank:
    """One stacked experts module of a layer: its path in the layer (`mlp.switch_mlp`), the
    module, and each of its parameters (`gate_proj.weight`, ...) as stored."""

    path: str
    module: nn.Module
    tensors: dict[str, StoredTensor]
    num_experts: int

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def names(self) -> list[str]:
        """Its parameters' names in the layer."""
        return [f"{self.path}.{k}" for k in self.tensors]


def find_banks(layer: nn.Module, stored: Callable[[str], StoredTensor | None]) -> list[ExpertBank]:
    """The layer's experts modules whose every parameter `stored(name in the layer)` finds on
    disk as the module holds it (same shape, the experts first, a dtype read here); [] for a
    dense layer or experts stored otherwise."""
    banks = []
    for path, module in layer.named_modules():
        if not isinstance(module, (SwitchGLU, SwitchMLP)):
            continue
        params = tree_flatten(module.parameters())
        tensors = {k: stored(f"{path}.{k}") for k, _ in params}
        num = params[0][1].shape[0] if params else 0
        if num < 2 or any(t is None or not t.readable() or t.shape != tuple(v.shape)
                          for (_, v), t in zip(params, tensors.values())):
            continue
        banks.append(ExpertBank(path, module, tensors, num))
    return banks


def read_experts(bank: ExpertBank, experts: list[int], cast: mx.Dtype | None
                 ) -> tuple[dict[str, mx.array], int]:
    """The rows of `experts` (sorted, distinct) of every parameter of `bank`, named as in the
    bank's module, `cast` applied to floating ones; and the bytes read. OSError when the file
    ends early."""
    runs: list[tuple[int, int]] = []  # [first, last] of adjacent experts: one read each
    for e in experts:
        if runs and runs[-1][1] == e - 1:
            runs[-1] = (runs[-1][0], e)
        else:
            runs.append((e, e))
    fds: dict[Path, int] = {}
    try:
        for t in bank.tensors.values():
            if t.file not in fds:
                fds[t.file] = os.open(t.file, os.O_RDONLY)
        if hasattr(os, "posix_fadvise"):
            # Every range asked for at once: the SSD serves them in parallel while the reads
            # below take them in order.
            for t in bank.tensors.values():
                row = t.nbytes // bank.num_experts
                for first, last in runs:
                    os.posix_fadvise(fds[t.file], t.start + first * row,
                                     (last + 1 - first) * row, os.POSIX_FADV_WILLNEED)
        out, total = {}, 0
        for name, t in bank.tensors.items():
            buf = _read_rows(fds[t.file], t, bank.num_experts, runs, f"{bank.path}.{name}")
            total += len(buf)
            v = mx.array(np.frombuffer(buf, _NUMPY[t.dtype]).reshape(len(experts), *t.shape[1:]))
            if t.dtype == "BF16":
                v = v.view(mx.bfloat16)
            if cast is not None and mx.issubdtype(v.dtype, mx.floating):
                v = v.astype(cast)
            out[name] = v
        return out, total
    finally:
        for fd in fds.values():
            os.close(fd)


def _read_rows(fd: int, t: StoredTensor, num_experts: int, runs: list[tuple[int, int]],
               name: str) -> bytearray:
    """The bytes of the experts in `runs` of tensor `t`, in order."""
    row = t.nbytes // num_experts
    buf = bytearray(row * sum(last + 1 - first for first, last in runs))
    view, pos = memoryview(buf), 0
    for first, last in runs:
        offset, end = t.start + first * row, t.start + (last + 1) * row
        while offset < end:  # a read may return less than asked
            n = os.preadv(fd, [view[pos:pos + end - offset]], offset)
            if n <= 0:
                raise OSError(f"{t.file} ends at byte {offset}, inside the experts {name} "
                              f"should hold up to byte {end}")
            offset, pos = offset + n, pos + n
    return buf


class RoutedCall:
    """Stands in for a bank's module during its layer's turn: reads the experts the tokens
    route to, then runs the module on them. `count` is told the bytes each call reads."""

    def __init__(self, bank: ExpertBank, cast: mx.Dtype | None, count: Callable[[int], None]):
        self._bank, self._cast, self._count = bank, cast, count

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        chosen = np.unique(np.array(indices))  # evaluates the layer up to its router
        rows, n = read_experts(self._bank, chosen.tolist(), self._cast)
        self._count(n)
        self._bank.module.update(tree_unflatten(list(rows.items())))
        position = np.zeros(self._bank.num_experts, np.uint32)
        position[chosen] = np.arange(len(chosen), dtype=np.uint32)
        return self._bank.module(x, mx.array(position)[indices])


def swap(layer: nn.Module, path: str, value) -> None:
    """Sets the child at `path` (dotted, inside `layer`) to `value`."""
    *parents, last = path.split(".")
    node = layer
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[last] = value
