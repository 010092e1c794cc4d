"""The models' lifecycle over HTTP: load, unload, pin and unpin one model (what `omlx-cluster
models load|unload|pin|unpin NAME` calls). Keyed like /cluster/status.

An unload of a model with requests in flight is a 409 that says how many, unless the caller
asks to wait for them (`?wait=SECONDS`): the model then takes no new requests, and is unloaded
when the last one ends (or the 409 comes after the wait).
"""

from __future__ import annotations

import grpc
from fastapi import Depends, FastAPI, Query

from omlx_coordinator.errors import APIError
from omlx_coordinator.models.lifecycle import ModelBusy, ModelManager
from omlx_coordinator.models.served_model import ServedModel
from omlx_coordinator.nodes.cluster import NoCapacity
from proto import omlx_pb2 as pb


def add_routes(app: FastAPI, manager: ModelManager, keyed: list[Depends]) -> None:
    def find(name: str) -> ServedModel:
        model = manager.resolve(name)
        if model is None:
            names = ", ".join(repr(m.name) for m in manager.models)
            raise APIError(404, f"model {name!r} is not served here; available: {names}",
                           param="model", code="model_not_found")
        return model

    @app.post("/cluster/models/{name:path}/load", dependencies=keyed)
    async def load(name: str) -> dict:
        """Loads the model now (evicting least recently used unpinned idle models if memory
        is short); answers once it serves."""
        model = find(name)
        try:
            await manager.load_task(model, pb.LOAD_PRELOAD)  # ahead of use: nobody waits yet
        except NoCapacity as e:
            raise APIError(503, f"the model {model.name} cannot be loaded: {e}",
                           type="server_error", code="no_capacity") from None
        except grpc.aio.AioRpcError as e:  # a node failed under the load: it may be retried
            raise APIError(503, f"loading the model {model.name} failed: {e.details()}; "
                                "retry (a lost node is planned out within seconds)",
                           type="server_error", code="load_failed") from None
        return manager.describe(model)

    @app.post("/cluster/models/{name:path}/unload", dependencies=keyed)
    async def unload(name: str, wait: float = Query(0.0, ge=0.0, le=3600.0)) -> dict:
        """Unloads the model; 409 with requests in flight, unless `wait` seconds for them."""
        model = find(name)
        try:
            await manager.unload_asked(model, wait)
        except ModelBusy as e:
            raise APIError(409, f"{e}: wait for them (?wait=SECONDS, `omlx-cluster models "
                                "unload --wait`) or retry later", code="model_busy") from None
        return manager.describe(model)

    @app.post("/cluster/models/{name:path}/pin", dependencies=keyed)
    async def pin(name: str) -> dict:
        """Never evicted nor unloaded for idling from now on."""
        model = find(name)
        model.pinned = True
        return manager.describe(model)

    @app.post("/cluster/models/{name:path}/unpin", dependencies=keyed)
    async def unpin(name: str) -> dict:
        model = find(name)
        model.pinned = False
        return manager.describe(model)
