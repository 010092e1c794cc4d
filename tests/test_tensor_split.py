"""Which models a tensor-parallel stage can run (omlx_shared/tensor_split.py), as pure functions,
and its table of families against mlx-lm's own classes."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

from omlx_shared.tensor_split import ALIASES, SHARDABLE, tensor_refusal

LLAMA = {"model_type": "llama", "num_attention_heads": 32, "num_key_value_heads": 8,
         "intermediate_size": 14336}


def test_table_is_mlx_lms_families_with_shard():
    import mlx_lm.models

    found = set()
    for m in pkgutil.iter_modules(mlx_lm.models.__path__):
        try:
            module = importlib.import_module(f"mlx_lm.models.{m.name}")
        except BaseException:  # a family needing a package this venv lacks  # noqa: BLE001
            continue
        if hasattr(getattr(module, "Model", None), "shard"):
            found.add(m.name)
    assert found == SHARDABLE


def test_aliases_are_mlx_lms():
    from mlx_lm.utils import MODEL_REMAPPING

    for alias, family in ALIASES.items():
        assert MODEL_REMAPPING[alias] == family


@pytest.mark.parametrize("config, ranks, why", [
    (LLAMA, 2, ""),
    (LLAMA, 4, ""),
    (LLAMA, 8, ""),
    ({**LLAMA, "model_type": "mistral"}, 2, ""),
    (LLAMA, 3, "32 attention heads (num_attention_heads), which do not divide over 3 ranks"),
    ({**LLAMA, "num_key_value_heads": 1}, 2, "1 KV heads (num_key_value_heads), which do not "
                                             "divide over 2 ranks"),
    ({**LLAMA, "intermediate_size": 11}, 2, "11 MLP intermediate size"),
    ({"model_type": "qwen3_moe", "num_attention_heads": 4, "num_key_value_heads": 2,
      "moe_intermediate_size": 33, "intermediate_size": 64}, 2,
     "33 expert intermediate size (moe_intermediate_size)"),
    ({"model_type": "gemma3_text", "num_attention_heads": 4}, 2,
     "model family 'gemma3_text' has no tensor-parallel split in mlx-lm (no Model.shard()); "
     "serve it with --parallel pipeline"),
    ({"model_type": "qwen3_5", "text_config": {"num_attention_heads": 6}}, 4,
     "6 attention heads"),
    (LLAMA, 1, "at least 2 ranks"),
])
def test_refusals(config, ranks, why):
    got = tensor_refusal(config, ranks)
    assert (why in got) if why else got == ""
