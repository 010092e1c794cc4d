"""/docs (Swagger UI) and /redoc served with their own scripts, and behind the API key.

FastAPI's pages load their JS and CSS from a CDN: on an office LAN without the internet they are
blank. The package fastapi-offline ships those assets (MIT); they are served from
/docs-assets. The pages and the schema they read (/openapi.json) need the key when the
gateway has one, as every route that tells what this server is and serves.
"""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import Depends, FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

ASSETS_PATH = "/docs-assets"
_ASSETS = Path(fastapi_offline.__file__).parent / "static"


def add_docs_routes(app: FastAPI, keyed: list[Depends]) -> None:
    """On an app made with docs_url, redoc_url and openapi_url None."""
    app.mount(ASSETS_PATH, StaticFiles(directory=_ASSETS), name="docs-assets")
    title = f"{app.title} API"

    @app.get("/openapi.json", dependencies=keyed, include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", dependencies=keyed, include_in_schema=False)
    async def swagger() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url="/openapi.json", title=title,
            swagger_js_url=f"{ASSETS_PATH}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS_PATH}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS_PATH}/favicon.png")

    @app.get("/redoc", dependencies=keyed, include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title=title,
                              redoc_js_url=f"{ASSETS_PATH}/redoc.standalone.js",
                              redoc_favicon_url=f"{ASSETS_PATH}/favicon.png",
                              with_google_fonts=False)
