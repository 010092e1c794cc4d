"""The web console at /console: static files shipped in the package (omlx_coordinator/console),
no build step and nothing from a CDN.

The page holds no data, so it is served without a key: it asks for one and sends it with every
call it makes to the API, which checks it as for any client (a user key gets the reduced view
its routes allow). A strict Content-Security-Policy keeps the page to its own scripts and to
this gateway: no inline script, no other origin.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles

PATH = "/console"
ASSETS_PATH = f"{PATH}/assets"
_FILES = Path(__file__).resolve().parent.parent / "console"

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
       "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
           "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


class _Assets(StaticFiles):
    """The page's scripts and styles, with the page's headers (a script served as another
    type is refused: nosniff)."""

    def file_response(self, *args, **kwargs) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers.update(HEADERS)
        return response


def add_routes(app: FastAPI) -> None:
    app.mount(ASSETS_PATH, _Assets(directory=_FILES), name="console-assets")

    @app.api_route(PATH, methods=["GET", "HEAD"], include_in_schema=False)
    async def console() -> FileResponse:
        return FileResponse(_FILES / "index.html", media_type="text/html", headers=HEADERS)
