"""Where a command gets its API keys: the gateway every key it takes, a client the one it sends.

`--api-key KEY` shows the key in `ps` to every account on the machine, so there are two ways
that do not: --api-key-file (one key a line, mode 0600 and refused otherwise, as --secret-file)
and $OMLX_CLUSTER_API_KEY (comma-separated). $OMLX_API_KEY, the variable's older name, is
still read.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from omlx_shared.private_files import PrivateFileError, read_private

ENV = "OMLX_CLUSTER_API_KEY"
OLD_ENV = "OMLX_API_KEY"


class ApiKeyError(ValueError):
    """Keys that cannot be used; the message says why and how to fix it."""


def add_api_key_flags(p: argparse.ArgumentParser, what: str) -> None:
    """--api-key and --api-key-file; `what` says which key the command wants."""
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help=f"{what}; `ps` shows it, so prefer --api-key-file or ${ENV} "
                        f"(with neither flag: ${ENV}, comma-separated)")
    p.add_argument("--api-key-file", type=Path, metavar="FILE",
                   help="read the API keys from FILE, one a line (mode 0600; other users "
                        "must not read it), so they never show in `ps`")


def api_keys(args: argparse.Namespace) -> list[str]:
    """The keys of --api-key and --api-key-file, else of the environment; [] when none is
    given. ApiKeyError for an empty key or a file that cannot be used."""
    given = list(args.api_key or [])
    if args.api_key_file is not None:
        try:
            text = read_private(args.api_key_file, "API key")
        except PrivateFileError as e:
            raise ApiKeyError(str(e)) from None
        given += [line for line in text.splitlines() if line.strip()]
    if args.api_key is None and args.api_key_file is None:
        raw = os.environ.get(ENV) or os.environ.get(OLD_ENV) or ""
        given = [k for k in raw.split(",") if k.strip()]
    if any(not k.strip() for k in given):
        raise ApiKeyError("an API key is empty or only whitespace (--api-key ''): every key "
                          "must be a non-empty string clients send as 'Authorization: Bearer "
                          "KEY'")
    return [k.strip() for k in given]
