"""The file format of a KV block on SSD, and the checks a file must pass before it is used.

Cold tier files are ordinary safetensors (mx.load and the safetensors library read them): one
tensor per key and value of each layer, named by absolute layer (k.{layer}, v.{layer}), in that
order. The metadata says whose they are (format, model id, layer range, block size, dtype, the
block's hash and its parent's) plus the sha256 of the tensor bytes, and a file that is truncated,
corrupt or foreign is removed when the index is rebuilt or when it is loaded, so the worst a bad
file costs is a re-prefill.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from omlx_node.kv_cache.blocks import BY_NAME, Block, DType, Layout
from omlx_node.kv_cache.metrics import KVCacheMetrics

log = logging.getLogger(__name__)

FORMAT = "omlx-kv-block"
FORMAT_VERSION = "1"
_MAX_HEADER_BYTES = 1 << 20  # a real header is ~100 bytes per layer; more means garbage
HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Owner:
    """Whose block files are: what their metadata must say for a cache to use them."""

    model_id: str
    layer_start: int  # the layer range [layer_start, layer_end)
    layer_end: int
    block_size: int
    dtype: str | None  # the cache's declared KV dtype; None takes files of any


class BadFile(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason  # truncated, corrupt or foreign: the metric's label


@dataclass(frozen=True)
class FileInfo:
    parent: str
    dtype: DType
    tensors: list[tuple[str, tuple[int, ...], int, int]]  # name, shape, start, end (data offsets)
    tensor_sha256: str
    data_start: int


def tensor_names(start: int, end: int) -> list[str]:
    """The tensors of a file of layers [start, end), in file order."""
    names = []
    for layer in range(start, end):
        names += [f"k.{layer}", f"v.{layer}"]
    return names


def _metadata(owner: Owner, block: Block, tensor_sha256: str) -> dict[str, str]:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "model_id": owner.model_id,
        "layer_start": str(owner.layer_start),
        "layer_end": str(owner.layer_end),
        "block_size": str(owner.block_size),
        "token_count": str(block.tokens),  # fewer than block_size for a tail
        "dtype": block.dtype.name,
        "block_hash": block.hash,
        "parent_hash": block.parent,
        "tensor_sha256": tensor_sha256,
    }


def encode_block(owner: Owner, block: Block) -> tuple[bytes, list[np.ndarray]]:
    """The safetensors header (length prefix included) and the tensors in file order."""
    arrays = [a for pair in zip(block.keys, block.values) for a in pair]
    digest = hashlib.sha256()
    for a in arrays:
        digest.update(memoryview(a).cast("B"))
    header: dict[str, object] = {"__metadata__": _metadata(owner, block, digest.hexdigest())}
    offset = 0
    for name, a in zip(tensor_names(owner.layer_start, owner.layer_end), arrays):
        header[name] = {
            "dtype": block.dtype.st,
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data section to 8 bytes
    return struct.pack("<Q", len(raw)) + raw, arrays


def read_head(f) -> tuple[int, bytes]:
    """A safetensors file's size and its first bytes: the length prefix and, when that length
    is sane, the JSON header (checked by the caller)."""
    size = os.fstat(f.fileno()).st_size
    head = f.read(8)
    if len(head) == 8:
        (n,) = struct.unpack("<Q", head)
        if n <= _MAX_HEADER_BYTES:
            head += f.read(n)
    return size, head


def check_header(
    owner: Owner, block_hash: str, head: bytes, file_size: int, layout: Layout | None = None
) -> FileInfo:
    """Validates a file's header against `owner` and, with `layout` (the stage's KV, once
    known), its tensor shapes; raises BadFile."""
    try:
        return _check_header(owner, block_hash, head, file_size, layout)
    except BadFile:
        raise
    except Exception as e:  # JSON of any other shape (a list for a dtype, deep nesting...)
        raise BadFile("corrupt", f"header: {type(e).__name__}: {e}") from None


def _check_header(
    owner: Owner, block_hash: str, head: bytes, file_size: int, layout: Layout | None
) -> FileInfo:
    start, end = owner.layer_start, owner.layer_end
    if file_size < 8 or len(head) < 8:
        raise BadFile("truncated", "shorter than a safetensors header")
    (n,) = struct.unpack("<Q", head[:8])
    if n > _MAX_HEADER_BYTES:
        raise BadFile("corrupt", f"header length {n}")
    if 8 + n > file_size or len(head) < 8 + n:
        raise BadFile("truncated", "the header runs past the end of the file")
    try:
        header = json.loads(head[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadFile("corrupt", f"header is not JSON: {e}") from None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise BadFile("corrupt", "no metadata")
    meta = header.pop("__metadata__")
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise BadFile(
            "foreign", f"format {meta.get('format')!r} v{meta.get('format_version')!r}"
        )
    want = {
        "model_id": owner.model_id,
        "layer_start": str(start),
        "layer_end": str(end),
        "block_size": str(owner.block_size),
        "block_hash": block_hash,
    }
    for key, value in want.items():
        if meta.get(key) != value:
            raise BadFile("foreign", f"{key} is {meta.get(key)!r}, expected {value!r}")
    count = meta.get("token_count")
    if not (isinstance(count, str) and count.isdecimal() and 1 <= int(count) <= owner.block_size):
        raise BadFile("foreign", f"token_count is {count!r}, expected 1 to {owner.block_size}")
    tokens = int(count)
    dt = BY_NAME.get(meta.get("dtype", ""))
    if dt is None:
        raise BadFile("corrupt", f"dtype {meta.get('dtype')!r}")
    if owner.dtype is not None and dt.name != owner.dtype:
        raise BadFile("foreign", f"dtype {dt.name}, expected {owner.dtype}")
    parent = meta.get("parent_hash", "")
    sha = meta.get("tensor_sha256", "")
    if not isinstance(parent, str) or not (parent == "" or HEX64.match(parent)):
        raise BadFile("corrupt", "parent hash")
    if not isinstance(sha, str) or not HEX64.match(sha):
        raise BadFile("corrupt", "tensor hash")
    order = tensor_names(start, end)
    if set(header) != set(order):
        raise BadFile("corrupt", f"tensors {sorted(header)[:6]}")
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
            and shape[1] == tokens
            and isinstance(offs, list)
            and len(offs) == 2
            and all(type(o) is int for o in offs)
            and offs[1] - offs[0] == int(np.prod(shape)) * itemsize
        )
        if not ok:
            raise BadFile("corrupt", f"tensor {name}: {t}")
        tensors.append((name, tuple(shape), offs[0], offs[1]))
    tensors.sort(key=lambda t: t[2])
    expect = 0
    for _, _, s, e in tensors:
        if s != expect:
            raise BadFile("corrupt", "tensor data is not contiguous")
        expect = e
    data_len = file_size - 8 - n
    if data_len < expect:
        raise BadFile("truncated", f"{data_len} data bytes, the header says {expect}")
    if data_len > expect:
        raise BadFile("corrupt", "trailing bytes after the tensors")
    info = FileInfo(parent, dt, tensors, sha, 8 + n)
    if layout is None:
        return info  # a sibling's shapes are checked once its layers are assembled
    shapes = {name: shape for name, shape, _, _ in tensors}
    layers = range(start, end)
    got = (
        dt.name,
        tuple(shapes[f"k.{i}"] for i in layers),
        tuple(shapes[f"v.{i}"] for i in layers),
    )
    if got != layout:
        raise BadFile("foreign", "tensor shapes differ from this stage's KV")
    return info


def read_header(owner: Owner, path: Path, block_hash: str) -> tuple[int, FileInfo]:
    """Checks a file's header; returns its size and what the header says. Raises BadFile
    or OSError."""
    with open(path, "rb") as f:
        size, head = read_head(f)
    return size, check_header(owner, block_hash, head, size)


def decode_block(owner: Owner, block_hash: str, data: bytes, layout: Layout | None) -> Block:
    """The block a whole file's bytes hold, header and tensor sha256 checked; raises BadFile."""
    info = check_header(owner, block_hash, data, len(data), layout)
    body = memoryview(data)[info.data_start :]
    if hashlib.sha256(body).hexdigest() != info.tensor_sha256:
        raise BadFile("corrupt", "tensor bytes do not match their sha256")
    arrays = {
        name: np.frombuffer(data, info.dtype.np, int(np.prod(shape)), info.data_start + s)
        .reshape(shape)
        for name, shape, s, _ in info.tensors
    }
    layers = range(owner.layer_start, owner.layer_end)
    return Block(
        hash=block_hash,
        parent=info.parent,
        dtype=info.dtype,
        keys=[arrays[f"k.{i}"] for i in layers],
        values=[arrays[f"v.{i}"] for i in layers],
    )


def remove_bad_file(path: Path, err: BadFile, metrics: KVCacheMetrics) -> None:
    log.warning("KV cache: removing %s file %s: %s", err.reason, path, err)
    metrics.ssd_rejected.labels(reason=err.reason).inc()
    try:
        path.unlink()
    except OSError:
        pass  # a read-only dir: it stays out of the index, which is what matters
