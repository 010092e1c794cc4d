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
from transformers import AddedToken, AutoTokenizer

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


def train_tokenizer(vocab_size: int = 384, corpus: list[str] | None = None,
                    special_tokens: list[str] | None = None):
    """A byte-level BPE tokenizer (a tokenizers.Tokenizer) trained on `corpus` (CORPUS), its
    `special_tokens` (SPECIAL_TOKENS) first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS if special_tokens is None else special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus or CORPUS * 20, trainer)
    return tok


def build_tokenizer(dest: Path, vocab_size: int = 384, corpus: list[str] | None = None,
                    chat_template: str = CHATML) -> int:
    """Train and save a tokenizer with a chat template; returns its vocabulary size."""
    from transformers import PreTrainedTokenizerFast

    tok = train_tokenizer(vocab_size, corpus)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = chat_template
    fast.save_pretrained(dest)
    return len(fast)


# Small MoE: 4 experts, 2 per token, expert FFN 32 wide; the first layer dense where the family
# allows it, so layers differ in size as in the real models.
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
_DEEPSEEK_MOE = dict(_MOE, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
                     n_group=1, topk_group=1, routed_scaling_factor=1.0)

FAMILY_CONFIGS = {
    "llama": dict(tie_word_embeddings=False),
    "mistral": dict(tie_word_embeddings=False),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(tie_word_embeddings=True, head_dim=16),
    # MoE, sliding-window, MLA and hybrid families; windows of 8 tokens so that short tests
    # run past them. tie_word_embeddings is stated as their real configs state it (a config
    # that says nothing ties the head, as Hugging Face's convention has it).
    "qwen3_moe": dict(_MOE, tie_word_embeddings=False, head_dim=16, num_experts=4,
                      decoder_sparse_step=1, mlp_only_layers=[0]),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8,
                    intermediate_size=32, tie_word_embeddings=False),
    "glm4_moe": dict(_DEEPSEEK_MOE, tie_word_embeddings=False, head_dim=16, use_qk_norm=True,
                     attention_bias=False, partial_rotary_factor=0.5, rope_scaling=None),
    "deepseek_v3": dict(_DEEPSEEK_MOE, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32,
                        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                        tie_word_embeddings=False),
    "gemma3_text": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                        sliding_window_pattern=2, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "qwen3_next": dict(_MOE, head_dim=16, num_experts=4, decoder_sparse_step=1, mlp_only_layers=[],
                       shared_expert_intermediate_size=32, linear_num_value_heads=4,
                       linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                       linear_conv_kernel_dim=4, full_attention_interval=2,
                       partial_rotary_factor=0.5, tie_word_embeddings=False),
    "phi3": dict(tie_word_embeddings=False),
    "olmo2": dict(tie_word_embeddings=False),
    "granite": dict(tie_word_embeddings=True, logits_scaling=4.0, attention_multiplier=0.25,
                    embedding_multiplier=6.0, residual_multiplier=0.5, attention_bias=False,
                    mlp_bias=False),
    "cohere2": dict(head_dim=16, sliding_window=8, sliding_window_pattern=2, logit_scale=0.5,
                    layer_norm_eps=1e-5, tie_word_embeddings=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
    # More families of the common decoder shape (the generic tensor-parallel sharder's).
    "gemma": dict(head_dim=16, tie_word_embeddings=True),
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=16, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0, tie_word_embeddings=True),
    "ernie4_5": dict(head_dim=16, use_bias=False, tie_word_embeddings=True),
    "exaone4": dict(head_dim=16, sliding_window=8, sliding_window_pattern="LG",
                    rope_scaling=None, tie_word_embeddings=False),
    "hunyuan_v1_dense": dict(head_dim=16, use_qk_norm=True, attention_bias=False,
                             tie_word_embeddings=True,
                             rope_scaling={"alpha": 1.0, "factor": 1.0, "type": "dynamic"}),
    "seed_oss": dict(head_dim=16, attention_bias=False, attention_out_bias=False,
                     mlp_bias=False, tie_word_embeddings=False),
    "smollm3": dict(no_rope_layer_interval=2, tie_word_embeddings=True),
    "qwen2_moe": dict(_MOE, num_experts=4, shared_expert_intermediate_size=32,
                      tie_word_embeddings=False),
}


def tiny_config(family: str, num_layers: int = 4, hidden_size: int = 64, vocab_size: int = 384,
                extra_config: dict | None = None) -> dict:
    """The config.json of a tiny `family` model: 4 attention heads, 2 KV heads."""
    return {
        "model_type": family,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "intermediate_size": hidden_size * 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "eos_token_id": 2,
        "bos_token_id": 0,
        **FAMILY_CONFIGS[family],
        **(extra_config or {}),
    }


def instantiate(config: dict, seed: int = 0) -> nn.Module:
    """mlx-lm's model of `config`, with random weights from `seed`."""
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    return model_class(args_class.from_dict(config))


def build_model(
    dest: Path,
    family: str = "llama",
    num_layers: int = 4,
    hidden_size: int = 64,
    seed: int = 0,
    quantize_bits: int | None = None,
    extra_config: dict | None = None,
    vocab_size: int = 384,
    corpus: list[str] | None = None,
    chat_template: str = CHATML,
) -> Path:
    """Write a random `family` model folder at `dest` and return it (its tokenizer trained on
    `corpus`, CORPUS by default)."""
    dest.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(dest, vocab_size, corpus, chat_template)
    write_weights(dest, tiny_config(family, num_layers, hidden_size, vocab, extra_config), seed,
                  quantize_bits)
    return dest


def write_weights(dest: Path, config: dict, seed: int = 0,
                  quantize_bits: int | None = None) -> None:
    """Random weights of `config` from `seed` (quantized to `quantize_bits` in groups of 32)
    and the config.json that says so, into the model folder `dest`."""
    model = instantiate(config, seed)
    if quantize_bits:
        nn.quantize(model, group_size=32, bits=quantize_bits)
        config["quantization"] = {"group_size": 32, "bits": quantize_bits}
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dest / "config.json").write_text(json.dumps(config, indent=2))


# Qwen 2.5's chat template (its tool parts verbatim; a shorter default system prompt).
QWEN_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def qwen_tokenizer(dest: Path) -> Path:
    """The tiny models' tokenizer with Qwen's markup tokens and tool-calling template."""
    build_tokenizer(dest)
    tok = AutoTokenizer.from_pretrained(str(dest))
    # As in Qwen's tokenizer.json: added tokens, not special ones (they stay in decoded text).
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t in ("<tool_call>", "</tool_call>")])
    tok.chat_template = QWEN_TEMPLATE
    tok.save_pretrained(str(dest))
    return dest


# The tiny Qwen's embedding rows: the trained vocabulary and room for qwen_tokenizer's two
# markup tokens.
QWEN_VOCAB = 400


def tiny_qwen(dest: Path, seed: int = 0, num_layers: int = 2, hidden_size: int = 64,
              context: int = 2048) -> Path:
    """A tiny random Qwen2 chat model at `dest` whose template calls tools (`qwen_tokenizer`),
    `context` tokens long; returns `dest`. Its weights come from `seed`: tests that read a
    seed's greedy replies (text, whitespace first, ...) keep theirs."""
    dest.mkdir(parents=True, exist_ok=True)
    # The config first: transformers reads its model_type to pick Qwen2's tokenizer class
    # (its normalizer and pre-tokenizer) when qwen_tokenizer loads the trained one.
    write_weights(dest, tiny_config("qwen2", num_layers, hidden_size, QWEN_VOCAB,
                                    {"max_position_embeddings": context}), seed)
    return qwen_tokenizer(dest)


def serving(model: Path, name: str, options, **config):
    """A model manager serving `model` alone as `name` over a cluster with `options` (a
    ClusterOptions): what `serve --model` builds, for tests that drive it in-process."""
    from omlx_coordinator.models.lifecycle import ModelManager
    from omlx_coordinator.models.model_config import ModelConfig
    from omlx_coordinator.models.served_model import ServedModel
    from omlx_coordinator.nodes.cluster import Cluster

    return ModelManager(Cluster(options), [ServedModel(ModelConfig(name, str(model), **config),
                                                       model)])


def truncated_model(src: Path, dest: Path, num_layers: int) -> Path:
    """A copy of model folder `src` keeping only its first `num_layers` layers (then its own
    norm and head): a smaller model of the same tokenizer, as a draft model needs, and one
    whose guesses often agree with the whole model's."""
    import shutil

    dest.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, dest / f.name)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    weights = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, value in mx.load(str(f)).items():
            parts = name.split(".")
            at = parts.index("layers") if "layers" in parts else -1
            if at < 0 or int(parts[at + 1]) < num_layers:
                weights[name] = value
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    return dest
