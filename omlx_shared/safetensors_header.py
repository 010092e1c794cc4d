"""A safetensors file's header, read without its tensors (no MLX, no numpy).

A safetensors file starts with an 8-byte little-endian header length and a JSON header that maps
each tensor name to its dtype, shape and byte range in the data section that follows. Reading it
costs a few kilobytes even for a 100 GB model, which is what lets the coordinator (no MLX, no
weights in memory) plan a cluster, fingerprint a model and send a node the bytes of single
tensors.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

# A header longer than this is not a real safetensors header (the format caps it at 100 MB).
MAX_HEADER_BYTES = 100_000_000

# Bytes per element of the safetensors dtypes with whole-byte elements.
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}


@dataclass(frozen=True)
class SafetensorsHeader:
    tensors: dict[str, dict]  # name -> {"dtype", "shape", "data_offsets"}, no __metadata__
    metadata: dict
    data_start: int  # file offset of the data section (8 + header length)


def read_header(path: Path) -> SafetensorsHeader:
    """Raises ValueError for a file that is not a plausible safetensors file."""
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise ValueError(f"{path} is too short to be a safetensors file")
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: header length {header_len} is not plausible")
        raw = f.read(header_len)
    if len(raw) != header_len:
        raise ValueError(f"{path}: header truncated ({len(raw)} of {header_len} bytes)")
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise ValueError(f"{path}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    return SafetensorsHeader(header, metadata, 8 + header_len)


def tensor_range(name: str, info: dict, path: Path) -> tuple[int, int]:
    """[start, end) of a tensor's bytes in the data section; ValueError when malformed."""
    try:
        start, end = info["data_offsets"]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: tensor {name!r} has no valid data_offsets") from e
    if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end):
        raise ValueError(f"{path}: tensor {name!r} has bad data_offsets {info['data_offsets']}")
    return start, end


def weight_files(model_path: Path) -> list[Path]:
    """The files mlx-lm would load: the index's files if there is one, else model*.safetensors.
    Raises ValueError when there are none or the index names missing files."""
    index = model_path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_path / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ValueError(f"{index} names missing files: {', '.join(missing)}")
    else:
        files = sorted(model_path.glob("model*.safetensors")) or sorted(
            model_path.glob("*.safetensors")
        )
    if not files:
        raise ValueError(f"no .safetensors files in {model_path}")
    return files
