"""Embedding and reranking models: loaded with their libraries' own classes, run in batches.

Encoders (BERT, XLM-RoBERTa, ModernBERT) are mlx-embeddings' models; decoders (Qwen3-Embedding,
Qwen3-Reranker) mlx-lm's. A request's inputs are sorted by length and cut into forward passes
of similar lengths, each padded to its longest input (sorted, the padding stays small; a fixed
bucket such as a multiple of 16 tokens cost short inputs several times as much on a CPU:
bench/results/embeddings-cpu.md) and at most
PASS_TOKENS tokens. Padding changes nothing of an input's result: an
encoder masks it out of attention and pooling; a decoder pads on the right, where causal
attention keeps the real tokens from seeing it.

A reranker's score is a cross-encoder's logit (what llama.cpp and FlagEmbedding return; no
sigmoid), or a decoder reranker's P("yes") against "no" at its last token (Qwen3-Reranker).
"""

from __future__ import annotations

import glob
import json
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from omlx_shared.model_kinds import EMBED, ModelKind, detect_kind, max_input_tokens

PASS_TOKENS = 16384  # padded tokens of one forward pass
# Prefixes of a Hugging Face ...ForSequenceClassification checkpoint's encoder weights.
_ENCODER_PREFIXES = ("roberta.", "bert.", "model.")


def _passes(lengths: list[int], max_rows: int) -> list[tuple[list[int], int]]:
    """The inputs (by index) of each forward pass and its padded length (its longest input's):
    by length, each pass as many inputs as PASS_TOKENS padded tokens (and `max_rows`) hold."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    for i in order:
        rows = groups[-1] if groups else []
        if not rows or (len(rows) + 1) * lengths[i] > PASS_TOKENS or len(rows) >= max_rows:
            groups.append([i])
        else:
            rows.append(i)
    return [(rows, max(1, lengths[rows[-1]])) for rows in groups]


def _pool(hidden: mx.array, mask: mx.array, lengths: mx.array, pooling: str) -> mx.array:
    if pooling == "cls":
        return hidden[:, 0]
    if pooling == "last":
        return hidden[mx.arange(hidden.shape[0]), lengths - 1]
    from mlx_embeddings.models.base import mean_pooling
    return mean_pooling(hidden, mask)


class Encoder:
    """A loaded embedding or reranking model. `run` takes token ids (and token type ids, for
    a BERT pair) and returns one row per input: its embedding, or its score in a row of one."""

    def __init__(self, path: Path, kind: ModelKind | None = None, max_rows: int = 256):
        self.path, self.kind = Path(path), kind or detect_kind(Path(path))
        self.config = json.loads((self.path / "config.json").read_text())
        self.max_tokens = max_input_tokens(self.config)
        self.max_rows = max_rows
        self.passes = 0  # forward passes run: calls merged by the worker share them
        self.pad_id = int(self.config.get("pad_token_id") or 0)
        self.head: nn.Module | None = None
        if self.kind.encoder and self.kind.kind == EMBED:
            from mlx_embeddings.utils import load_model
            self.model = load_model(self.path, path_to_repo=str(self.path))
        elif self.kind.encoder:
            self.model, self.head = _load_cross_encoder(self.path, self.config)
        else:
            from mlx_lm.utils import load_model
            self.model, _ = load_model(self.path)
            if self.kind.kind != EMBED:
                self.yes_no = _yes_no_ids(self.path)
        self.model.eval()
        mx.eval(self.model.parameters())

    @property
    def dtype(self) -> str:
        from mlx.utils import tree_flatten
        return str(tree_flatten(self.model.parameters())[0][1].dtype).removeprefix("mlx.core.")

    def check(self, inputs: list[list[int]]) -> None:
        """ValueError when `inputs` is empty or an input is longer than the model takes."""
        if not inputs:
            raise ValueError("no inputs")
        if self.max_tokens and (long := max(len(x) for x in inputs)) > self.max_tokens:
            raise ValueError(f"an input has {long} tokens; the model takes at most "
                             f"{self.max_tokens}")

    def run(self, inputs: list[list[int]], types: list[list[int]] | None = None) -> np.ndarray:
        self.check(inputs)
        out: list[np.ndarray | None] = [None] * len(inputs)
        for rows, width in _passes([len(x) for x in inputs], self.max_rows):
            result = self._forward([inputs[i] for i in rows],
                                   [types[i] for i in rows] if types else None, width)
            for r, i in enumerate(rows):
                out[i] = result[r]
        return np.stack(out)

    def _forward(self, inputs: list[list[int]], types: list[list[int]] | None,
                 width: int) -> np.ndarray:
        ids = np.full((len(inputs), width), self.pad_id, dtype=np.int32)
        mask = np.zeros((len(inputs), width), dtype=np.float32)
        type_ids = np.zeros((len(inputs), width), dtype=np.int32)
        for r, x in enumerate(inputs):
            ids[r, :len(x)], mask[r, :len(x)] = x, 1
            if types and types[r]:
                type_ids[r, :len(types[r])] = types[r]
        lengths = mx.array([len(x) for x in inputs])
        ids_, mask_ = mx.array(ids), mx.array(mask)
        if self.kind.encoder:
            result = self._encoder(ids_, mask_, mx.array(type_ids), lengths)
        else:
            result = self._decoder(ids_, mask_, lengths)
        mx.eval(result)
        self.passes += 1
        return np.array(result.astype(mx.float32))

    def _encoder(self, ids: mx.array, mask: mx.array, type_ids: mx.array,
                 lengths: mx.array) -> mx.array:
        from mlx_embeddings.models.base import normalize_embeddings

        kw = {"attention_mask": mask}
        if self.config.get("model_type") != "modernbert":
            kw["token_type_ids"] = type_ids
        output = self.model(ids, **kw)
        hidden = output.last_hidden_state
        if self.head is not None:
            return self.head(hidden, output.pooler_output)
        # ModernBERT's model pools itself (its config's classifier_pooling).
        pooled = hidden if hidden.ndim == 2 else _pool(hidden, mask, lengths, self.kind.pooling)
        return normalize_embeddings(pooled) if self.kind.normalize else pooled

    def _decoder(self, ids: mx.array, mask: mx.array, lengths: mx.array) -> mx.array:
        from mlx_embeddings.models.base import normalize_embeddings

        hidden = self.model.model(ids)
        if self.kind.kind == EMBED:
            pooled = _pool(hidden, mask, lengths, self.kind.pooling)
            return normalize_embeddings(pooled) if self.kind.normalize else pooled
        last = hidden[mx.arange(hidden.shape[0]), lengths - 1]
        if getattr(self.model, "lm_head", None) is not None:
            logits = self.model.lm_head(last)
        else:
            logits = self.model.model.embed_tokens.as_linear(last)
        pair = logits[:, list(self.yes_no)].astype(mx.float32)  # (yes, no)
        return mx.softmax(pair, axis=-1)[:, :1]


def _yes_no_ids(path: Path) -> tuple[int, int]:
    """The token ids of "yes" and "no", whose logits a decoder reranker's score compares."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    ids = tok.convert_tokens_to_ids(["yes", "no"])
    if any(i is None or i == tok.unk_token_id for i in ids):
        raise ValueError(f"{path}: the tokenizer has no single tokens 'yes' and 'no', which a "
                         "decoder reranker's score is read from")
    return int(ids[0]), int(ids[1])


class _RobertaHead(nn.Module):
    """XLMRobertaForSequenceClassification's head: dense, tanh, out_proj on the first token."""

    def __init__(self, hidden: int, labels: int):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, labels)

    def __call__(self, hidden: mx.array, pooled: mx.array | None) -> mx.array:
        return self.out_proj(mx.tanh(self.dense(hidden[:, 0])))


class _BertHead(nn.Module):
    """BertForSequenceClassification's head: one linear layer over the pooler's output."""

    def __init__(self, hidden: int, labels: int):
        super().__init__()
        self.classifier = nn.Linear(hidden, labels)

    def __call__(self, hidden: mx.array, pooled: mx.array | None) -> mx.array:
        return self.classifier(pooled)


def _load_cross_encoder(path: Path, config: dict) -> tuple[nn.Module, nn.Module]:
    """A ...ForSequenceClassification checkpoint: mlx-embeddings' encoder with its weights,
    and the classification head, which mlx-embeddings has no class for."""
    from mlx_embeddings.utils import _get_classes

    labels = len(config.get("id2label") or {}) or int(config.get("num_labels", 1))
    if labels != 1:
        raise ValueError(f"{path}: a reranker scores with one label; this classifier has "
                         f"{labels}")
    if config.get("quantization"):
        raise ValueError(f"{path}: quantized cross-encoders are not supported; use the "
                         "float16 or float32 checkpoint")
    weights: dict[str, mx.array] = {}
    for f in sorted(glob.glob(str(path / "*.safetensors"))):
        weights.update(mx.load(f))
    head_weights = {k.removeprefix("classifier."): v for k, v in weights.items()
                    if k.startswith("classifier.")}
    encoder_weights = {}
    for k, v in weights.items():
        if k.startswith("classifier."):
            continue
        for p in _ENCODER_PREFIXES:
            k = k.removeprefix(p)
        encoder_weights[k] = v
    model_class, args_class, _, _ = _get_classes(config)
    args = args_class.from_dict(config)
    roberta = str(config.get("model_type", "")).replace("-", "_") == "xlm_roberta"
    if roberta:  # the classification checkpoint has no pooler
        args = replace(args, add_pooling_layer=False)
    model = model_class(args)
    model.load_weights(list(model.sanitize(encoder_weights).items()))
    hidden = int(config["hidden_size"])
    head = _RobertaHead(hidden, labels) if roberta else _BertHead(hidden, labels)
    if roberta:
        head.load_weights(list(head_weights.items()))
    else:
        head.load_weights([(f"classifier.{k}", v) for k, v in head_weights.items()])
    return model, head
