"""Tiny random models of real architectures, built at test time (no hub on these machines).

Each is an mlx-lm model folder: config.json, model.safetensors and a byte-level BPE tokenizer
trained on the spot, with a ChatML chat template. The weights are random but the classes, the
loader and the tokenizer code are the real ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Hello world! How are you today? I am fine, thank you very much.",
    "Large language models predict the next token from the previous ones.",
    "A pipeline splits the layers of a model across several machines.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Émile café naïve 東京 🙂",
]


def train_tokenizer(vocab_size: int = 384):
    """A byte-level BPE tokenizer (a tokenizers.Tokenizer) trained on CORPUS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    return tok


def build_tokenizer(dest: Path, vocab_size: int = 384) -> int:
    """Train and save a tokenizer with a ChatML template; returns its vocabulary size."""
    from transformers import PreTrainedTokenizerFast

    tok = train_tokenizer(vocab_size)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHATML
    fast.save_pretrained(dest)
    return len(fast)


FAMILY_CONFIGS = {
    "llama": dict(tie_word_embeddings=False),
    "mistral": dict(tie_word_embeddings=False),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(tie_word_embeddings=True, head_dim=16),
}


def build_model(
    dest: Path,
    family: str = "llama",
    num_layers: int = 4,
    hidden_size: int = 64,
    seed: int = 0,
    quantize_bits: int | None = None,
    extra_config: dict | None = None,
) -> Path:
    """Write a random `family` model folder at `dest` and return it."""
    dest.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(dest)
    config = {
        "model_type": family,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "intermediate_size": hidden_size * 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "eos_token_id": 2,
        "bos_token_id": 0,
        **FAMILY_CONFIGS[family],
        **(extra_config or {}),
    }
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    if quantize_bits:
        nn.quantize(model, group_size=32, bits=quantize_bits)
        config["quantization"] = {"group_size": 32, "bits": quantize_bits}
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest
