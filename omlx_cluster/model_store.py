"""Where models live on this machine, and how a `--model` argument becomes a model folder.

A model is an mlx-lm folder (config.json, model*.safetensors, tokenizer files). The store is
`$OMLX_CLUSTER_HOME/models/<name>/`; GGUF imports and the embedded default model land there.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


class ModelError(ValueError):
    """A model cannot be found, imported or used; the message says how to fix it."""


@dataclass(frozen=True)
class ModelInfo:
    name: str
    path: Path
    model_type: str
    num_layers: int
    size_bytes: int
    quantization: str


def data_home() -> Path:
    return Path(os.environ.get("OMLX_CLUSTER_HOME") or Path.home() / ".omlx-cluster").expanduser()


def models_dir() -> Path:
    return data_home() / "models"


def validate_model_dir(path: Path) -> None:
    """Raise ModelError unless `path` holds everything mlx-lm needs to load a model."""
    path = Path(path)
    if not path.is_dir():
        raise ModelError(f"Model folder {path} does not exist or is not a folder.")
    hint = (
        "A model folder needs config.json, model*.safetensors and tokenizer.json (or "
        "tokenizer.model). Convert a GGUF file with `omlx-cluster models import-gguf FILE.gguf`, "
        "or point --model at an mlx-lm model folder."
    )
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any(path.glob("model*.safetensors")):
        missing.append("model*.safetensors")
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        missing.append("tokenizer.json or tokenizer.model")
    if missing:
        raise ModelError(f"Model folder {path} lacks {', '.join(missing)}. {hint}")
    config = _read_config(path)
    if not config.get("model_type"):
        raise ModelError(
            f"{path / 'config.json'} has no model_type, so mlx-lm cannot tell which architecture "
            f"to build. {hint}"
        )


def list_models() -> list[ModelInfo]:
    """The valid models in the store, by name. Invalid or half-written folders are skipped."""
    root = models_dir()
    if not root.is_dir():
        return []
    infos = []
    for path in sorted(root.iterdir()):
        # Imports in progress live in hidden temp folders next to their destination.
        if path.name.startswith("."):
            continue
        try:
            validate_model_dir(path)
        except ModelError:
            continue
        infos.append(_model_info(path))
    return infos


def resolve_model(spec: str | None, progress: bool = True) -> Path:
    """Turn a `--model` value into a validated model folder.

    None means the default model, imported into the store on first use. Otherwise `spec` is a
    folder path or the name of a model in the store; a folder wins over a store name.
    """
    if spec is None:
        from omlx_cluster.default_model import pull_default

        return pull_default(progress=progress)
    candidate = Path(spec).expanduser()
    if candidate.is_dir():
        validate_model_dir(candidate)
        return candidate.resolve()
    stored = models_dir() / spec
    if stored.is_dir():
        validate_model_dir(stored)
        return stored
    if spec == DEFAULT_MODEL_NAME:
        from omlx_cluster.default_model import pull_default

        return pull_default(progress=progress)
    names = [info.name for info in list_models()]
    known = ", ".join(names) if names else "none yet"
    raise ModelError(
        f"{spec!r} is neither a model folder nor a model in the store ({models_dir()}). "
        f"Stored models: {known}. Import a GGUF file with "
        f"`omlx-cluster models import-gguf FILE.gguf`, or pass an mlx-lm model folder with "
        f"`--model PATH`."
    )


def _read_config(path: Path) -> dict:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"Cannot read {path / 'config.json'}: {e}") from e
    if not isinstance(config, dict):
        raise ModelError(f"{path / 'config.json'} is not a JSON object.")
    return config


def _model_info(path: Path) -> ModelInfo:
    config = _read_config(path)
    # Multimodal configs nest the language model's settings.
    text = config.get("text_config", {})
    layers = config.get("num_hidden_layers", text.get("num_hidden_layers", 0))
    return ModelInfo(
        name=path.name,
        path=path,
        model_type=config["model_type"],
        num_layers=int(layers),
        size_bytes=sum(f.stat().st_size for f in path.glob("*.safetensors")),
        quantization=_quantization_label(config.get("quantization")),
    )


def _quantization_label(quantization: dict | None) -> str:
    """'none', '4-bit g32', or 'mixed (4-bit g32, 8-bit g32, float)' for per-module overrides."""
    if not quantization:
        return "none"

    def label(params: dict) -> str:
        mode = params.get("mode", "affine")
        suffix = "" if mode == "affine" else f" {mode}"
        return f"{params['bits']}-bit g{params['group_size']}{suffix}"

    labels = {label(quantization)}
    for value in quantization.values():
        if isinstance(value, dict):
            labels.add(label(value))
        elif value is False:
            labels.add("float")
    if len(labels) == 1:
        return labels.pop()
    return f"mixed ({', '.join(sorted(labels))})"
