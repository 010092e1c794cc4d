"""Sending a node the weights of its layer range, when it lacks the model's files.

The coordinator's model folder is the source; a node that joined over the network may have none
of it. Before such a node loads a range, `ensure_weights` (contract: proto/omlx.proto, receiver:
omlx_node/weight_store.py):

1. builds the range's manifest: one safetensors file per layer (`model-layer-00012.safetensors`),
   `model-embed` on the first stage (and on the last when the embedding is the head),
   `model-norm` and `model-head` on the last, each listing its tensors in data order, plus the
   folder's small files (config.json, tokenizer and chat template files) copied as they are;
   the model is named by its content fingerprint (omlx_shared.model_store). A model that runs
   whole on one node (an embedding, reranking or Whisper model: `whole`) is one "layer": its
   safetensors files go as they are (their tensors, named as in the checkpoint), with the small
   files of the sentence-transformers module folders modules.json lists (`1_Pooling/`: how it
   pools);
2. asks the node what it holds (`PrepareWeights`): its own copy of the model, verified files of
   an earlier transfer, or parts of a broken one with the offset to resume from;
3. streams only the missing bytes (`PushWeights`), read by offset straight from the source
   safetensors files, in chunks of at most 1 MiB with a crc32 each; a file's last chunk carries
   the sha256 of its whole data section (for a resumed file the held prefix is hashed from the
   coordinator's own copy, not sent). The node acks what it has written durably every few MiB;
4. retries a broken or refused-as-corrupt transfer a few times, resuming where the node stands.

No MLX here: the coordinator never holds weights in memory.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from omlx_coordinator.nodes.node_client import AgentClient
from omlx_coordinator.planning.model_layout import tensor_part
from omlx_shared.model_store import content_fingerprint
from omlx_shared.safetensors_header import read_header, tensor_range, weight_files
from proto import omlx_pb2 as pb

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20  # gRPC's default message cap is 4 MiB
ATTEMPTS = 3
RETRY_DELAY_SECONDS = 0.5
ACK_TIMEOUT_SECONDS = 60.0  # a node that acks nothing for this long is stuck: start again
LOG_EVERY_SECONDS = 5.0
MAX_RAW_FILE_BYTES = 64 << 20  # larger non-weight files are not needed to run a stage
# Weights in other formats, or indices of the source's own files: never sent.
_SKIPPED_SUFFIXES = {".safetensors", ".gguf", ".bin", ".pt", ".pth", ".ckpt", ".npz", ".h5",
                     ".msgpack", ".onnx", ".part"}
_SKIPPED_NAMES = {"model.safetensors.index.json", "shard.json"}
# The node refuses the transfer as such: trying again cannot help.
_FINAL_CODES = {grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                grpc.StatusCode.UNIMPLEMENTED}


class WeightTransferError(ConnectionError):
    """A transfer that broke off without a gRPC error (a node that went quiet or ended the
    stream early); retried like one."""


@dataclass(frozen=True)
class Segment:
    """A run of bytes in one of the coordinator's files."""

    path: Path
    offset: int
    nbytes: int


@dataclass(frozen=True)
class SourceTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    segment: Segment


@dataclass(frozen=True)
class SourceFile:
    """A file a node may need, and where its data section lies in the coordinator's folder."""

    name: str
    safetensors: bool
    tensors: tuple[SourceTensor, ...]
    segments: tuple[Segment, ...]

    @property
    def size(self) -> int:
        return sum(s.nbytes for s in self.segments)

    def message(self) -> pb.WeightFile:
        return pb.WeightFile(name=self.name, size=self.size, safetensors=self.safetensors,
                             tensors=[pb.TensorEntry(name=t.name, dtype=t.dtype, shape=t.shape,
                                                     nbytes=t.nbytes) for t in self.tensors])


@dataclass
class WeightCounters:
    """Totals over every transfer of a coordinator (the gateway exports bytes_sent)."""

    bytes_sent: int = 0
    files_sent: int = 0


@dataclass(frozen=True)
class TransferProgress:
    node: str
    bytes_sent: int  # by this ensure_weights call, over all its attempts
    bytes_to_send: int  # what the node lacked (so far: a corrupt part adds its size again)
    seconds: float

    @property
    def rate(self) -> float:
        """Bytes per second."""
        return self.bytes_sent / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class TransferResult:
    local_path: str  # the folder the node loads from
    full_copy: bool  # the node's own copy of the whole model
    bytes_total: int  # the range's files
    bytes_sent: int
    files_sent: tuple[str, ...]
    seconds: float
    attempts: int


class WeightSource:
    """The coordinator's model folder, indexed once: where every tensor of every part is.

    Reads config.json, the safetensors headers and a fingerprint's samples (a few MB): build it
    off the event loop."""

    def __init__(self, model_path: Path, model_id: str, whole: bool = False):
        self.model_path = Path(model_path)
        self.model_id = model_id
        config = json.loads((self.model_path / "config.json").read_text())
        text = config.get("text_config") or {}
        self.num_layers = 1 if whole else int(config.get("num_hidden_layers")
                                              or text.get("num_hidden_layers"))
        groups: dict[str, list[SourceTensor]] = {}
        for path in weight_files(self.model_path):
            header = read_header(path)
            for name, info in header.tensors.items():
                part = "whole" if whole else tensor_part(name)
                if part is None:
                    continue
                if part == "other":
                    raise ValueError(f"{path}: tensor {name!r} belongs to no layer, embedding, "
                                     "norm or head; no stage would know where to place it")
                start, end = tensor_range(name, info, path)
                if whole:  # the node's store takes weights only in model*.safetensors
                    file = path.name if path.name.startswith("model") else f"model-{path.name}"
                elif isinstance(part, int):
                    file = f"model-layer-{part:05d}.safetensors"
                else:
                    file = f"model-{part}.safetensors"
                groups.setdefault(file, []).append(SourceTensor(
                    name, str(info["dtype"]), tuple(int(d) for d in info["shape"]), end - start,
                    Segment(path, header.data_start + start, end - start)))
        self._weights = {name: _safetensors_file(name, tensors)
                         for name, tensors in groups.items()}
        # mlx-lm's families tie the head to the embedding unless the config says otherwise
        # (their sanitize then drops any lm_head); without an lm_head tensor the head is tied.
        tie = config.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
        self.tied = bool(tie) or "model-head.safetensors" not in self._weights
        self.whole = whole
        self._raw = [SourceFile(p.relative_to(self.model_path).as_posix(), False, (),
                                (Segment(p, 0, p.stat().st_size),))
                     for p in _small_files(self.model_path)]
        self.fingerprint = content_fingerprint(self.model_path)

    def files_for(self, layer_start: int, layer_end: int) -> list[SourceFile]:
        """Every file a stage running layers [layer_start, layer_end) needs."""
        if not 0 <= layer_start < layer_end <= self.num_layers:
            raise ValueError(f"layer range [{layer_start}, {layer_end}) is not inside the "
                             f"model's {self.num_layers} layers")
        if self.whole:
            return [*self._weights.values(), *self._raw]
        names = [f"model-layer-{i:05d}.safetensors" for i in range(layer_start, layer_end)]
        first, last = layer_start == 0, layer_end == self.num_layers
        if first or (last and self.tied):
            names.append("model-embed.safetensors")
        if last:
            names.append("model-norm.safetensors")
            if not self.tied:
                names.append("model-head.safetensors")
        # A part with no tensors in the checkpoint is not sent; the stage's load says what it
        # lacks, if it needed it.
        return [self._weights[n] for n in names if n in self._weights] + self._raw

    def manifest(self, layer_start: int, layer_end: int,
                 files: list[SourceFile]) -> pb.WeightManifest:
        return pb.WeightManifest(model_id=self.model_id, fingerprint=self.fingerprint,
                                 layer_start=layer_start, layer_end=layer_end,
                                 num_layers=self.num_layers, files=[f.message() for f in files])


def _small_files(folder: Path) -> list[Path]:
    """The folder's files a node needs beside the weights: its own small ones, and those of the
    sentence-transformers module folders its modules.json lists (one level down: the names a
    node's store takes)."""
    dirs = [folder]
    try:
        modules = json.loads((folder / "modules.json").read_text())
    except (OSError, ValueError):
        modules = []
    for m in modules if isinstance(modules, list) else ():
        sub = str(m.get("path") or "") if isinstance(m, dict) else ""
        if sub and "/" not in sub and not sub.startswith(".") and (folder / sub).is_dir():
            dirs.append(folder / sub)
    return [p for d in dirs for p in sorted(d.iterdir())
            if p.is_file() and not p.name.startswith(".")
            and p.suffix not in _SKIPPED_SUFFIXES and p.name not in _SKIPPED_NAMES
            and p.stat().st_size <= MAX_RAW_FILE_BYTES]


def _safetensors_file(name: str, tensors: list[SourceTensor]) -> SourceFile:
    tensors = sorted(tensors, key=lambda t: t.name)  # the fixed order both sides lay out
    segments: list[Segment] = []
    for t in tensors:
        s = t.segment
        last = segments[-1] if segments else None
        if last is not None and last.path == s.path and last.offset + last.nbytes == s.offset:
            segments[-1] = Segment(s.path, last.offset, last.nbytes + s.nbytes)  # one read
        elif s.nbytes:
            segments.append(s)
    return SourceFile(name, True, tuple(tensors), tuple(segments))


class _Reader:
    """Reads a SourceFile's data section by offset; one descriptor per source file."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}

    def read(self, file: SourceFile, offset: int, n: int, sha: "hashlib._Hash") -> bytes:
        """n bytes of the data section from `offset`, also fed to `sha`."""
        out = bytearray()
        start = 0  # where segment s begins in the data section
        for s in file.segments:
            want = offset + len(out)
            if len(out) == n:
                break
            if want < start + s.nbytes:
                take = min(start + s.nbytes - want, n - len(out))
                fd = self._fds.get(s.path)
                if fd is None:
                    fd = self._fds[s.path] = os.open(s.path, os.O_RDONLY)
                data = os.pread(fd, take, s.offset + want - start)
                if len(data) != take:
                    raise OSError(f"{s.path} is shorter than its safetensors header says")
                out += data
            start += s.nbytes
        sha.update(out)
        return bytes(out)

    def hash_prefix(self, file: SourceFile, n: int, sha: "hashlib._Hash") -> None:
        offset = 0
        while offset < n:
            step = min(CHUNK_BYTES * 8, n - offset)
            self.read(file, offset, step, sha)
            offset += step

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


@dataclass
class _Transfer:
    """One ensure_weights call's state, kept across its attempts."""

    agent: AgentClient
    source: WeightSource
    label: str
    counters: WeightCounters
    on_progress: Callable[[TransferProgress], None] | None
    started: float = field(default_factory=time.monotonic)
    sent: int = 0
    to_send: int = 0
    files_sent: list[str] = field(default_factory=list)
    logged: float = 0.0
    source_error: BaseException | None = None

    def progress(self) -> TransferProgress:
        return TransferProgress(self.label, self.sent, self.to_send,
                                time.monotonic() - self.started)

    async def push(self, todo: list[tuple[SourceFile, int]]) -> None:
        reader = _Reader()
        call = self.agent.push_weights(self._chunks(todo, reader))
        done: set[str] = set()
        try:
            while True:
                ack = await asyncio.wait_for(call.read(), ACK_TIMEOUT_SECONDS)
                if ack is grpc.aio.EOF:
                    break
                if ack.complete:
                    done.add(ack.file)
                    self.files_sent.append(ack.file)
                    self.counters.files_sent += 1
                self._report()
        except asyncio.TimeoutError:
            raise WeightTransferError(f"node {self.label} acknowledged nothing for "
                                      f"{ACK_TIMEOUT_SECONDS:.0f}s") from None
        except grpc.aio.AioRpcError:
            if self.source_error is not None:
                raise self.source_error from None
            raise
        finally:
            call.cancel()
            reader.close()
        if left := [f.name for f, _ in todo if f.name not in done]:
            raise WeightTransferError(f"node {self.label} ended the transfer with "
                                      f"{', '.join(left)} incomplete")

    async def _chunks(self, todo: list[tuple[SourceFile, int]],
                      reader: _Reader) -> AsyncIterator[pb.WeightChunk]:
        fingerprint = self.source.fingerprint
        try:
            for file, start in todo:
                sha = hashlib.sha256()
                if start:
                    await asyncio.to_thread(reader.hash_prefix, file, start, sha)
                offset = start
                while True:
                    n = min(CHUNK_BYTES, file.size - offset)
                    data = await asyncio.to_thread(reader.read, file, offset, n, sha)
                    last = offset + n == file.size
                    yield pb.WeightChunk(fingerprint=fingerprint, file=file.name, offset=offset,
                                         data=data, crc32=zlib.crc32(data),
                                         sha256=sha.digest() if last else b"")
                    offset += n
                    self.sent += n
                    self.counters.bytes_sent += n
                    if last:
                        break
        except OSError as e:  # gRPC would report only a cancelled call
            self.source_error = e
            raise

    def _report(self) -> None:
        p = self.progress()
        if self.on_progress is not None:
            self.on_progress(p)
        if p.seconds - self.logged >= LOG_EVERY_SECONDS:
            self.logged = p.seconds
            log.info("weights of %s to %s: %.1f of %.1f MB (%.1f MB/s)", self.source.model_id,
                     self.label, p.bytes_sent / 1e6, p.bytes_to_send / 1e6, p.rate / 1e6)


async def ensure_weights(agent: AgentClient, source: WeightSource, layer_start: int,
                         layer_end: int,
                         on_progress: Callable[[TransferProgress], None] | None = None,
                         counters: WeightCounters | None = None, attempts: int = ATTEMPTS,
                         label: str = "") -> TransferResult:
    """Makes sure the node behind `agent` holds what layers [layer_start, layer_end) need and
    returns where (its `local_path` goes into LoadShardRequest.model_path).

    `on_progress` is called on each of the node's acks (an exception it raises ends the
    transfer; the node keeps what it acked). A broken transfer is resumed up to `attempts`
    times in all; then, or at once when the node refuses it (no disk space, a bad manifest),
    the last gRPC error is raised."""
    files = source.files_for(layer_start, layer_end)
    manifest = source.manifest(layer_start, layer_end, files)
    by_name = {f.name: f for f in files}
    t = _Transfer(agent, source, label or agent.address, counters or WeightCounters(),
                  on_progress)
    attempt = 0
    while True:
        attempt += 1
        try:
            needs = await agent.prepare_weights(manifest)
            held = {h.name: h for h in needs.files}
            todo = [(f, held[f.name].have_bytes if f.name in held else 0) for f in files
                    if not (f.name in held and held[f.name].complete)]
            if any(start > by_name[f.name].size for f, start in todo):
                raise WeightTransferError(f"node {t.label} claims more bytes of a file than it "
                                          "has")
            t.to_send = t.sent + sum(f.size - start for f, start in todo)
            if todo:
                await t.push(todo)
            break
        except (grpc.aio.AioRpcError, WeightTransferError) as e:
            final = isinstance(e, grpc.aio.AioRpcError) and e.code() in _FINAL_CODES
            if final or attempt >= attempts:
                raise
            reason = f"{e.code().name}: {e.details()}" if isinstance(
                e, grpc.aio.AioRpcError) else str(e)
            log.warning("weights of %s to %s: attempt %d broke off (%s); resuming",
                        source.model_id, t.label, attempt, reason)
            await asyncio.sleep(RETRY_DELAY_SECONDS * attempt)
    p = t.progress()
    if needs.full_copy:
        log.info("node %s has its own copy of %s at %s", t.label, source.model_id,
                 needs.local_path)
    elif not t.sent:
        log.info("node %s holds %s layers [%d, %d) already (%s)", t.label, source.model_id,
                 layer_start, layer_end, needs.local_path)
    else:
        log.info("weights of %s layers [%d, %d) on %s: sent %.1f MB of %.1f MB in %.2fs "
                 "(%.1f MB/s)", source.model_id, layer_start, layer_end, t.label,
                 t.sent / 1e6, sum(f.size for f in files) / 1e6, p.seconds, p.rate / 1e6)
    return TransferResult(needs.local_path, needs.full_copy, sum(f.size for f in files),
                          t.sent, tuple(t.files_sent), p.seconds, attempt)
