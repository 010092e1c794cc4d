"""Tiny random embedding, reranking and speech-to-text models, built with their libraries' own
classes.

Encoders (BERT, XLM-RoBERTa) are mlx-embeddings' models; a cross-encoder's checkpoint is laid
out as Hugging Face's ...ForSequenceClassification (prefixed encoder, `classifier.` head).
Decoder embedders and rerankers are tiny_models' Qwen3 folders named as the real ones are.
Whisper is mlx-audio's model with a Whisper tokenizer (the tiny models' BPE with Whisper's
special tokens: languages, tasks, timestamps) and feature extractor, as its loader reads them.
Every one has the tiny models' trained byte-level BPE tokenizer. And the libraries' own
computations the served answers are held to, and a synthesised WAV to transcribe.
"""

from __future__ import annotations

import io
import json
import wave
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_embeddings.utils import _get_classes

from tests.tiny_models import build_model, build_tokenizer

MAX_POSITIONS = 64  # small, so that a too-long input is cheap to send


def build_encoder(dest: Path, model_type: str = "bert", classifier: bool = False,
                  seed: int = 0, pooling: str | None = None, hidden_size: int = 64,
                  num_layers: int = 2, max_positions: int = MAX_POSITIONS) -> Path:
    """A random `model_type` ("bert" or "xlm-roberta") folder; a one-label cross-encoder with
    `classifier`; `pooling` ("cls", "mean") writes sentence-transformers' modules.json."""
    dest.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(dest)
    roberta = model_type == "xlm-roberta"
    config = {
        "model_type": model_type, "hidden_size": hidden_size, "num_hidden_layers": num_layers,
        "intermediate_size": hidden_size * 2, "num_attention_heads": 4, "vocab_size": vocab,
        # XLM-RoBERTa numbers positions from the padding id + 1 (0 here)
        "max_position_embeddings": max_positions + (1 if roberta else 0),
        "type_vocab_size": 1 if roberta else 2, "layer_norm_eps": 1e-5, "pad_token_id": 0,
        "add_pooling_layer": not (roberta and classifier),
    }
    prefix = ""
    if classifier:
        name = "XLMRobertaForSequenceClassification" if roberta else "BertForSequenceClassification"
        config.update(architectures=[name], id2label={"0": "LABEL_0"})
        prefix = "roberta." if roberta else "bert."
    else:
        config["architectures"] = ["XLMRobertaModel" if roberta else "BertModel"]
    model_class, args_class, _, _ = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    weights = {prefix + k: v for k, v in tree_flatten(model.parameters())}
    if classifier:
        h = config["hidden_size"]
        head = ({"dense.weight": (h, h), "dense.bias": (h,), "out_proj.weight": (1, h),
                 "out_proj.bias": (1,)} if roberta else {"weight": (1, h), "bias": (1,)})
        weights.update({f"classifier.{k}": mx.random.normal(s) * 0.2 for k, s in head.items()})
    mx.save_safetensors(str(dest / "model.safetensors"), weights)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    if pooling:
        write_pooling(dest, pooling)
    return dest


def write_pooling(dest: Path, pooling: str, normalize: bool = True) -> None:
    """sentence-transformers' modules.json and Pooling config."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (dest / "modules.json").write_text(json.dumps(modules))
    (dest / "1_Pooling").mkdir(exist_ok=True)
    modes = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens",
             "last": "pooling_mode_lasttoken"}
    (dest / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, **{m: m == modes[pooling] for m in modes.values()}}))


def build_decoder(dest_parent: Path, kind: str, seed: int = 0) -> Path:
    """A tiny Qwen3 named as Qwen3-Embedding ("embed") or Qwen3-Reranker ("rerank") is, whose
    tokenizer holds the single tokens "yes" and "no" a reranker's score is read from."""
    name = "Qwen3-Embedding-tiny" if kind == "embed" else "Qwen3-Reranker-tiny"
    corpus = ["yes no " * 40, *(["The capital of France is Paris. yes no"] * 20)]
    return build_model(dest_parent / name, "qwen3", num_layers=2, seed=seed, corpus=corpus)


def build_whisper(dest: Path, seed: int = 0) -> Path:
    """A random Whisper (one encoder and one decoder layer, width 64) loadable by
    mlx_audio.stt.utils.load_model."""
    from mlx_audio.stt.models.whisper.tokenizer import LANGUAGES
    from mlx_audio.stt.models.whisper.whisper import Model, ModelDimensions
    from transformers import WhisperFeatureExtractor, WhisperProcessor, WhisperTokenizerFast

    from tests.tiny_models import train_tokenizer

    dest.mkdir(parents=True, exist_ok=True)
    raw = dest / "bpe.json"
    # Whisper's decoding takes every id below end of text for text: the specials come last.
    train_tokenizer(special_tokens=[]).save(str(raw))
    tok = WhisperTokenizerFast(tokenizer_file=str(raw))
    raw.unlink()
    tok.add_tokens(["<|endoftext|>", "<|startoftranscript|>", *(f"<|{c}|>" for c in LANGUAGES),
                    "<|translate|>",
                    "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>",
                    "<|notimestamps|>", *(f"<|{i * 0.02:.2f}|>" for i in range(1501))],
                   special_tokens=True)
    eot = "<|endoftext|>"
    tok.add_special_tokens({"bos_token": eot, "eos_token": eot, "unk_token": eot,
                            "pad_token": eot})
    WhisperProcessor(WhisperFeatureExtractor(feature_size=80), tok).save_pretrained(str(dest))
    config = {"model_type": "whisper", "n_mels": 80, "n_audio_ctx": 1500, "n_audio_state": 64,
              "n_audio_head": 4, "n_audio_layer": 1, "n_vocab": len(tok), "n_text_ctx": 448,
              "n_text_state": 64, "n_text_head": 4, "n_text_layer": 1}
    mx.random.seed(seed)
    model = Model(ModelDimensions.from_dict(config), dtype=mx.float32)
    mx.save_safetensors(str(dest / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def tone_wav(seconds: float = 3.0, rate: int = 16000) -> bytes:
    """A 440 Hz tone, amplitude-modulated, as 16-bit mono PCM WAV."""
    t = np.arange(int(seconds * rate)) / rate
    samples = 0.3 * np.sin(2 * np.pi * 440 * t) * np.sin(2 * np.pi * 3 * t)
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((samples * 32767).astype("<i2").tobytes())
    return out.getvalue()


def mlx_audio_transcript(folder: Path, audio: bytes):
    """mlx-audio's own transcription of `audio`: its reader, its loader, its generate."""
    from mlx_audio.audio_io import read
    from mlx_audio.stt.utils import load_model

    samples, _ = read(io.BytesIO(audio), dtype="float32", sample_rate=16000, nchannels=1)
    return load_model(str(folder)).generate(mx.array(samples.reshape(-1)), language="en",
                                            temperature=0.0)


def mlx_embeddings_reference(folder: Path, text: str, pooling: str) -> np.ndarray:
    """mlx-embeddings' own model and pooling functions, one input at a time, unpadded."""
    from mlx_embeddings.models.base import normalize_embeddings
    from mlx_embeddings.utils import load_model
    from transformers import AutoTokenizer

    model = load_model(folder, path_to_repo=str(folder))
    ids = mx.array([AutoTokenizer.from_pretrained(str(folder))(text)["input_ids"]])
    out = model(ids)
    if pooling == "mean":
        return np.array(out.text_embeds[0])  # the library's own mean-pooled, normalised
    return np.array(normalize_embeddings(out.last_hidden_state[:, 0])[0])
