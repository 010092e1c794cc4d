"""The cluster over HTTP: a node's registration (`join --coordinator`), the status of the
models and nodes, the rebalancer's advice and moves, usage per key (what `omlx-cluster status`,
`rebalance` and `usage` call). Keyed as admin, but registration (signed with the cluster secret
instead) and usage (a user key reads its own). The models' own routes are api/models.py's."""

from __future__ import annotations

import logging

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from omlx_coordinator.errors import APIError
from omlx_coordinator.frontdoor.access import account_of
from omlx_coordinator.frontdoor.usage import Usage, parse_since
from omlx_coordinator.models.deployment import Deployment
from omlx_coordinator.models.lifecycle import ModelManager
from omlx_coordinator.nodes.membership import Registrar
from omlx_coordinator.telemetry.rebalancer import Rebalancer
from omlx_shared import auth
from omlx_shared.outsider_logs import Refusals, cut

log = logging.getLogger(__name__)


def main_worker(main: Deployment, node: dict) -> dict:
    """The main model's stage on `node`: its layers, worker pid and metrics endpoint."""
    w = next((w for w in node["workers"] if w["model"] == main.model.name), None)
    return {"layers": main.stages_on().get(node["id"]),
            "worker_pid": w["pid"] if w else None, "metrics": w["metrics"] if w else None}


def add_routes(app: FastAPI, manager: ModelManager, rebalancer: Rebalancer,
               registrar: Registrar, usage: Usage, keyed: list[Depends],
               admin: list[Depends]) -> None:
    cluster, main = manager.cluster, manager.main
    refusals = Refusals(log)  # anyone on the LAN may send registrations: a line a minute each

    @app.post("/cluster/register")
    async def register(request: Request) -> JSONResponse:
        """A node that cannot use Bonjour (`join --coordinator`) announces its address and id,
        signed with the cluster secret (omlx_shared/auth.py `registration`): an unsigned,
        forged or replayed one is refused, so nobody else can point the coordinator anywhere."""
        try:
            body = await request.json()
            address = str(body["address"])
            host, _, port = address.rpartition(":")
            if not host or not 0 < int(port) < 65536:
                raise ValueError
        except (ValueError, KeyError, TypeError):
            raise APIError(400, "send {\"address\": \"HOST:PORT\", ...} of the node agent, "
                                "signed as `omlx-cluster join --coordinator` does",
                           param="address")
        try:
            address, node_id = registrar.verify(body)
        except auth.RegistrationError as e:
            source = request.client.host if request.client else "?"
            refusals.warning(source, "registration", "refused a registration of %s from %s: %s",
                             cut(address), source, cut(e))
            raise APIError(401, f"registration refused: {e}", code="invalid_registration")
        if any(n["id"] == node_id and n["address"] == address and n["alive"]
               for n in cluster.nodes):
            return JSONResponse({"status": "member"})
        registrar.admit_soon(address, node_id)
        return JSONResponse({"status": "admitting"}, status_code=202)

    @app.get("/cluster/status", dependencies=admin)
    async def status() -> dict:
        """The main model's plan at the top (what one-model tools read), every model's
        state, replicas, stages and footprints, and the nodes."""
        plan = main.plan
        return {"model": main.model.name, "ready": main.ready, "status": main.status,
                "epoch": main.epoch, "capacity_error": main.capacity_error or None,
                "plan": plan.to_dict() if plan else None,
                **main.layout_status(),
                "backend": ({"name": main.backend.backend, "reason": main.backend.reason}
                            if main.backend else None),
                "last_recovery": main.last_recovery,
                "models": [manager.describe(m) for m in manager.models],
                "unloads": manager.evictions,
                "nodes": [{**n, **rebalancer.measured(n["id"]), **main_worker(main, n)}
                          for n in cluster.nodes]}

    @app.get("/cluster/rebalance", dependencies=admin)
    async def rebalance_advice() -> dict:
        """The measured speeds, the current and the best split, the predicted gain."""
        return await rebalancer.rebalance_now(dry_run=True)

    @app.post("/cluster/rebalance", dependencies=admin)
    async def rebalance_now() -> dict:
        """Moves to the best split for the measured speeds now (past the threshold, the window
        and the cooldown); the answer says whether it moved."""
        if rebalancer.settings.mode == "off":
            raise APIError(409, "rebalancing is off (--rebalance off)")
        return await rebalancer.rebalance_now(dry_run=False)

    @app.get("/cluster/usage", dependencies=keyed)
    async def usage_report(request: Request, since: str = "", key: str | None = None) -> dict:
        """Usage per key and model, summed over whole UTC days from `since` (YYYY-MM-DD or an
        ISO date-time; default: all kept). A user key sees its own; an admin everyone's, or
        one key's with `key`."""
        try:
            day = parse_since(since) if since else ""
        except ValueError:
            raise APIError(400, f"since={since!r}: give a day (2026-12-01) or an ISO date-time "
                                "(2026-12-01T09:00:00Z)", param="since") from None
        account = account_of(request.scope)
        if not account.admin:
            if key not in (None, account.name):
                raise APIError(403, f"the key {account.name!r} (role 'user') may read only its "
                                    "own usage; an admin key reads others'",
                               type="permission_error", code="admin_required")
            key = account.name
        totals = usage.totals(day, key)
        return {"since": day or None, "keys": [
            {"key": name, "models": [{"model": model, **vars(c)} for model, c in ms.items()]}
            for name, ms in sorted(totals.items())]}
