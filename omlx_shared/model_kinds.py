"""What a model folder is for: chat (an mlx-lm decoder), embeddings or reranking, and how.

Read from the folder alone (config.json, sentence-transformers' modules.json and pooling
config), so the coordinator (no MLX) and the node agree without a flag:

- an encoder (BERT, XLM-RoBERTa as in BGE-M3, ModernBERT: mlx-embeddings' families) is an
  embedding model; with a `...ForSequenceClassification` architecture, a cross-encoder reranker;
- Whisper (`model_type` whisper, mlx-audio's) transcribes speech;
- a decoder (an mlx-lm family) is a reranker when its name says "reranker" (Qwen3-Reranker: its
  config is a plain Qwen3ForCausalLM), an embedding model when a sentence-transformers pooling
  config comes with it or its name says "embedding" (Qwen3-Embedding), else a chat model.

Pooling and normalisation follow sentence-transformers' files where there are some; without
them an encoder mean-pools and normalises (mlx-embeddings' `text_embeds`), a decoder takes its
last token's hidden state and normalises (Qwen3-Embedding).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

CHAT, EMBED, RERANK, TRANSCRIBE = "chat", "embed", "rerank", "transcribe"
KINDS = (CHAT, EMBED, RERANK, TRANSCRIBE)
# The endpoints a kind serves, as /v1/models lists them.
ENDPOINTS = {
    CHAT: ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
           "/api/chat", "/api/generate"),
    EMBED: ("/v1/embeddings", "/api/embed", "/api/embeddings"),
    RERANK: ("/v1/rerank",),
    TRANSCRIBE: ("/v1/audio/transcriptions",),
}
ENCODER_TYPES = ("bert", "xlm-roberta", "xlm_roberta", "modernbert")
POOLINGS = ("mean", "cls", "last")


@dataclass(frozen=True)
class ModelKind:
    kind: str  # CHAT, EMBED or RERANK
    encoder: bool = False  # an mlx-embeddings encoder (else an mlx-lm decoder)
    pooling: str = "mean"  # of an embedding model: POOLINGS
    normalize: bool = True  # of an embedding model: unit vectors


def _json(path: Path) -> dict | list:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _pooling(path: Path, default: str) -> tuple[str, bool, bool]:
    """(pooling, normalize, found) from sentence-transformers' modules.json and its Pooling
    module's config; `default` pooling and normalising when there are none."""
    modules = _json(path / "modules.json")
    if not isinstance(modules, list) or not modules:
        return default, True, False
    types = [str(m.get("type", "")) for m in modules if isinstance(m, dict)]
    normalize = any(t.endswith(".Normalize") for t in types)
    pooling = default
    for m in modules:
        if isinstance(m, dict) and str(m.get("type", "")).endswith(".Pooling"):
            config = _json(path / str(m.get("path", "")) / "config.json")
            if isinstance(config, dict):
                for mode, name in (("pooling_mode_cls_token", "cls"),
                                   ("pooling_mode_lasttoken", "last"),
                                   ("pooling_mode_mean_tokens", "mean")):
                    if config.get(mode):
                        pooling = name
                        break
    return pooling, normalize, True


def detect_kind(path: Path) -> ModelKind:
    """The kind of the model folder `path` (see the module docstring)."""
    config = _json(path / "config.json")
    if not isinstance(config, dict):
        config = {}
    if str(config.get("model_type", "")) == "whisper":  # mlx-audio's Whisper
        return ModelKind(TRANSCRIBE)
    architectures = [str(a) for a in config.get("architectures") or []]
    classifier = any(a.endswith("ForSequenceClassification") for a in architectures)
    if str(config.get("model_type", "")) in ENCODER_TYPES:
        if classifier:
            return ModelKind(RERANK, encoder=True)
        pooling, normalize, _ = _pooling(path, "mean")
        return ModelKind(EMBED, encoder=True, pooling=pooling, normalize=normalize)
    name = f"{path.name} {config.get('_name_or_path', '')}".lower()
    if "reranker" in name:
        return ModelKind(RERANK)
    pooling, normalize, found = _pooling(path, "last")
    if found or "embedding" in name:
        return ModelKind(EMBED, pooling=pooling, normalize=normalize)
    return ModelKind(CHAT)


def max_input_tokens(config: dict) -> int:
    """The longest input (in tokens) the model's position embeddings take; 0: no limit known.
    XLM-RoBERTa numbers positions from its padding id + 1, so two of its table's rows are
    never a position (BGE-M3: 8194 rows, 8192 tokens)."""
    limit = int(config.get("max_position_embeddings") or 0)
    if limit and str(config.get("model_type", "")).replace("-", "_") == "xlm_roberta":
        limit -= int(config.get("pad_token_id", 1)) + 1
    return max(0, limit)


def kind_of(path: Path, kind: str = "") -> ModelKind:
    """The folder's kind, or `kind` where its configuration names one the folder does not say
    (a reranker or embedder whose folder was renamed): the detected family and pooling kept,
    a decoder embedder's pooling its last token."""
    detected = detect_kind(path)
    if not kind or kind == detected.kind:
        return detected
    if detected.encoder:
        return ModelKind(kind, encoder=True, pooling=detected.pooling,
                         normalize=detected.normalize)
    return ModelKind(kind, pooling="last")
