"""Every hint names a flag the command it came from takes, and says what went wrong."""

from __future__ import annotations

import re
from pathlib import Path
from typing import ClassVar

import pytest

from omlx_cluster.cli import main
from omlx_cluster.parser import build_parser
from tests.stub_http import QuietHandler, stub_server


def flags_of(command: str) -> set[str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return {o for a in sub.choices[command]._actions for o in a.option_strings}


def test_a_plan_that_does_not_fit_names_serves_own_flags(llama_2_layers: Path, capsys) -> None:
    assert main(["serve", "--model", str(llama_2_layers), "--node-memory", "100MiB"]) == 2
    err = capsys.readouterr().err
    assert "does not fit" in err
    named = set(re.findall(r"--[a-z][a-z-]+", err))
    assert {"--context", "--sequences", "--os-reserve"} <= named
    assert named <= flags_of("serve"), named - flags_of("serve")
    # What takes the memory, plainly, and no 0 B reserve blamed.
    assert "no room: the 1.00 GiB prefix cache takes 924.00 MiB more than the node's " \
           "100.00 MiB" in err
    assert "0 B OS reserve" not in err


def test_serve_plans_with_its_kv_reserve(llama_2_layers: Path, capsys) -> None:
    args = ["serve", "--model", str(llama_2_layers), "--node-memory", "2GiB",
            "--hot-cache-max-size", "0"]
    assert main([*args, "--context", "10000000", "--sequences", "64"]) == 2
    assert "does not fit" in capsys.readouterr().err


def test_coordinator_takes_the_kv_reserve_flags() -> None:
    args = build_parser().parse_args(["coordinator", "--context", "2048", "--sequences", "4"])
    assert (args.context, args.sequences) == (2048, 4)


class _Refusing(QuietHandler):
    paths: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        self.paths.append(self.path)
        self.send_json(401, {"error": {"message": "invalid API key"}})


@pytest.fixture
def refusing_gateway():
    with stub_server(_Refusing) as url:
        yield url


def test_url_takes_the_sdk_base_url_and_a_wrong_key_is_named(refusing_gateway: str,
                                                              capsys, monkeypatch) -> None:
    monkeypatch.delenv("OMLX_CLUSTER_API_KEY", raising=False)
    _Refusing.paths.clear()
    assert main(["status", "--url", refusing_gateway + "/v1/", "--api-key", "wrong"]) == 2
    assert _Refusing.paths == ["/cluster/status"]
    err = capsys.readouterr().err
    assert "refused the API key" in err and "pass --api-key" not in err
    assert main(["status", "--url", refusing_gateway]) == 2
    assert "wants an API key" in capsys.readouterr().err
