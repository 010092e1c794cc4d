"""The receiving end of weight transfers: a node's store of the layers it runs.

A node that lacks a model's files gets only the tensors of its layer range from the coordinator
(sender: omlx_coordinator/nodes/weight_transfer.py; contract: proto/omlx.proto):

1. `PrepareWeights(manifest)`: the model's content fingerprint (omlx_shared.model_store), the
   layer range and every file the range needs: per-layer safetensors files
   (`model-layer-00012.safetensors`, `model-embed`, `model-norm`, `model-head`; a model run
   whole: its own model*.safetensors) listing their tensors in data order, and small files
   copied as they are (config.json, tokenizer files, `1_Pooling/config.json`).
   The node answers with the folder to load from and what it holds of each file:
   - its own copy of the whole model, `models/<model_id>` with the same fingerprint: nothing;
   - else the shard folder `models/<model_id>@<fingerprint[:12]>/`: the files its `shard.json`
     records as verified, and the `<file>.part` of a broken transfer, whose data bytes are the
     offset to resume from. Parts whose header is not the manifest's are discarded.
   It refuses (FAILED_PRECONDITION) when the disk has no room for the missing bytes.
2. `PushWeights(stream WeightChunk) -> stream WeightAck`: each chunk continues one file at exactly
   the offset the node holds, with at most 1 MiB and its crc32; a file's last chunk carries the
   sha256 of its whole data section. The node writes the safetensors header itself (so offsets
   are into the data section), hashes a resumed part's bytes again so the sha256 check covers
   the whole file, and on a match fsyncs, renames the part into place and records it in
   shard.json. It acks the bytes durably written every 4 MiB and at each file's end.

A bad chunk (unknown fingerprint or file, wrong offset, crc mismatch) aborts the stream with a
status that says so and leaves the part for the next attempt; a sha256 mismatch deletes the part
(some of its bytes are wrong, and nobody knows which) and aborts with DATA_LOSS. A stream that
breaks leaves its parts: their size is the resume point. One transfer at a time per folder.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import struct
import threading
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from omlx_shared.model_store import (
    SHARD_RECORD,
    ModelError,
    ShardRecord,
    content_fingerprint,
    models_dir,
    read_shard_record,
    write_shard_record,
)
from omlx_shared.safetensors_header import DTYPE_BYTES
from proto import omlx_pb2 as pb

log = logging.getLogger(__name__)

CHUNK_MAX_BYTES = 1 << 20  # gRPC's default message cap is 4 MiB
ACK_EVERY_BYTES = 4 << 20
FREE_SPACE_MARGIN_BYTES = 64 << 20  # left free on the disk after a transfer
LOCK_WAIT_SECONDS = 30.0  # for a broken transfer's handler to notice and let go of its folder
_READ_BLOCK = 1 << 20

_FINGERPRINT_RE = re.compile(r"^[0-9a-f]{64}$")
# A file of the folder, or of one folder below it (sentence-transformers' `1_Pooling/`); no
# part of a name starts with a dot, so none climbs out.
_FILE_NAME_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*$")
_UNSAFE_ID_RE = re.compile(r"[^A-Za-z0-9._-]")


class WeightError(Exception):
    """A transfer this node refuses or cannot complete; `code` is the gRPC status to answer."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class FileSpec:
    name: str
    size: int  # bytes of the data section
    header: bytes  # what the node writes before the data; b"" for a raw file


@dataclass
class Target:
    """Where one prepared transfer goes: a model's layer range into a shard folder."""

    fingerprint: str
    model_id: str
    num_layers: int
    folder: Path
    files: dict[str, FileSpec]


@dataclass
class _Incoming:
    """A file being received into its part."""

    spec: FileSpec
    part: Path
    fd: int  # -1 once closed
    done: int  # data bytes written
    acked: int  # data bytes acked (fsynced)
    sha: "hashlib._Hash"


def encode_header(tensors: Iterable[pb.TensorEntry]) -> bytes:
    """The safetensors header (length prefix included) of tensors laid out back to back in
    this order, padded to 8 bytes so the data section is aligned."""
    header: dict = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _size(n: float) -> str:
    units = ("B", "KiB", "MiB", "GiB")
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class WeightStore:
    """Serves PrepareWeights/PushWeights for one node agent, over its models folder."""

    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root is not None else models_dir()
        self._targets: dict[str, Target] = {}  # prepared transfers, by fingerprint
        self._locks: dict[Path, threading.Lock] = {}
        self._locks_guard = threading.Lock()

    # ---- PrepareWeights ---------------------------------------------------------------------

    def prepare(self, manifest: pb.WeightManifest) -> pb.WeightNeeds:
        target = self._target(manifest)
        full = self.root / target.folder.name.rsplit("@", 1)[0]
        if self._is_whole_copy(full, target.fingerprint):
            log.info("weights of %s: this node's own copy %s", target.model_id, full)
            return pb.WeightNeeds(local_path=str(full), full_copy=True, files=[
                pb.FileHolding(name=f.name, have_bytes=f.size, complete=True)
                for f in target.files.values()])
        with self._folder_lock(target.folder):
            record = self._record(target)
            holdings, missing = [], 0
            for spec in target.files.values():
                have, complete = self._holding(target.folder, spec, record)
                holdings.append(pb.FileHolding(name=spec.name, have_bytes=have,
                                               complete=complete))
                if not complete:
                    missing += len(spec.header) + spec.size - have
            self._check_space(target, missing, manifest)
            target.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._targets[target.fingerprint] = target
        log.info("weights of %s layers [%d, %d): %s to receive into %s", target.model_id,
                 manifest.layer_start, manifest.layer_end, _size(missing), target.folder)
        return pb.WeightNeeds(local_path=str(target.folder), files=holdings)

    def _target(self, m: pb.WeightManifest) -> Target:
        def bad(message: str) -> WeightError:
            return WeightError(grpc.StatusCode.INVALID_ARGUMENT, f"bad weight manifest: {message}")

        if not _FINGERPRINT_RE.match(m.fingerprint):
            raise bad(f"fingerprint {m.fingerprint!r} is not a sha256 hex digest")
        safe_id = _UNSAFE_ID_RE.sub("_", m.model_id).lstrip(".")
        if not safe_id:
            raise bad(f"model id {m.model_id!r} names no folder")
        if not 0 <= m.layer_start < m.layer_end <= m.num_layers:
            raise bad(f"layer range [{m.layer_start}, {m.layer_end}) is not inside "
                      f"{m.num_layers} layers")
        files: dict[str, FileSpec] = {}
        for f in m.files:
            # (a loader that globs for weights below the folder must find none in a module
            # folder)
            if not _FILE_NAME_RE.match(f.name) or f.name.endswith(".part") \
                    or f.name == SHARD_RECORD or ("/" in f.name and ".safetensors" in f.name):
                raise bad(f"file name {f.name!r} is not allowed")
            if f.name in files:
                raise bad(f"file {f.name!r} appears twice")
            # mlx-lm loads model*.safetensors: a weight file must match, a raw file must not.
            if f.safetensors != (f.name.startswith("model") and f.name.endswith(".safetensors")
                                 and "/" not in f.name):
                raise bad(f"{f.name!r}: only model*.safetensors files carry tensors")
            if f.safetensors:
                names = [t.name for t in f.tensors]
                if not names or len(set(names)) != len(names) or not all(names):
                    raise bad(f"{f.name}: tensor names must be present and distinct")
                for t in f.tensors:
                    width = DTYPE_BYTES.get(t.dtype)
                    count = 1
                    for d in t.shape:
                        count *= d
                    if width is None or min(t.shape, default=0) < 0 \
                            or t.nbytes != count * width:
                        raise bad(f"{f.name}: tensor {t.name} ({t.dtype}, shape "
                                  f"{list(t.shape)}) cannot take {t.nbytes} bytes")
                if sum(t.nbytes for t in f.tensors) != f.size:
                    raise bad(f"{f.name}: its tensors do not add up to {f.size} bytes")
            elif f.tensors:
                raise bad(f"raw file {f.name!r} lists tensors")
            files[f.name] = FileSpec(f.name, f.size,
                                     encode_header(f.tensors) if f.safetensors else b"")
        folder = self.root / f"{safe_id}@{m.fingerprint[:12]}"
        return Target(m.fingerprint, m.model_id, m.num_layers, folder, files)

    def _is_whole_copy(self, folder: Path, fingerprint: str) -> bool:
        if not folder.is_dir() or (folder / SHARD_RECORD).exists():
            return False
        try:
            return content_fingerprint(folder) == fingerprint
        except (OSError, ValueError) as e:
            log.warning("%s is not usable as this model's copy: %s", folder, e)
            return False

    def _record(self, target: Target) -> ShardRecord:
        """The folder's record of verified files; a fresh one when there is none (or it belongs
        to another model that shares the fingerprint's prefix)."""
        try:
            record = read_shard_record(target.folder)
        except ModelError as e:
            log.warning("starting %s's record again: %s", target.folder, e)
            record = None
        if record is None or record.fingerprint != target.fingerprint:
            record = ShardRecord(target.model_id, target.fingerprint, target.num_layers, {})
        return record

    @staticmethod
    def _holding(folder: Path, spec: FileSpec, record: ShardRecord) -> tuple[int, bool]:
        """(data bytes held, complete) of one file; discards a part that cannot be resumed."""
        entry = record.files.get(spec.name)
        final = folder / spec.name
        if entry is not None and entry.get("size") == spec.size and final.is_file() \
                and final.stat().st_size == len(spec.header) + spec.size:
            return spec.size, True
        part = folder / f"{spec.name}.part"
        if not part.is_file():
            return 0, False
        size = part.stat().st_size
        with open(part, "rb") as f:
            header = f.read(len(spec.header))
        if header != spec.header or size > len(spec.header) + spec.size:
            log.warning("discarding %s: it is not a part of this manifest's file", part)
            part.unlink()
            return 0, False
        return size - len(spec.header), False

    def _check_space(self, target: Target, missing: int, m: pb.WeightManifest) -> None:
        where = target.folder
        while not where.exists():
            where = where.parent
        free = shutil.disk_usage(where).free
        if free < missing + FREE_SPACE_MARGIN_BYTES:
            raise WeightError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"not enough disk space on this node for {target.model_id} layers "
                f"[{m.layer_start}, {m.layer_end}): {_size(missing)} to receive into "
                f"{target.folder}, {_size(free)} free there (keeping "
                f"{_size(FREE_SPACE_MARGIN_BYTES)} spare). Free some space, or start the node "
                "with OMLX_CLUSTER_HOME on a larger disk.")

    def _folder_lock(self, folder: Path) -> "_Held":
        with self._locks_guard:
            lock = self._locks.setdefault(folder, threading.Lock())
        if not lock.acquire(timeout=LOCK_WAIT_SECONDS):
            raise WeightError(grpc.StatusCode.ABORTED,
                              f"another weight transfer into {folder} is still running")
        return _Held(lock)

    # ---- PushWeights ------------------------------------------------------------------------

    def receive(self, chunks: Iterable[pb.WeightChunk]) -> Iterator[pb.WeightAck]:
        """Writes a stream of chunks; yields acks. Raises WeightError for a chunk it refuses
        (files being received stay as parts). A sender that goes away ends the iteration of
        `chunks` with its own exception, which passes through."""
        target: Target | None = None
        held: _Held | None = None
        record: ShardRecord | None = None
        incoming: dict[str, _Incoming] = {}
        received = 0
        try:
            for chunk in chunks:
                if target is None:
                    target = self._targets.get(chunk.fingerprint)
                    if target is None:
                        raise WeightError(
                            grpc.StatusCode.FAILED_PRECONDITION,
                            f"no transfer of model fingerprint {chunk.fingerprint[:12]!r} was "
                            "prepared on this node: call PrepareWeights before PushWeights")
                    held = self._folder_lock(target.folder)
                    record = self._record(target)
                elif chunk.fingerprint != target.fingerprint:
                    raise WeightError(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"chunk for model fingerprint {chunk.fingerprint[:12]!r} in a transfer "
                        f"of {target.fingerprint[:12]!r}")
                inc = incoming.get(chunk.file)
                if inc is None:
                    inc = incoming[chunk.file] = self._open(target, record, chunk.file)
                ack = self._write(target, record, inc, chunk)
                received += len(chunk.data)
                if ack is not None and ack.complete:
                    del incoming[chunk.file]
                if ack is not None:
                    yield ack
        except OSError as e:
            code = (grpc.StatusCode.RESOURCE_EXHAUSTED if e.errno == errno.ENOSPC
                    else grpc.StatusCode.INTERNAL)
            raise WeightError(code, f"this node could not write the weights: {e}") from e
        finally:
            for inc in incoming.values():
                if inc.fd >= 0:
                    os.close(inc.fd)
            if held is not None:
                held.release()
            if target is not None:
                log.info("received %s of %s into %s%s", _size(received), target.model_id,
                         target.folder, f" ({len(incoming)} file(s) left partial)"
                         if incoming else "")

    def _open(self, target: Target, record: ShardRecord, name: str) -> _Incoming:
        spec = target.files.get(name)
        if spec is None:
            raise WeightError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"file {name!r} is not in the prepared manifest")
        if self._holding(target.folder, spec, record)[1]:
            raise WeightError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{name} is complete on this node already")
        part = target.folder / f"{name}.part"
        part.parent.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(part, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                os.pwrite(fd, spec.header, 0)
                size = len(spec.header)
            sha = hashlib.sha256()
            # A resumed part: its bytes count towards the sha256 the sender checks.
            pos = len(spec.header)
            while pos < size:
                block = os.pread(fd, min(_READ_BLOCK, size - pos), pos)
                if not block:
                    break
                sha.update(block)
                pos += len(block)
        except BaseException:
            os.close(fd)
            raise
        done = size - len(spec.header)
        return _Incoming(spec, part, fd, done, done, sha)

    def _write(self, target: Target, record: ShardRecord, inc: _Incoming,
               chunk: pb.WeightChunk) -> pb.WeightAck | None:
        spec, data = inc.spec, chunk.data
        if chunk.offset != inc.done:
            raise WeightError(grpc.StatusCode.OUT_OF_RANGE,
                              f"{spec.name}: chunk at offset {chunk.offset}, but this node holds "
                              f"{inc.done} bytes of it (send from there)")
        if len(data) > CHUNK_MAX_BYTES or inc.done + len(data) > spec.size:
            raise WeightError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{spec.name}: a chunk of {len(data)} bytes at offset "
                              f"{chunk.offset} is too large or runs past its {spec.size} bytes")
        if not data and inc.done < spec.size:
            raise WeightError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{spec.name}: empty chunk at offset {chunk.offset}")
        if zlib.crc32(data) != chunk.crc32:
            raise WeightError(grpc.StatusCode.DATA_LOSS,
                              f"{spec.name}: the chunk at offset {chunk.offset} fails its crc32 "
                              "check (corrupted in transit); none of it was written")
        view, pos = memoryview(data), len(spec.header) + inc.done
        while view:
            n = os.pwrite(inc.fd, view, pos)
            view, pos = view[n:], pos + n
        inc.sha.update(data)
        inc.done += len(data)
        if inc.done == spec.size:
            return self._finish(target, record, inc, chunk.sha256)
        if inc.done - inc.acked >= ACK_EVERY_BYTES:
            os.fsync(inc.fd)
            inc.acked = inc.done
            return pb.WeightAck(file=spec.name, bytes_done=inc.done)
        return None

    def _finish(self, target: Target, record: ShardRecord, inc: _Incoming,
                sha256: bytes) -> pb.WeightAck:
        spec = inc.spec
        if not sha256:
            raise WeightError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{spec.name}: its last chunk carries no sha256")
        digest = inc.sha.digest()
        if digest != sha256:
            os.close(inc.fd)
            inc.fd = -1
            inc.part.unlink(missing_ok=True)
            raise WeightError(
                grpc.StatusCode.DATA_LOSS,
                f"{spec.name}: the sha256 of the {spec.size} bytes received ({digest.hex()[:16]}"
                f"...) is not the sender's ({sha256.hex()[:16]}...): some bytes held on this "
                "node were corrupt. The part was deleted; send the file again.")
        os.fsync(inc.fd)
        os.close(inc.fd)
        inc.fd = -1
        os.replace(inc.part, target.folder / spec.name)
        _fsync_dir(inc.part.parent)
        record.files[spec.name] = {"size": spec.size, "sha256": digest.hex()}
        write_shard_record(target.folder, record)
        return pb.WeightAck(file=spec.name, bytes_done=spec.size, complete=True)


class _Held:
    """A folder lock taken with a deadline; usable as a context manager."""

    def __init__(self, lock: threading.Lock):
        self._lock = lock

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> "_Held":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
