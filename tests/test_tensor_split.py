"""Which models a tensor-parallel stage can run (omlx_shared/tensor_split.py), as pure functions,
and its table of families against mlx-lm's own classes."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

from omlx_shared.tensor_split import ALIASES, SHARDABLE, tensor_refusal, uses_model_shard

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


@pytest.mark.parametrize("config, ranks, why, own", [
    (LLAMA, 2, "", True),
    (LLAMA, 4, "", True),
    (LLAMA, 8, "", True),
    ({**LLAMA, "model_type": "mistral"}, 2, "", True),
    # What shard() cannot split evenly the generic sharder splits unevenly.
    (LLAMA, 3, "", False),
    ({**LLAMA, "num_key_value_heads": 1}, 2, "", False),
    ({**LLAMA, "intermediate_size": 11}, 2, "", False),
    (LLAMA, 33, "llama has 32 attention heads (num_attention_heads), fewer than the 33 ranks",
     None),
    # An MoE of SwitchGLU experts: the generic sharder splits its width unevenly too.
    ({"model_type": "qwen3_moe", "num_attention_heads": 4, "num_key_value_heads": 2,
      "moe_intermediate_size": 33, "intermediate_size": 64}, 2, "", False),
    ({"model_type": "qwen3_moe", "num_attention_heads": 4, "moe_intermediate_size": 2}, 3,
     "qwen3_moe has 2 expert intermediate size (moe_intermediate_size), fewer than the 3 ranks",
     None),
    # gpt_oss's attention has sinks, one a head: its own shard() alone splits it.
    ({"model_type": "gpt_oss", "num_attention_heads": 4, "num_key_value_heads": 2}, 3,
     "gpt_oss has 4 attention heads (num_attention_heads), which do not divide over 3 ranks; "
     "mlx-lm's Model.shard() splits evenly and gpt_oss is not of the common decoder shape",
     None),
    ({"model_type": "gemma3_text", "num_attention_heads": 4, "num_key_value_heads": 1}, 3,
     "", False),
    ({"model_type": "olmo2", "num_attention_heads": 4}, 2,
     "model family 'olmo2' has no tensor-parallel split: mlx-lm has no Model.shard() for it "
     "and its layers are not of the common decoder shape", None),
    ({"model_type": "qwen3_5", "text_config": {"num_attention_heads": 6}}, 4,
     "6 attention heads", None),
    (LLAMA, 1, "at least 2 ranks", None),
])
def test_refusals(config, ranks, why, own):
    got = tensor_refusal(config, ranks)
    assert (why in got) if why else got == ""
    if not why:  # which sharder splits it: mlx-lm's own shard() where it can
        assert uses_model_shard(config, ranks) == own
