"""The house stays as docs/architecture.md draws it: import-linter's contracts in pyproject.toml
(the CLI on top, the coordinator and the node independent, the shared kernel and proto/
underneath, no circles), checked on this tree and shown to catch the breaks they promise."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ["omlx_cluster", "omlx_coordinator", "omlx_node", "omlx_shared", "proto"]


def lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    exe = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(exe), "--config", str(root / "pyproject.toml"), "--no-cache"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_the_tree_keeps_its_contracts() -> None:
    result = lint(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "layers of the house KEPT" in result.stdout
    assert "layers of the coordinator KEPT" in result.stdout
    assert "no import circles KEPT" in result.stdout


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    for p in PACKAGES:
        shutil.copytree(REPO / p, tmp_path / p, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


@pytest.mark.parametrize("module, line, broken", [
    ("omlx_node/stage.py", "import omlx_coordinator.planning.planner", "layers of the house"),
    ("omlx_coordinator/planning/planner.py", "import omlx_node.stage", "layers of the house"),
    ("omlx_shared/auth.py", "import omlx_cluster.cli", "layers of the house"),
    ("omlx_node/stage.py", "import omlx_cluster.cli", "layers of the house"),
    ("omlx_coordinator/nodes/membership.py", "import omlx_coordinator.nodes.cluster",
     "no import circles"),
    ("omlx_coordinator/planning/planner.py", "import omlx_coordinator.models.lifecycle",
     "layers of the coordinator"),
    ("omlx_coordinator/text/tokenizer.py", "import omlx_coordinator.nodes.node_client",
     "layers of the coordinator"),
    ("omlx_shared/model_store.py", "import omlx_shared.model_spec", "no import circles"),
])
def test_a_wrong_import_breaks_a_contract(copy: Path, module: str, line: str, broken: str) -> None:
    path = copy / module
    path.write_text(path.read_text() + f"\n{line}  # the break under test\n")
    result = lint(copy)
    assert result.returncode != 0
    assert f"{broken} BROKEN" in result.stdout, result.stdout
