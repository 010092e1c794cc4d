"""Where models live on this machine, and how a `--model` argument becomes a model folder.

A model is an mlx-lm folder (config.json, model*.safetensors, tokenizer files). The store is
`$OMLX_CLUSTER_HOME/models/<name>/`; GGUF imports and the embedded default model land there.

A node that received part of a model from its coordinator (omlx_node/weight_store.py) keeps it
in a shard folder `<model_id>@<fingerprint[:12]>/`: the same mlx-lm layout with only some
layers' tensors, and a `shard.json` record of what it holds. A shard folder is listed but never
served as a model of its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from omlx_shared.private_files import write_private
from omlx_shared.safetensors_header import read_header, tensor_range, weight_files

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
SHARD_RECORD = "shard.json"

# What content_fingerprint samples of each weight file's data section.
_EDGE_SAMPLE_BYTES = 64 << 10  # its first and last bytes
_TENSOR_SAMPLE_BYTES = 4 << 10  # the first bytes of every tensor
_LAYER_FILE_RE = re.compile(r"^model-layer-(\d+)\.safetensors$")

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
    shard: str = ""  # what a shard folder holds ("layers 0-14 of 30"); "" for a whole model


@dataclass(frozen=True)
class ShardRecord:
    """The `shard.json` of a shard folder: the model it is part of and its verified files
    (name -> {"size": data bytes, "sha256": hex of the data section})."""

    model_id: str
    fingerprint: str
    num_layers: int
    files: dict[str, dict] = field(default_factory=dict)

    def layers(self) -> list[int]:
        return sorted(int(m.group(1)) for name in self.files
                      if (m := _LAYER_FILE_RE.match(name)))

    def describe(self) -> str:
        """'layers 0-14 of 30', 'layers 0-3, 8-9 of 30', or 'no layers of 30'."""
        runs: list[list[int]] = []
        for i in self.layers():
            if runs and runs[-1][1] == i - 1:
                runs[-1][1] = i
            else:
                runs.append([i, i])
        text = ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in runs) or "no"
        return f"layers {text} of {self.num_layers}"

    def to_json(self) -> str:
        return json.dumps({"model_id": self.model_id, "fingerprint": self.fingerprint,
                           "num_layers": self.num_layers, "files": self.files}, indent=1)


def read_shard_record(folder: Path) -> ShardRecord | None:
    """The folder's shard record; None when it is not a shard folder. Raises ModelError when the
    record exists but cannot be read."""
    path = Path(folder) / SHARD_RECORD
    try:
        raw = json.loads(path.read_text())
        return ShardRecord(str(raw["model_id"]), str(raw["fingerprint"]),
                           int(raw["num_layers"]), dict(raw.get("files") or {}))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelError(f"{path} is not a readable shard record: {e}") from e


def write_shard_record(folder: Path, record: ShardRecord) -> None:
    """Atomic and durable: a crash leaves the old record or the new one, never half of one."""
    write_private(Path(folder) / SHARD_RECORD, record.to_json(), durable=True)


def content_fingerprint(model_dir: Path) -> str:
    """Names a model by its content, so that two machines can tell they hold the same one.

    sha256 over config.json and, per weight file, its tensors' names, dtypes, shapes and sizes,
    the first and last 64 KiB of its data section and the first 4 KiB of every tensor. Reads a
    few MB whatever the model's size. Independent of file names and mtimes, so a node's own copy
    of a model matches the coordinator's; sampling every tensor's head (not only the file's
    ends) tells apart fine-tunes that changed only some layers of a one-file checkpoint.
    Raises ValueError (or OSError) for a folder without config.json or weights."""
    model_dir = Path(model_dir)
    h = hashlib.sha256(b"omlx-cluster model fingerprint 1\0")
    config = (model_dir / "config.json").read_bytes()
    h.update(len(config).to_bytes(8, "little") + config)
    # Sorted, so that the files' names and order do not matter.
    for digest in sorted(_file_fingerprint(f) for f in weight_files(model_dir)):
        h.update(digest)
    return h.hexdigest()


def _file_fingerprint(path: Path) -> bytes:
    header = read_header(path)
    data_size = path.stat().st_size - header.data_start
    tensors = sorted((name, info.get("dtype"), info.get("shape"), tensor_range(name, info, path))
                     for name, info in header.tensors.items())
    h = hashlib.sha256(json.dumps([[n, d, s, b - a] for n, d, s, (a, b) in tensors]).encode())
    samples = [(0, _EDGE_SAMPLE_BYTES), (max(0, data_size - _EDGE_SAMPLE_BYTES), data_size)]
    samples += [(a, min(b, a + _TENSOR_SAMPLE_BYTES)) for _, _, _, (a, b) in tensors]
    with open(path, "rb") as f:
        for start, end in samples:
            f.seek(header.data_start + start)
            h.update(f.read(max(0, min(end, data_size) - start)))
    return h.digest()


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
    """The valid models in the store, by name, and the shard folders a node keeps (their `shard`
    says which layers they hold). Invalid or half-written folders are skipped."""
    root = models_dir()
    if not root.is_dir():
        return []
    infos = []
    for path in sorted(root.iterdir()):
        # Imports in progress live in hidden temp folders next to their destination.
        if path.name.startswith("."):
            continue
        try:
            if (record := read_shard_record(path)) is not None:
                infos.append(_model_info(path, record))
                continue
            validate_model_dir(path)
        except ModelError:
            continue
        infos.append(_model_info(path))
    return infos


def _read_config(path: Path) -> dict:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"Cannot read {path / 'config.json'}: {e}") from e
    if not isinstance(config, dict):
        raise ModelError(f"{path / 'config.json'} is not a JSON object.")
    return config


def _model_info(path: Path, shard: ShardRecord | None = None) -> ModelInfo:
    config = _read_config(path)
    # Multimodal configs nest the language model's settings.
    text = config.get("text_config", {})
    layers = config.get("num_hidden_layers", text.get("num_hidden_layers", 0))
    return ModelInfo(
        name=path.name,
        path=path,
        model_type=config.get("model_type", "?"),
        num_layers=int(layers),
        size_bytes=sum(f.stat().st_size for f in path.glob("*.safetensors")),
        quantization=_quantization_label(config.get("quantization")),
        shard=shard.describe() if shard else "",
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
