"""The real gateway app, in-process and without nodes: the model's tokenizer is real (a tiny
Qwen-style one with a tool-call template), and only what needs a node is stood in for, so a
valid request is answered ("ok", finish "stop") and every other one meets the real parsers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import httpx
from fastapi import FastAPI

from omlx_coordinator.api import anthropic, ollama, openai
from omlx_coordinator.http.gateway import create_app
from omlx_coordinator.nodes.cluster import ClusterOptions
from omlx_coordinator.request.events import Delta, Done
from omlx_coordinator.request.generation import GenerationRequest, check_servable
from tests.tiny_models import serving, tiny_qwen

MODEL = "tiny-inproc"


def build(dest: Path) -> Path:
    """A tiny model folder whose template can call tools (`json_tools`)."""
    return tiny_qwen(dest / MODEL, num_layers=1, hidden_size=32)


async def _answer(manager, model, metrics, settings, req: GenerationRequest) -> AsyncIterator:
    yield Delta("ok")
    yield Done("stop", len(req.prompt), 1)


@contextmanager
def app_for(model: Path) -> Iterator[FastAPI]:
    manager = serving(model, MODEL, ClusterOptions(nodes=0))

    async def servable(_manager, name: str, account=None):
        # Any other name meets the real check (a 404 that lists the served model).
        return manager.main.model if name == MODEL else await check_servable(manager, name, account)

    with mock.patch.multiple(openai, check_servable=servable, generate=_answer), \
            mock.patch.multiple(anthropic, check_servable=servable, generate=_answer), \
            mock.patch.multiple(ollama, check_servable=servable, generate=_answer):
        yield create_app(manager, start_cluster=False)


def client(app: FastAPI, timeout: float = 10) -> httpx.AsyncClient:
    # Starlette re-raises what its catch-all handler answered: the answer is what is tested.
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=timeout)
