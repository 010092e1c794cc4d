"""What a `--model` value names: a folder, a model in the store, or the default model."""

from __future__ import annotations

from pathlib import Path

from omlx_shared.default_model import pull_default
from omlx_shared.model_store import (
    DEFAULT_MODEL_NAME,
    ModelError,
    list_models,
    models_dir,
    read_shard_record,
    validate_model_dir,
)


def resolve_model(spec: str | None, progress: bool = True) -> Path:
    """Turn a `--model` value into a validated model folder.

    None means the default model, imported into the store on first use. Otherwise `spec` is a
    folder path or the name of a model in the store; a folder wins over a store name.
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
    names = [info.name for info in list_models()]
    known = ", ".join(names) if names else "none yet"
    raise ModelError(
        f"{spec!r} is neither a model folder nor a model in the store ({models_dir()}). "
        f"Stored models: {known}. Import a GGUF file with "
        f"`omlx-cluster models import-gguf FILE.gguf`, or pass an mlx-lm model folder with "
        f"`--model PATH`."
    )


def _refuse_shard(path: Path) -> None:
    if (record := read_shard_record(path)) is not None:
        raise ModelError(
            f"{path} holds only part of {record.model_id} ({record.describe()}), received from a "
            f"coordinator for a pipeline stage; serve the whole model's folder instead.")
