"""What the live agent-client tests share (Claude Code, Codex CLI, OpenCode): each client from
npm, installed into the test cache on first use; an environment with no network but the test's
server; and the tiny model they talk to (on one node and through a 2-stage pipeline).

The model is a 2-layer random Qwen-style one whose 32k BPE, trained on the Python standard
library (and whatever text a client ships, passed in), reads an agent's ~10-20k-token prompt in
few tokens. A client retries or fails a turn that stops at max_tokens, so a random model that
never ends its turn cannot pass: the config lists one token in 20 as an end of turn
(`eos_token_id` is a list, as Llama 3's is), and replies end after about 20 tokens.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

from tests.conftest_models import cache_dir
from tests.tiny_models import QWEN_TEMPLATE, build_model

VOCAB = 32768
CONTEXT = 65536
TURN_TIMEOUT = 600  # seconds a turn may take (a first prefill is 10-20k tokens on a CPU)
NO_NETWORK = "http://127.0.0.1:9"  # a proxy nothing listens on: refused at once
# A server fixture's params: a client must work on one node and through a pipeline.
ONE_NODE_AND_PIPELINE = {"params": [1, 2], "ids": ["one node", "2-stage pipeline"]}


def _npm() -> str:
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        raise RuntimeError("node and npm are needed to install agent clients")
    return npm


def _installed(prefix: Path, package: str) -> str | None:
    manifest = prefix / "node_modules" / package / "package.json"
    return json.loads(manifest.read_text())["version"] if manifest.exists() else None


def newest_version(package: str) -> str:
    """The newest release npm serves now; RuntimeError when npm cannot say."""
    r = subprocess.run([_npm(), "view", package, "version"], capture_output=True, text=True,
                       timeout=120)
    if r.returncode != 0 or not r.stdout.strip():
        raise RuntimeError(f"npm view {package} failed: {r.stderr[-2000:]}")
    return r.stdout.strip()


def npm_package(package: str, version: str, folder: str) -> Path:
    """The npm prefix `folder` in the test cache holding `package` at `version`, installed on
    first use; RuntimeError says why it cannot be."""
    prefix = cache_dir() / folder
    if _installed(prefix, package) != version:
        prefix.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([_npm(), "install", "--no-audit", "--no-fund", "--prefix",
                            str(prefix), f"{package}@{version}"],
                           capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"npm install {package}@{version} failed: {r.stderr[-2000:]}")
    return prefix


def install_cli(package: str, command: str, folder: str,
                version: str | None = None) -> tuple[Path, str]:
    """(the `command` CLI of `package`, its version) from the test cache: `version`, or the
    newest npm serves (the one installed when npm cannot be asked); RuntimeError says why it
    cannot be had."""
    if version is None:
        try:
            version = newest_version(package)
        except RuntimeError:
            version = _installed(cache_dir() / folder, package)
            if version is None:
                raise
    cli = npm_package(package, version, folder) / "node_modules" / ".bin" / command
    # The npm packages' launchers run a native binary from a per-platform package (Claude
    # Code's postinstall puts it in place): a stub or a missing one fails here, not in a test.
    r = subprocess.run([str(cli), "--version"], capture_output=True, text=True, timeout=60)
    if r.returncode != 0 or version not in r.stdout:
        raise RuntimeError(f"{cli} --version said: {r.stdout[-500:]}{r.stderr[-1500:]}")
    return cli, version


def offline_env(home: Path, proxy: str = NO_NETWORK, **extra: str) -> dict[str, str]:
    """A client's whole environment: its own HOME, and anything but our server (on loopback)
    sent to a proxy that refuses it."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
            "HTTPS_PROXY": proxy, "HTTP_PROXY": proxy, "NO_PROXY": "127.0.0.1,localhost",
            **extra}


def build_agent_model(dest: Path, extra_corpus: tuple[str, ...] = ()) -> Path:
    """The tiny agent model (see the module docstring) at `dest`."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = [f.read_text(errors="ignore") for f in sorted(stdlib.glob("*.py"))]
    return build_model(dest, "qwen2", num_layers=2, hidden_size=64, seed=0, vocab_size=VOCAB,
                       corpus=corpus + list(extra_corpus), chat_template=QWEN_TEMPLATE,
                       extra_config={"max_position_embeddings": CONTEXT,
                                     "eos_token_id": list(range(VOCAB - VOCAB // 20, VOCAB))})

