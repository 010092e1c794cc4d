"""The command line's parser run in this process, for what it answers before any command runs."""

from __future__ import annotations

import subprocess

import pytest

from omlx_cluster.cli import main


def parse_cli(*args: str, capsys: pytest.CaptureFixture,
              monkeypatch: pytest.MonkeyPatch) -> subprocess.CompletedProcess:
    """`omlx-cluster ARGS` as `main` answers it here when the parser ends it (help, a usage
    error): its exit code, stdout and stderr at 100 columns, as a process would have them. A
    process per case cost far more than the parse; tests that start the console script itself
    cover the rest of the way."""
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as ended:
        main(list(args))
    said = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), ended.value.code, said.out, said.err)
