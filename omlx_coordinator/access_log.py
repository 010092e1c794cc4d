"""uvicorn's access log, without the secrets a client put in a query string.

A client that sends its key as `?api_key=...` is refused, but uvicorn would still write the key
into the log with the path, where anyone who reads logs (or a log shipper) finds a working key.
The values of secret-looking parameters are replaced before the line is formatted; the names
stay, so the line still says what was sent.
"""

from __future__ import annotations

import logging
import re
from urllib.parse import unquote_plus

REDACTED = "REDACTED"
# Matched anywhere in a parameter's name: api_key, x-api-key, access_token, client_secret...
_SECRET_NAME = re.compile(r"key|token|secret|passw|pwd|auth|credential|signature|session",
                          re.IGNORECASE)


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
    """Rewrites the path argument of uvicorn's access log records (`'%s - "%s %s HTTP/%s" %d'`
    with the client, method, path, version and status): any string argument with a query."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact_query(a) if isinstance(a, str) and "?" in a else a
                                for a in record.args)
        return True


def redact_access_log() -> None:
    """Installs the filter on uvicorn's access logger, once. Called after uvicorn.Config is
    made, which is where uvicorn configures its loggers."""
    logger = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactedQuery) for f in logger.filters):
        logger.addFilter(RedactedQuery())
