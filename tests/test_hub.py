"""Models by Hugging Face id: from the hub cache as `hf download` leaves it, else downloaded
from a hub (a stand-in on loopback: no test reaches the real one) into the store."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

import pytest

from omlx_shared import progress
from omlx_shared.hub import store_name
from omlx_shared.model_spec import resolve_model, served_name
from omlx_shared.model_store import ModelError, list_models, models_dir
from omlx_shared.progress import logged_tqdm
from tests.conftest_models import write_tiny_gguf
from tests.hub_stand_in import COMMIT, HubStandIn
from tests.tiny_models import build_model

REPO_ID = "test-org/Tiny-4bit"


@pytest.fixture(autouse=True)
def _no_real_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts offline, with an empty cache and store of its own; a test that
    downloads points HF_ENDPOINT at its stand-in."""
    monkeypatch.setenv("OMLX_CLUSTER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: never a hub


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    folder = build_model(tmp_path_factory.mktemp("tiny") / "Tiny-4bit", num_layers=2)
    (folder / "README.md").write_text("a model card mlx-lm does not download\n")
    return folder


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch):
    from omlx_shared import hub_download

    # Retries at once: the stand-in's failures are scripted, not a hub that needs a moment.
    monkeypatch.setattr(hub_download, "FIRST_RETRY_SECONDS", 0.0)
    stand_in = HubStandIn()
    monkeypatch.setenv("HF_ENDPOINT", stand_in.url)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    yield stand_in
    stand_in.close()


def write_hub_cache(cache: Path, repo_id: str, folder: Path) -> Path:
    """The layout `hf download` leaves: blobs by hash, a snapshot of symlinks, refs/main."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for f in folder.iterdir():
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def test_a_hub_id_in_the_cache_is_served_in_place(tmp_path: Path, tiny_folder: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = write_hub_cache(tmp_path / "hf-home" / "hub", REPO_ID, tiny_folder)
    path = resolve_model(REPO_ID)
    assert path == snapshot
    assert served_name(REPO_ID, path) == REPO_ID  # what clients send, as with mlx_lm.server
    assert list_models() == []  # nothing copied into the store
    # HF_HUB_CACHE wins over HF_HOME, as in huggingface_hub.
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    with pytest.raises(ModelError, match="HF_HUB_OFFLINE"):
        resolve_model(REPO_ID)


def test_offline_and_not_cached_says_what_to_do() -> None:
    with pytest.raises(ModelError) as e:
        resolve_model(REPO_ID)
    assert "not in the Hugging Face cache" in str(e.value)
    assert f"hf download {REPO_ID}" in str(e.value)


def test_a_node_does_not_download(hub: HubStandIn, tiny_folder: Path) -> None:
    hub.add_folder(REPO_ID, tiny_folder)
    with pytest.raises(ModelError, match="a node does not download"):
        resolve_model(REPO_ID, fetch=False)
    assert hub.requests == []


def test_downloads_into_the_store_with_progress_lines(hub: HubStandIn, tiny_folder: Path,
                                                      caplog) -> None:
    hub.add_folder(REPO_ID, tiny_folder)
    with caplog.at_level(logging.INFO, logger="omlx.progress"):
        path = resolve_model(REPO_ID)
    assert path == models_dir() / store_name(REPO_ID)
    assert [m.name for m in list_models()] == [store_name(REPO_ID)]
    assert not (path / "README.md").exists()  # only what mlx-lm would fetch
    assert (path / "model.safetensors").read_bytes() == (
        tiny_folder / "model.safetensors").read_bytes()
    # Off a terminal the download is a few log lines, ending at 100%.
    lines = [r.getMessage() for r in caplog.records if r.name == "omlx.progress"]
    assert lines and lines[-1].startswith(f"downloading {REPO_ID}: 100% (")
    assert len(lines) <= 10
    # Once stored, it is found without the hub.
    hub.requests.clear()
    assert resolve_model(REPO_ID) == path and hub.requests == []


def test_a_dropped_connection_resumes_where_it_stopped(
        hub: HubStandIn, tiny_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from omlx_shared import hub_download

    # What was received is written in chunks of 1 MB: smaller ones here, so that this
    # half-megabyte file stops after some of them.
    monkeypatch.setattr(hub_download, "CHUNK", 1 << 14)
    hub.add_folder(REPO_ID, tiny_folder)
    hub.cut = "model.safetensors"
    path = resolve_model(REPO_ID)
    size = (tiny_folder / "model.safetensors").stat().st_size
    ranges = [r for m, p, r in hub.requests if m == "GET" and p.endswith("/model.safetensors")]
    assert len(ranges) == 2 and ranges[0] == ""
    # The retry asked only for what was missing: from where the cut connection stopped.
    assert 0 < int(ranges[1].removeprefix("bytes=").rstrip("-")) <= size // 2
    assert (path / "model.safetensors").read_bytes() == (
        tiny_folder / "model.safetensors").read_bytes()


def test_a_failed_download_is_never_served_and_a_rerun_completes_it(
        hub: HubStandIn, tiny_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from omlx_shared import hub_download

    monkeypatch.setattr(hub_download, "CHUNK", 1 << 14)
    hub.add_folder(REPO_ID, tiny_folder)
    hub.cut = hub.broken = "model.safetensors"
    with pytest.raises(ModelError, match="Run the same command again to resume"):
        resolve_model(REPO_ID)
    assert list_models() == []  # a half download is never a model
    hub.broken = None
    hub.requests.clear()
    path = resolve_model(REPO_ID)
    # The files the failed run finished are kept, and so is the half it received of the last:
    # the rerun asks only for the rest of that one.
    fetched = [(p.rsplit("/", 1)[1], r) for m, p, r in hub.requests
               if m == "GET" and "/resolve/" in p]
    size = (tiny_folder / "model.safetensors").stat().st_size
    assert [name for name, _ in fetched] == ["model.safetensors"]
    assert 0 < int(fetched[0][1].removeprefix("bytes=").rstrip("-")) <= size // 2
    assert (path / "model.safetensors").read_bytes() == (
        tiny_folder / "model.safetensors").read_bytes()
    assert not any(p.name.startswith(".download-") for p in models_dir().iterdir())


def test_ctrl_c_mid_download_resumes_on_the_next_run(
        hub: HubStandIn, tiny_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from omlx_shared import hub_download

    monkeypatch.setattr(hub_download, "CHUNK", 1 << 12)
    hub.add_folder(REPO_ID, tiny_folder)
    size = (tiny_folder / "model.safetensors").stat().st_size
    real_bar = logged_tqdm("test")

    class InterruptedBar(real_bar):  # the user presses Ctrl-C a third of the way through
        def update(self, n: float | None = 1) -> bool | None:
            shown = super().update(n)
            if self.n > size // 3 + self.initial and self.n < self.total:
                raise KeyboardInterrupt
            return shown

    monkeypatch.setattr(progress, "logged_tqdm", lambda what: InterruptedBar)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(REPO_ID)
    assert list_models() == []
    monkeypatch.setattr(progress, "logged_tqdm", lambda what: real_bar)
    hub.requests.clear()
    path = resolve_model(REPO_ID)
    ranges = [r for m, p, r in hub.requests if m == "GET" and p.endswith("/model.safetensors")]
    assert len(ranges) == 1 and int(ranges[0].removeprefix("bytes=").rstrip("-")) > size // 3
    assert (path / "model.safetensors").read_bytes() == (
        tiny_folder / "model.safetensors").read_bytes()
    assert not any(p.name.startswith(".download-") for p in models_dir().iterdir())


def test_a_gguf_repository_imports_one_file(hub: HubStandIn, tmp_path: Path) -> None:
    tiny = write_tiny_gguf(tmp_path / "tiny-Q4_0.gguf", "Q4_0")
    hub.repos["test-org/Tiny-GGUF"] = {"tiny-Q4_0.gguf": tiny.path.read_bytes(),
                                       "tiny-Q2_K.gguf": b"a format import-gguf cannot read",
                                       "README.md": b"card"}
    path = resolve_model("test-org/Tiny-GGUF")
    assert path == models_dir() / "test-org--Tiny-GGUF"
    assert (path / "config.json").is_file()
    fetched = {p.rsplit("/", 1)[1] for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p}
    assert fetched == {"tiny-Q4_0.gguf"}
    assert [p.name for p in models_dir().iterdir()] == ["test-org--Tiny-GGUF"]


def test_an_unknown_repository_says_so(hub: HubStandIn) -> None:
    with pytest.raises(ModelError, match="has no test-org/none .*HF_TOKEN"):
        resolve_model("test-org/none")


def test_an_unknown_name_mentions_hub_ids() -> None:
    with pytest.raises(ModelError, match="Hugging Face id"):
        resolve_model("no-such-model")


def test_models_pull_cli(hub: HubStandIn, tiny_folder: Path, capsys) -> None:
    from omlx_cluster.cli import main

    hub.add_folder(REPO_ID, tiny_folder)
    assert main(["models", "pull", REPO_ID]) == 0
    assert f"{REPO_ID} ready at {models_dir() / store_name(REPO_ID)}" in capsys.readouterr().out
    assert main(["models", "pull", "./not-an-id"]) == 2
    assert "is not a Hugging Face id" in capsys.readouterr().err
