"""The answer to a failure that is not the client's: the details go to the server's log under
a short random id, and the client gets the id alone. An exception's text names files, hosts,
library internals and sometimes other requests' data, none of which a client may read; with
the id, an operator finds the whole story in the log."""

from __future__ import annotations

import logging
import secrets

from omlx_coordinator.errors import APIError


def internal_error(log: logging.Logger, what: str, exc: BaseException | None = None,
                   detail: str = "") -> APIError:
    """Logs `what` with `exc`'s traceback (or `detail`, text from elsewhere such as a node)
    under a new id; returns the 500 that names `what` and the id, and nothing else."""
    error_id = secrets.token_hex(4)
    log.error("%s (id %s)%s", what, error_id, f": {detail}" if detail else "",
              exc_info=exc if exc is not None else False)
    return APIError(500, f"{what} (id {error_id}); the server's log has the details",
                    type="server_error")
