"""Environment checks where the user looks: the BLAS MLX's CPU backend runs on, said by
`serve` at start and by `doctor`; no third-party deprecation noise before doctor's table."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from omlx_cluster.cli import main
from omlx_shared import checks
from omlx_shared.checks import PASS, WARN, Context, Output, judge_blas
from tests.tiny_models import build_model

LINUX = Context(system="Linux")


@pytest.mark.parametrize("found, status", [("openblas\n", PASS), ("gpu\n", PASS),
                                           ("reference\n", PASS), ("metal\n", PASS),
                                           ("", WARN)])
def test_judge_blas(found: str, status: str) -> None:
    result = judge_blas(Output(0, found), LINUX)
    assert result.status == status
    if status == WARN:
        assert "reference BLAS" in result.detail
        assert "apt-get install libopenblas0-pthread" in result.fix


def _no_openblas(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine as one without OpenBLAS nor a GPU, whatever it has."""
    real = checks.run_command
    blas = next(p for p in checks.PROBES if p.name == "blas").commands["Linux"]
    monkeypatch.setattr(checks, "run_command",
                        lambda command, *a: Output(0, "") if command == blas
                        else real(command, *a))
    monkeypatch.setattr(checks.platform, "system", lambda: "Linux")


def test_doctor_has_the_blas_check(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    _no_openblas(monkeypatch)
    assert main(["doctor", "--check", "blas", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert "libopenblas0-pthread" in json.dumps(results)


def test_serve_warns_once_at_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   caplog) -> None:
    _no_openblas(monkeypatch)
    tiny = build_model(tmp_path / "tiny", num_layers=2)
    with caplog.at_level(logging.WARNING, logger="omlx_cluster"):
        # A plan that does not fit ends it right after the start's checks: no server starts.
        assert main(["serve", "--model", str(tiny), "--node-memory", "1MiB"]) == 2
    said = [r.getMessage() for r in caplog.records if "blas" in r.getMessage()]
    assert len(said) == 1 and "apt-get install libopenblas0-pthread" in said[0]


def test_no_dsa_deprecation_noise() -> None:
    """asyncssh imports cryptography's DSA, which warns at import; doctor, up and down import
    omlx_cluster.ssh. Run with warnings shown, as a user's Python may."""
    done = subprocess.run([sys.executable, "-W", "default", "-c", "import omlx_cluster.ssh"],
                          capture_output=True, text=True, check=True)
    assert "DSA" not in done.stderr, done.stderr
