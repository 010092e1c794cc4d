"""A JSON-schema grammar and what a two-stage pipeline of workers generates under it."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path

import grpc
import jsonschema
import llguidance

from proto import omlx_pb2 as pb
from proto import omlx_pb2_grpc as pb_grpc
from tests.conftest import free_port
from tests.helpers.session import generate_chunks
from tests.helpers.workers import stage_worker

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "n", "ok"],
    "additionalProperties": False,
}


# No free whitespace: a random model would otherwise fill its budget with it.
GRAMMAR = llguidance.LLMatcher.grammar_from_json_schema(
    SCHEMA, defaults={"whitespace_flexible": False})


def parse(tok, tokens: list[int]) -> dict:
    value = json.loads(tok.decode(tokens))
    jsonschema.validate(value, SCHEMA)
    return value


@contextmanager
def two_stages(head: Path, tail: Path, micro_batches: int):
    """A pipeline of two shard workers, layer 0 on `head`'s folder and layer 1 on `tail`'s;
    yields the head's ShardWorker stub."""
    peers = (f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}")
    workers = [stage_worker(folder, r, (r, r + 1), peers, ("--prefill-chunk", "8"),
                            micro_batches=micro_batches)
               for r, folder in enumerate((head, tail))]
    try:
        port = [w.wait_ready(120) for w in workers][0]["port"]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield pb_grpc.ShardWorkerStub(channel)
    finally:
        for w in workers:
            w.stop()


def generate(stub, ids: list[int], max_tokens: int, **fields) -> list[pb.TokenChunk]:
    return generate_chunks(stub, pb.GenerateRequest(
        request_id=str(time.monotonic_ns()), prompt_tokens=ids, max_tokens=max_tokens,
        **fields))


def tokens_of(chunks: list[pb.TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.tokens]
