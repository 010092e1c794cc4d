"""The gateway app in this process, for tests that need no node: requests through ASGI."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from omlx_coordinator.frontdoor.keys import KeyRing
from omlx_coordinator.http.gateway import create_app
from omlx_coordinator.nodes.cluster import ClusterOptions
from omlx_coordinator.request.generation import GatewaySettings
from tests.tiny_models import serving


def ask(app, method: str, path: str, **kw) -> httpx.Response:
    async def run() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gw") as http:
            return await http.request(method, path, **kw)
    return asyncio.run(run())


def app_for(tiny: Path, keys: frozenset[str] = frozenset(), keys_file: Path | None = None,
            usage=None):
    manager = serving(tiny, "m", ClusterOptions(nodes=0, os_reserve_bytes=0))
    return create_app(manager, GatewaySettings(keys=KeyRing(keys, keys_file)),
                      start_cluster=False, usage=usage)
