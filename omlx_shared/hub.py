"""Models named by their Hugging Face id (`ORG/NAME`): found in the local Hugging Face cache,
else downloaded into the store.

Every peer (mlx_lm.server, oMLX, exo, LM Studio) takes a hub id, and a Mac that ran one of them
already holds models in `~/.cache/huggingface/hub`: those are served in place, never copied. A
model not there is downloaded (hub_download.py: an interrupted download, Ctrl-C included, goes
on where it stopped, in the same run or the next) into a hidden folder of the store and renamed into place once whole, so a half
download is never served. A repository of GGUF files imports one of them as
`models import-gguf` does. Only the coordinator calls this: nodes get their layers from it.

The environment is read at each call, not at import (huggingface_hub reads HF_ENDPOINT and
HF_HUB_OFFLINE once, when first imported): HF_HUB_CACHE / HF_HOME, HF_HUB_OFFLINE, HF_ENDPOINT;
tokens (HF_TOKEN, `hf auth login`) are huggingface_hub's own.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from omlx_shared.model_store import ModelError, models_dir, validate_model_dir

# What mlx-lm downloads of a model repository (mlx_lm/utils.py), so the same folder results.
MLX_PATTERNS = ["*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken",
                "tiktoken.model", "*.txt", "*.jsonl", "*.jinja"]
# Of a repository holding several GGUF files, the one imported (import_gguf's formats, the
# exactly kept quantizations first); `ORG/NAME/FILE.gguf` picks another.
GGUF_PREFERENCE = ("q8_0", "q4_1", "q4_0", "bf16", "f16", "f32")

_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(/[^/]+\.gguf)?$")


def is_hub_id(spec: str) -> bool:
    """`ORG/NAME` or `ORG/NAME/FILE.gguf`, not a path (no leading ./ ~ /, no more parts)."""
    return bool(_ID_RE.match(spec)) and ".." not in spec


def store_name(repo_id: str) -> str:
    """The store folder of a hub model: `ORG--NAME`, as the hub cache spells it."""
    return repo_id.replace("/", "--")


def hub_cache() -> Path:
    """Where `hf download` and mlx-lm keep models: HF_HUB_CACHE, else HF_HOME/hub."""
    if cache := os.environ.get("HF_HUB_CACHE"):
        return Path(cache).expanduser()
    home = os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface"
    return Path(home).expanduser() / "hub"


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "on", "yes", "true")


def resolve_hub_model(spec: str, fetch: bool = True) -> Path:
    """The model folder for a hub id: the store's copy, else the hub cache's snapshot, else a
    download (when `fetch`). Raises ModelError saying what to do when none of them can."""
    repo_id, gguf_file = _split(spec)
    dest = models_dir() / store_name(repo_id)
    if dest.is_dir():
        validate_model_dir(dest)
        return dest
    cached = _from_cache(repo_id, gguf_file, dest)
    if cached is not None:
        return cached
    if offline():
        raise ModelError(
            f"{repo_id} is not in the Hugging Face cache ({hub_cache()}) nor in the store "
            f"({dest}), and HF_HUB_OFFLINE is set: download it where the hub is reachable "
            f"(`hf download {repo_id}`, then copy that cache here), or unset HF_HUB_OFFLINE.")
    if not fetch:
        raise ModelError(
            f"{repo_id} is not on this machine (Hugging Face cache {hub_cache()}, store "
            f"{dest}); a node does not download models: the coordinator sends each node its "
            f"layers, or run `omlx-cluster models pull {repo_id}` here first.")
    return _download(repo_id, gguf_file, dest)


def _split(spec: str) -> tuple[str, str | None]:
    org, name, *rest = spec.split("/")
    return f"{org}/{name}", rest[0] if rest else None


def _from_cache(repo_id: str, gguf_file: str | None, dest: Path) -> Path | None:
    """The cached snapshot as a model folder (a GGUF one imported into the store); None when the
    cache holds no usable snapshot of it."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(repo_id, cache_dir=hub_cache(), local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None
    ggufs = sorted(p.name for p in folder.glob("*.gguf"))
    if gguf_file is None and not ggufs:
        try:
            validate_model_dir(folder)
        except ModelError:  # a partial `hf download`: fetch what the cache lacks
            return None
        return folder
    try:
        chosen = _choose_gguf(repo_id, gguf_file, ggufs)
    except ModelError:
        return None
    return _import(folder / chosen, dest)


def _choose_gguf(repo_id: str, wanted: str | None, names: list[str]) -> str:
    if wanted is not None:
        if wanted not in names:
            raise ModelError(f"{repo_id} holds no {wanted}; its GGUF files: "
                             f"{', '.join(names) or 'none'}")
        return wanted
    for quant in GGUF_PREFERENCE:
        for name in names:
            if re.search(rf"[-_.]{quant}\.gguf$", name, re.IGNORECASE):
                return name
    if len(names) == 1:
        return names[0]
    raise ModelError(
        f"{repo_id} holds several GGUF files and none in a format `import-gguf` reads "
        f"({', '.join(q.upper() for q in GGUF_PREFERENCE)}): {', '.join(names)}. Name one: "
        f"--model {repo_id}/FILE.gguf")


def _import(gguf: Path, dest: Path) -> Path:
    from omlx_shared.gguf_import import import_gguf

    return import_gguf(gguf, dest, progress=True)


def _download(repo_id: str, gguf_file: str | None, dest: Path) -> Path:
    import httpx2
    from huggingface_hub import HfApi, RepoFile
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
    )
    from huggingface_hub.utils import filter_repo_objects

    from omlx_shared.hub_download import download_files
    from omlx_shared.progress import logged_tqdm

    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    # A hidden sibling (list_models skips it) keeps what was received between runs.
    partial = dest.parent / f".download-{dest.name}"
    bar = logged_tqdm(f"downloading {repo_id}")
    try:
        api = HfApi(endpoint=endpoint)
        info = api.model_info(repo_id)
        sizes = {f.path: f.size for f in api.list_repo_tree(repo_id, revision=info.sha,
                                                            recursive=True)
                 if isinstance(f, RepoFile)}
        ggufs = sorted(f for f in sizes if f.endswith(".gguf") and "/" not in f)
        if gguf_file is None and any(re.match(r"model.*\.safetensors$", f) for f in sizes):
            wanted = list(filter_repo_objects(sizes, allow_patterns=MLX_PATTERNS))
            download_files(repo_id, info.sha, {f: sizes[f] for f in wanted}, partial,
                           endpoint, bar)
            validate_model_dir(partial)
            os.replace(partial, dest)
            return dest
        if not ggufs:
            raise ModelError(
                f"{repo_id} holds neither MLX safetensors (model*.safetensors) nor GGUF files; "
                f"pick an MLX conversion of it (e.g. under mlx-community/) or a GGUF repository")
        chosen = _choose_gguf(repo_id, gguf_file, ggufs)
        download_files(repo_id, info.sha, {chosen: sizes[chosen]}, partial, endpoint, bar)
    except (GatedRepoError, RepositoryNotFoundError) as e:
        raise ModelError(
            f"{endpoint} has no {repo_id} that this machine may read ({type(e).__name__}), "
            f"and no folder {repo_id} exists here: check the spelling; for a private or gated "
            f"model log in (`hf auth login`) or set HF_TOKEN") from None
    except (HfHubHTTPError, httpx2.HTTPError, OSError) as e:
        raise ModelError(
            f"downloading {repo_id} from {endpoint} failed: {e}. Run the same command again to "
            f"resume it; without the hub, download it where it is reachable (`hf download "
            f"{repo_id}`) and copy the cache ({hub_cache()}) here, or set HF_ENDPOINT to a "
            f"mirror") from None
    path = _import(partial / chosen, dest)
    shutil.rmtree(partial, ignore_errors=True)
    return path
