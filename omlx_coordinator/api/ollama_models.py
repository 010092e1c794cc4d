"""The Ollama API's model routes: /api/tags, /api/show, /api/ps, /api/version, and the ones that
manage Ollama's own model store (pull, push, create, copy, delete, blobs), which answer what to
do instead here; /api/embed and /api/embeddings, until an embedding model can be served.

Models are the gateway's (`--model NAME=PATH`), named as they are everywhere else; a name with
Ollama's default tag (`NAME:latest`, what Ollama's clients add to a bare name) reaches NAME.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timedelta, timezone

from fastapi import FastAPI, Request
from fastapi.params import Depends
from fastapi.responses import JSONResponse, Response

from omlx_coordinator.api.ollama_schema import ShowRequest, validated
from omlx_coordinator.errors import APIError
from omlx_coordinator.frontdoor.access import usable
from omlx_coordinator.models.lifecycle import ModelManager
from omlx_coordinator.models.served_model import LOADED, ServedModel
from omlx_shared.model_kinds import CHAT, EMBED

# The Ollama release whose API these routes follow: clients read it to tell what they may send.
OLLAMA_VERSION = "0.12.0"
LATEST = ":latest"
# /api/ps's expiry of a model with no idle limit, as Ollama shows keep_alive -1: far away.
_NEVER = datetime(2318, 1, 1, tzinfo=timezone.utc)
# Ollama's names of unquantized weights' types.
_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
_STORE_ADVICE = {
    "pull": "models are fetched with `omlx-cluster models pull ORG/NAME` (a Hugging Face id) and "
            "served with `--model NAME=PATH`",
    "push": "pushing models to a registry is not supported here",
    "create": "models are not made from Modelfiles here: convert one with mlx-lm (or "
              "`omlx-cluster models import-gguf FILE`) and serve it with `--model NAME=PATH`",
    "copy": "a model's other names are aliases here: serve it with `--alias ALIAS=NAME`",
    "delete": "models are unloaded with `omlx-cluster models unload NAME`; the files stay where "
              "`--model` found them",
    "blobs": "model files are not uploaded here: serve a folder with `--model NAME=PATH`",
}


def rfc3339(at: datetime) -> str:
    return at.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")


def served_name(manager: ModelManager, name: str) -> str:
    """The name a request means: `NAME:latest` is NAME where only NAME is served."""
    if manager.resolve(name) is None and name.endswith(LATEST):
        bare = name.removesuffix(LATEST)
        if manager.resolve(bare) is not None:
            return bare
    return name


def find(manager: ModelManager, name: str) -> ServedModel:
    model = manager.resolve(served_name(manager, name))
    if model is None:
        names = ", ".join(repr(m.name) for m in manager.models)
        raise APIError(404, f"model {name!r} not found; served here: {names} (GET /api/tags)",
                       param="model", code="model_not_found")
    return model


def _config(model: ServedModel) -> dict:
    return json.loads((model.path / "config.json").read_text())


def _digest(model: ServedModel) -> str:
    """Stable while the model's files are: what clients compare to tell models apart."""
    h = hashlib.sha256(model.name.encode())
    h.update((model.path / "config.json").read_bytes())
    h.update(str(model.layout.total_weight_bytes).encode())
    return h.hexdigest()


def _modified_at(model: ServedModel) -> str:
    mtime = (model.path / "config.json").stat().st_mtime
    return rfc3339(datetime.fromtimestamp(mtime, timezone.utc))


def _details(config: dict) -> dict:
    family = config.get("model_type", "")
    quant = config.get("quantization") or config.get("quantization_config") or {}
    bits = quant.get("bits") if isinstance(quant, dict) else None
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "")
    level = f"Q{bits}" if bits else _DTYPES.get(dtype, dtype.upper())
    return {"parent_model": "", "format": "safetensors", "family": family,
            "families": [family] if family else None, "parameter_size": "",
            "quantization_level": level}


def _card(model: ServedModel, config: dict) -> dict:
    return {"name": model.name, "model": model.name, "modified_at": _modified_at(model),
            "size": model.layout.total_weight_bytes, "digest": _digest(model),
            "details": _details(config)}


def _expires_at(model: ServedModel) -> str:
    if not model.ttl_seconds or model.pinned:
        return rfc3339(_NEVER)
    left = max(0.0, model.ttl_seconds - model.idle_seconds()) if not model.leases \
        else model.ttl_seconds
    return rfc3339(datetime.now(timezone.utc) + timedelta(seconds=left))


def _capabilities(model: ServedModel) -> list[str]:
    if model.kind.kind != CHAT:  # Ollama's word for what /api/embed serves; a reranker's own
        return ["embedding" if model.kind.kind == EMBED else model.kind.kind]
    caps = ["completion"]
    if model.tokenizer.tool_call_format is not None:
        caps.append("tools")
    return caps


def _show(model: ServedModel) -> dict:
    config = _config(model)
    arch = config.get("model_type", "")
    info = {"general.architecture": arch, "general.basename": model.name,
            f"{arch}.context_length": model.max_context or None,
            f"{arch}.block_count": model.layout.num_layers,
            f"{arch}.embedding_length": config.get("hidden_size"),
            f"{arch}.vocab_size": model.vocab_size}
    template = getattr(model.tokenizer.tokenizer, "chat_template", None)
    return {"license": "", "modelfile": f"# served by omlx-cluster from {model.path}\n",
            "parameters": "", "template": template if isinstance(template, str) else "",
            "details": _details(config), "model_info": info,
            "capabilities": _capabilities(model), "modified_at": _modified_at(model)}


def add_routes(app: FastAPI, manager: ModelManager, keyed: list[Depends]) -> None:
    @app.get("/api/version", dependencies=keyed)
    async def version() -> dict:
        return {"version": OLLAMA_VERSION}

    @app.get("/api/tags", dependencies=keyed)
    async def tags(request: Request) -> dict:
        """Every model served here, loaded or not (those the key may use)."""
        return {"models": [_card(m, _config(m)) for m in usable(request.scope, manager.models)]}

    @app.get("/api/ps", dependencies=keyed)
    async def ps(request: Request) -> dict:
        """The loaded models; `expires_at` follows their idle limit (--ttl, keep_alive)."""
        out = []
        for m in usable(request.scope, manager.models):
            if m.state != LOADED:
                continue
            card = _card(m, _config(m))
            del card["modified_at"]
            out.append({**card, "expires_at": _expires_at(m),
                        "size_vram": m.layout.total_weight_bytes,
                        "context_length": m.max_context or None})
        return {"models": out}

    @app.post("/api/show", dependencies=keyed)
    async def show(request: Request) -> dict:
        body = validated(ShowRequest, await request.json())
        if not (body.model or body.name):
            raise APIError(400, "'model': name the model to show", param="model")
        return _show(find(manager, body.model or body.name or ""))

    @app.post("/api/pull", dependencies=keyed)
    async def pull(request: Request) -> Response:
        """A model served here already is pulled, as Ollama answers for one it has."""
        body = await request.json()
        name = body.get("model") or body.get("name") if isinstance(body, dict) else None
        if isinstance(name, str) and manager.resolve(served_name(manager, name)) is not None:
            return JSONResponse({"status": "success"})
        return _store_refusal("pull")

    # One route a method: the OpenAPI schema names each operation by its route's first.
    for action, path, methods in (("push", "/api/push", ["POST"]),
                                  ("create", "/api/create", ["POST"]),
                                  ("copy", "/api/copy", ["POST"]),
                                  ("delete", "/api/delete", ["DELETE", "POST"]),
                                  ("blobs", "/api/blobs/{digest}", ["HEAD", "POST"])):
        for method in methods:
            app.add_api_route(path, _refuser(action), dependencies=keyed, methods=[method],
                              name=f"ollama_{action}_{method.lower()}")



def _store_refusal(action: str) -> Response:
    return JSONResponse({"error": f"/api/{action} is Ollama's model store, which this server "
                                  f"does not have: {_STORE_ADVICE[action]}"}, status_code=501)


def _refuser(action: str):
    async def refuse() -> Response:
        return _store_refusal(action)
    refuse.__name__ = f"ollama_{action}"
    return refuse
