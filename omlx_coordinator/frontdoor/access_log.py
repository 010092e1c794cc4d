"""uvicorn's access log, without the secrets a client put in a query string, and without the
floods an outsider could write with a long path.

A client that sends its key as `?api_key=...` is refused, but uvicorn would still write the key
into the log with the path, where anyone who reads logs (or a log shipper) finds a working key.
The values of secret-looking parameters are replaced before the line is formatted; the names
stay, so the line still says what was sent. Every string argument (path, method, version: the
client's own) is then cut as every outsider's string is (omlx_shared/outsider_logs.py): a path
may be as long as the HTTP parser takes, tens of KB a line otherwise.

GET /health is not logged at all: load balancers, `serve`'s waiters and Docker poll it every
few seconds, and a line each buried the requests people look for.
"""

from __future__ import annotations

import logging
import re
from urllib.parse import unquote_plus

from omlx_shared.outsider_logs import cut

REDACTED = "REDACTED"
# Matched anywhere in a parameter's name: api_key, x-api-key, access_token, client_secret...
_SECRET_NAME = re.compile(r"key|token|secret|passw|pwd|auth|credential|signature|session",
                          re.IGNORECASE)
_UNLOGGED_PATHS = frozenset({"/health"})


def redact_query(target: str) -> str:
    """`target` (a path with its query string) with the values of secret-looking query
    parameters replaced by REDACTED. `;` separates as `&` does: some parsers split on it."""
    path, sep, query = target.partition("?")
    if not sep:
        return target
    pieces = re.split(r"([&;])", query)
    for i, piece in enumerate(pieces):
        name, eq, _ = piece.partition("=")
        if eq and _SECRET_NAME.search(unquote_plus(name)):
            pieces[i] = f"{name}={REDACTED}"
    return f"{path}?{''.join(pieces)}"


class RedactedQuery(logging.Filter):
    """Rewrites the arguments of uvicorn's access log records (`'%s - "%s %s HTTP/%s" %d'` with
    the client, method, path, version and status): queries redacted, every string cut."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            if (len(record.args) > 2 and isinstance(record.args[2], str)
                    and record.args[2].partition("?")[0] in _UNLOGGED_PATHS):
                return False
            record.args = tuple(cut(redact_query(a)) if isinstance(a, str) else a
                                for a in record.args)
        return True


def redact_access_log() -> None:
    """Installs the filter on uvicorn's access logger, once. Called after uvicorn.Config is
    made, which is where uvicorn configures its loggers."""
    logger = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactedQuery) for f in logger.filters):
        logger.addFilter(RedactedQuery())
