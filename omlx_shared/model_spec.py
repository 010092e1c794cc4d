"""What a `--model` value names: a folder, a model in the store, a Hugging Face id, or the
default model."""

from __future__ import annotations

from pathlib import Path

from omlx_shared.default_model import pull_default
from omlx_shared.hub import is_hub_id, resolve_hub_model
from omlx_shared.model_store import (
    DEFAULT_MODEL_NAME,
    ModelError,
    list_models,
    models_dir,
    read_shard_record,
    validate_model_dir,
)


def resolve_model(spec: str | None, progress: bool = True, fetch: bool = True) -> Path:
    """Turn a `--model` value into a validated model folder.

    None means the default model, imported into the store on first use. Otherwise `spec` is a
    folder path, the name of a model in the store, or a Hugging Face id (`ORG/NAME`, from the
    hub cache or downloaded unless not `fetch`); a folder wins over a store name, and both
    over a hub id.
    """
    if spec is None:
        return pull_default(progress=progress)
    candidate = Path(spec).expanduser()
    if candidate.is_dir():
        _refuse_shard(candidate)
        validate_model_dir(candidate)
        return candidate.resolve()
    stored = models_dir() / spec
    if stored.is_dir():
        _refuse_shard(stored)
        validate_model_dir(stored)
        return stored
    if spec == DEFAULT_MODEL_NAME:
        return pull_default(progress=progress)
    if is_hub_id(spec):
        return resolve_hub_model(spec, fetch=fetch)
    names = [info.name for info in list_models()]
    known = ", ".join(names) if names else "none yet"
    raise ModelError(
        f"{spec!r} is neither a model folder nor a model in the store ({models_dir()}). "
        f"Stored models: {known}. Pass a Hugging Face id (`--model ORG/NAME`, e.g. "
        f"mlx-community/Qwen3-4B-4bit), import a GGUF file with "
        f"`omlx-cluster models import-gguf FILE.gguf`, or pass an mlx-lm model folder with "
        f"`--model PATH`."
    )


def served_name(spec: str | None, path: Path) -> str:
    """The name clients send for a model given as `spec`: a hub id as written (`ORG/NAME`, as
    mlx_lm.server and the other peers name it), else its folder's name."""
    if spec and is_hub_id(spec) and not Path(spec).expanduser().is_dir():
        return "/".join(spec.split("/")[:2])
    return path.name


def _refuse_shard(path: Path) -> None:
    if (record := read_shard_record(path)) is not None:
        raise ModelError(
            f"{path} holds only part of {record.model_id} ({record.describe()}), received from a "
            f"coordinator for a pipeline stage; serve the whole model's folder instead.")
