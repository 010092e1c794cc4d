"""Ollama's embedding routes over the encoding core: POST /api/embed (`input` a string or a list
of them; `truncate`, default true, cuts an input past the model's limit instead of refusing it;
`dimensions`; reply `embeddings`, one list a input, with Ollama's timings in nanoseconds and
`prompt_eval_count`) and the older POST /api/embeddings (`prompt`; reply `embedding`).
keep_alive works as on /api/chat (api/ollama.py)."""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI, Request
from fastapi.params import Depends
from pydantic import Field, field_validator

from omlx_coordinator.api.embeddings import embed, embedding_inputs
from omlx_coordinator.api.ollama import _keep_alive, apply_keep_alive
from omlx_coordinator.api.ollama_models import find
from omlx_coordinator.api.ollama_schema import Options, _Strict, keep_alive_seconds, validated
from omlx_coordinator.frontdoor.access import account_of, admit
from omlx_coordinator.models.lifecycle import ModelManager
from omlx_coordinator.models.served_model import LOADED
from omlx_coordinator.request.generation import GatewaySettings, check_servable
from omlx_shared.model_kinds import EMBED


class _Embedding(_Strict):
    model: str = Field(min_length=1)
    options: Options | None = None  # accepted: nothing in them changes an embedding
    keep_alive: float | str | None = None
    truncate: bool = True

    @field_validator("keep_alive")
    @classmethod
    def _duration(cls, v: float | str | None) -> float | str | None:
        if v is not None:
            keep_alive_seconds(v)  # refused here, where the error names the field
        return v


class EmbedRequest(_Embedding):
    input: str | list[str]
    dimensions: int | None = Field(None, ge=1)


class EmbeddingsRequest(_Embedding):
    prompt: str


def add_routes(app: FastAPI, manager: ModelManager, settings: GatewaySettings,
               keyed: list[Depends]) -> None:
    async def rows(request: Request, body: _Embedding, given, dimensions: int | None):
        served = await check_servable(manager, find(manager, body.model).name,
                                      account_of(request.scope), EMBED)
        inputs = await asyncio.to_thread(embedding_inputs, served, given, "input",
                                         body.truncate)
        admit(request.scope, served)
        apply_keep_alive(served, _keep_alive(request, body))
        waited = served.state != LOADED
        out = await embed(manager, served, settings, inputs, request, dimensions)
        return served, inputs, out, waited

    @app.post("/api/embed", dependencies=keyed)
    async def ollama_embed(request: Request) -> dict:
        started = time.perf_counter_ns()
        body = validated(EmbedRequest, await request.json())
        served, inputs, out, waited = await rows(request, body, body.input, body.dimensions)
        total = time.perf_counter_ns() - started
        return {"model": served.name, "embeddings": out.tolist(), "total_duration": total,
                "load_duration": round(served.load_seconds * 1e9) if waited else 0,
                "prompt_eval_count": sum(len(x) for x in inputs)}

    @app.post("/api/embeddings", dependencies=keyed)
    async def ollama_embeddings(request: Request) -> dict:
        body = validated(EmbeddingsRequest, await request.json())
        _, _, out, _ = await rows(request, body, body.prompt, None)
        return {"embedding": out[0].tolist()}
