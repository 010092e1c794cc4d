"""The encoding core: one request through an embedding, reranking or speech-to-text model's
worker, as the generation core does a chat request's (omlx_coordinator/request/generation.py): the
model is loaded on demand (evicting least recently used idle models), the request holds a lease
from the replica it is given to its answer, and a call that lost its node runs again on the
next plan. What the embedding adapters (api/embeddings.py, api/ollama_embed.py) send are token
ids: the coordinator tokenizes, as it does for chat; audio goes to the node as uploaded
(api/audio.py).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
import numpy as np

from omlx_coordinator.errors import APIError
from omlx_coordinator.frontdoor.access import Account
from omlx_coordinator.models.lifecycle import ModelManager
from omlx_coordinator.models.served_model import ServedModel
from omlx_coordinator.nodes.node_client import WorkerClient
from omlx_coordinator.request.generation import GatewaySettings, _rpc_error
from omlx_coordinator.request.request_lease import RequestLease
from omlx_coordinator.request.retry import Fail, RetryState, lost_by
from omlx_shared.token_ids import outside_vocabulary
from proto import omlx_pb2 as pb

log = logging.getLogger(__name__)
T = TypeVar("T")


def check_inputs(model: ServedModel, inputs: list[list[int]], param: str) -> None:
    """A 400 for an empty list, an empty input, ids outside the vocabulary, or an input longer
    than the model takes (naming its limit)."""
    if not inputs:
        raise APIError(400, f"{param} is empty: send one input or more", param=param)
    for i, ids in enumerate(inputs):
        if not ids:
            raise APIError(400, f"{param}[{i}] encodes to no tokens", param=param)
        if model.max_context and len(ids) > model.max_context:
            raise APIError(400, f"{param}[{i}] has {len(ids)} tokens but the model "
                                f"{model.name} takes at most {model.max_context}; shorten it "
                                "or split it into chunks", param=param,
                           code="context_length_exceeded")
        if bad := outside_vocabulary(ids, model.vocab_size):
            raise APIError(400, f"{param}[{i}]: token ids {bad[:5]} are outside the model's "
                                f"vocabulary [0, {model.vocab_size})", param=param)


async def encode(manager: ModelManager, model: ServedModel, settings: GatewaySettings,
                 inputs: list[list[int]], types: list[list[int]] | None = None,
                 account: Account | None = None) -> np.ndarray:
    """One row per input (an embedding, or a score in a row of one), in input order; raises
    APIError."""
    request = pb.EncodeRequest(request_id=uuid.uuid4().hex, inputs=[
        pb.EncodeInput(tokens=ids, type_ids=(types[i] if types else ()))
        for i, ids in enumerate(inputs)])
    reply = await _call(manager, model, settings, lambda node, timeout: node.encode(
        request, timeout), sum(len(x) for x in inputs), account)
    return np.asarray(reply.values, dtype=np.float32).reshape(len(inputs), reply.dim)


async def transcribe(manager: ModelManager, model: ServedModel, settings: GatewaySettings,
                     request: pb.TranscribeRequest, account: Account | None = None
                     ) -> pb.TranscribeReply:
    """A speech-to-text model's transcript of `request`'s audio; raises APIError."""
    return await _call(manager, model, settings, lambda node, timeout: node.transcribe(
        request, timeout), 0, account)


async def _call(manager: ModelManager, model: ServedModel, settings: GatewaySettings,
                call: Callable[[WorkerClient, float], Awaitable[T]], tokens: int,
                account: Account | None) -> T:
    """`call` on a ready replica of `model` (loaded on demand) under a lease; again on the next
    plan when its node went away, as retry.py rules; `tokens` count in the usage."""
    deadline = time.monotonic() + settings.request_timeout
    failed, retry = False, RetryState()
    try:
        async with RequestLease(manager, model, deadline, settings.keepalive_seconds) as lease:
            while True:  # RetryState ends the attempts
                async for _ in lease.replica(retry.avoid):
                    pass
                try:
                    return await call(lease.deployment.node,
                                      max(1.0, deadline - time.monotonic()))
                except grpc.aio.AioRpcError as e:
                    if (lost := lost_by(e)) is None:
                        raise _rpc_error(e) from None
                if isinstance(step := retry.on_lost(lease.lost(), lost), Fail):
                    log.error(step.log)
                    raise step.error from None
    except Exception:
        failed = True
        raise
    finally:
        if account is not None:
            account.finished(model.name, tokens, 0, 0, failed)
