"""OpenAI's /v1/embeddings and the rerank API (/v1/rerank, as llama.cpp, vllm-mlx, Jina and
Cohere's clients send it) over the encoding core (omlx_coordinator/request/encoding.py).

Embeddings: `input` a string, a list of strings, a list of token ids or a list of lists of
them; `encoding_format` float or base64 (little-endian float32, what the `openai` SDK asks
for by default); `dimensions` keeps the first N components and normalises them again
(Matryoshka truncation: meaningful for models trained for it, such as Qwen3-Embedding).
Rerank: `query`, `documents` (strings, or objects with a `text`), `top_n`, `return_documents`
(default true) and, for decoder rerankers, `instruction` (Qwen3-Reranker's task line); results
sorted by score, best first, each with its index in `documents`. A cross-encoder's score is its
logit, a decoder reranker's the probability of "yes".
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Any, Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.params import Depends
from pydantic import Field

from omlx_coordinator.api.openai_schema import _Strict
from omlx_coordinator.errors import APIError
from omlx_coordinator.frontdoor.access import account_of, admit
from omlx_coordinator.models.lifecycle import ModelManager
from omlx_coordinator.models.served_model import ServedModel
from omlx_coordinator.request.encoding import check_inputs, encode
from omlx_coordinator.request.generation import GatewaySettings, check_servable
from omlx_coordinator.text.tokenizer import MAX_CHARS_PER_TOKEN
from omlx_shared.model_kinds import EMBED, RERANK

MAX_INPUTS = 2048  # OpenAI's bound on one request's inputs
# Qwen3-Reranker's prompt, as its model card builds it.
RERANK_SYSTEM = ("<|im_start|>system\nJudge whether the Document meets the requirements based "
                 "on the Query and the Instruct provided. Note that the answer can only be "
                 "\"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


class EmbeddingRequest(_Strict):
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None  # metadata


class _Document(_Strict):
    text: str


class RerankRequest(_Strict):
    model: str
    query: str
    documents: list[str | _Document] = Field(max_length=MAX_INPUTS)
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = True
    instruction: str | None = None  # decoder rerankers' task line


def _tokenize(model: ServedModel, texts: list[str], param: str,
              pairs: list[str] | None = None) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids (and token type ids, for a pair) of each text with the tokenizer's special
    tokens; a 400 for a text too long to tokenize cheaply, naming the model's limit."""
    tok = model.tokenizer.tokenizer
    ids, types = [], []
    for i, text in enumerate(texts):
        chars = len(text) + (len(pairs[i]) if pairs else 0)
        if model.max_context and chars > model.max_context * MAX_CHARS_PER_TOKEN:
            raise APIError(400, f"{param}[{i}] has {chars} characters, more than the model "
                                f"{model.name} takes (at most {model.max_context} tokens); "
                                "shorten it or split it into chunks", param=param,
                           code="context_length_exceeded")
        out = tok(text, pairs[i]) if pairs else tok(text)
        ids.append(list(out["input_ids"]))
        types.append(list(out.get("token_type_ids") or []))
    return ids, types


def embedding_inputs(model: ServedModel, given: Any, param: str = "input",
                     truncate: bool = False) -> list[list[int]]:
    """The token ids of an embeddings request's `input` (text or ids), checked; `truncate`
    cuts each to the model's limit (Ollama's default) instead of refusing it."""
    if isinstance(given, str):
        given = [given]
    if len(given) > MAX_INPUTS:
        raise APIError(400, f"{param} has {len(given)} items; at most {MAX_INPUTS} a request",
                       param=param)
    if given and isinstance(given[0], int):
        inputs = [list(given)]
    elif given and isinstance(given[0], list):
        inputs = [list(x) for x in given]
    else:
        texts = list(given)
        if truncate and model.max_context:  # what is cut off would be cut as tokens anyway
            texts = [t[:model.max_context * MAX_CHARS_PER_TOKEN] for t in texts]
        inputs = _tokenize(model, texts, param)[0]
    if truncate and model.max_context:
        inputs = [x[:model.max_context] for x in inputs]
    check_inputs(model, inputs, param)
    return inputs


async def embed(manager: ModelManager, model: ServedModel, settings: GatewaySettings,
                inputs: list[list[int]], request: Request,
                dimensions: int | None = None) -> np.ndarray:
    """The rows of `inputs`, cut to `dimensions` (and normalised again, for a model whose
    embeddings are unit vectors)."""
    rows = await encode(manager, model, settings, inputs, account=account_of(request.scope))
    if dimensions is not None:
        if dimensions > rows.shape[1]:
            raise APIError(400, f"dimensions {dimensions} is more than the model's "
                                f"{rows.shape[1]}", param="dimensions")
        rows = rows[:, :dimensions]
        if model.kind.normalize:
            rows = rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-9)
    return rows


def _rerank_inputs(model: ServedModel, body: RerankRequest, docs: list[str]
                   ) -> tuple[list[list[int]], list[list[int]] | None]:
    if model.kind.encoder:  # a cross-encoder reads (query, document) as a pair
        ids, types = _tokenize(model, [body.query] * len(docs), "documents", docs)
        return ids, types if any(types) else None
    instruction = body.instruction or RERANK_INSTRUCTION
    texts = [f"{RERANK_SYSTEM}<Instruct>: {instruction}\n<Query>: {body.query}\n"
             f"<Document>: {d}{RERANK_SUFFIX}" for d in docs]
    return [model.tokenizer.encode_text(t, "documents") for t in texts], None


def add_routes(app: FastAPI, manager: ModelManager, settings: GatewaySettings,
               keyed: list[Depends]) -> None:
    @app.post("/v1/embeddings", dependencies=keyed)
    async def embeddings(body: EmbeddingRequest, request: Request) -> dict:
        served = await check_servable(manager, body.model, account_of(request.scope), EMBED)
        inputs = await asyncio.to_thread(embedding_inputs, served, body.input)
        admit(request.scope, served)
        rows = await embed(manager, served, settings, inputs, request, body.dimensions)
        tokens = sum(len(x) for x in inputs)
        if body.encoding_format == "base64":
            data = [base64.b64encode(r.astype("<f4").tobytes()).decode() for r in rows]
        else:
            data = rows.tolist()
        return {"object": "list", "model": served.name,
                "data": [{"object": "embedding", "index": i, "embedding": e}
                         for i, e in enumerate(data)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    @app.post("/v1/rerank", dependencies=keyed)
    async def rerank(body: RerankRequest, request: Request) -> dict:
        served = await check_servable(manager, body.model, account_of(request.scope), RERANK)
        docs = [d if isinstance(d, str) else d.text for d in body.documents]
        if not docs:
            raise APIError(400, "documents is empty: send one document or more",
                           param="documents")
        ids, types = await asyncio.to_thread(_rerank_inputs, served, body, docs)
        check_inputs(served, ids, "documents")
        admit(request.scope, served)
        rows = await encode(manager, served, settings, ids, types, account_of(request.scope))
        scores = rows[:, 0].tolist()
        order = sorted(range(len(docs)), key=lambda i: -scores[i])[:body.top_n or len(docs)]
        tokens = sum(len(x) for x in ids)
        return {"id": uuid.uuid4().hex, "object": "list", "model": served.name,
                "results": [{"index": i, "relevance_score": scores[i],
                             **({"document": {"text": docs[i]}} if body.return_documents
                                else {})} for i in order],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
