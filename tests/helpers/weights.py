"""Node agents that receive weights over the network, and pushing chunks to them."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from omlx_coordinator.nodes.node_client import AgentClient
from omlx_coordinator.nodes.weight_transfer import SourceFile
from omlx_node.weight_store import CHUNK_MAX_BYTES
from omlx_shared import auth
from omlx_shared.child import ChildProcess, omlx_command
from omlx_shared.model_store import read_shard_record
from omlx_shared.safetensors_header import read_header
from proto import omlx_pb2 as pb
from tests.cluster_secret import SECRET


@contextmanager
def agent_process(home: Path, name: str = "mac", cmd_prefix: tuple[str, ...] = ()
                  ) -> Iterator[tuple[ChildProcess, str]]:
    """A real `omlx-cluster node` with its own store; yields it and its gRPC address."""
    env = dict(os.environ, OMLX_CLUSTER_HOME=str(home), **{auth.SECRET_ENV: SECRET})
    proc = ChildProcess([*cmd_prefix, *omlx_command("node", "--port", "0", "--name", name)],
                        f"node agent {name}", env=env)
    try:
        info = proc.wait_ready(60)
        yield proc, f"127.0.0.1:{info['port']}"
    finally:
        proc.stop()


async def admitted(address: str, name: str = "mac") -> AgentClient:
    agent = AgentClient(address, name, SECRET)
    await agent.admit()
    return agent


def assert_holds_exactly(folder: Path, files: list[SourceFile]) -> None:
    """The folder holds these files, byte for byte (headers name only their tensors), verified
    in shard.json, and nothing else: no other layer, no part left."""
    record = read_shard_record(folder)
    assert record is not None
    names = {f.name for f in files}
    assert {p.name for p in folder.iterdir()} == names | {"shard.json"}
    for f in files:
        data = source_bytes(f)
        assert record.files[f.name]["sha256"] == hashlib.sha256(data).hexdigest()
        if f.safetensors:
            header = read_header(folder / f.name)
            assert list(header.tensors) == [t.name for t in f.tensors]
            assert (folder / f.name).read_bytes()[header.data_start:] == data
        else:
            assert (folder / f.name).read_bytes() == data


async def push(agent: AgentClient, chunks: list[pb.WeightChunk]) -> list[pb.WeightAck]:
    async def stream():
        for c in chunks:
            yield c

    call = agent.stub.PushWeights(stream(), metadata=agent.metadata, timeout=30)
    return [ack async for ack in call]


def chunk(fingerprint: str, file: SourceFile, offset: int, n: int = CHUNK_MAX_BYTES,
          crc: int | None = None) -> pb.WeightChunk:
    data = source_bytes(file)[offset:offset + n]
    return pb.WeightChunk(fingerprint=fingerprint, file=file.name, offset=offset, data=data,
                          crc32=zlib.crc32(data) if crc is None else crc)


def _can_mount() -> str:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "needs root and unshare(1) to mount a small tmpfs"
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "true"],
                       capture_output=True, timeout=10)
    return "" if r.returncode == 0 else f"unshare -m fails: {r.stderr.decode()[:200]}"


def source_bytes(file: SourceFile) -> bytes:
    """The data section the node must end up with, read from the coordinator's files."""
    out = bytearray()
    for s in file.segments:
        with open(s.path, "rb") as f:
            f.seek(s.offset)
            out += f.read(s.nbytes)
    return bytes(out)
