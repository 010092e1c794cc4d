"""How remote nodes reach the coordinator: Bonjour announcements (`DiscoveryBridge`) and explicit
registration (`Registrar`, POST /cluster/register).

Either way the coordinator only learns an address and the node id to expect there: the `admit`
callback (`Cluster.add_remote`) admits the node only if the TLS server there holds a certificate
for that id and proves the cluster secret (omlx_shared/auth.py, omlx_shared/cluster_tls.py).
Liveness comes from the coordinator's heartbeats, never from mDNS (a crashed Mac sends no
goodbye).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from omlx_shared import auth
from omlx_shared.outsider_logs import cut

log = logging.getLogger(__name__)


class DiscoveryBridge:
    """Admits the node agents that Bonjour announces (`_omlx-node._tcp.local.`)."""

    def __init__(self, admit: Callable[[str, str], Awaitable[object]],
                 interfaces: list[str] | None):
        self.admit = admit
        self.interfaces = interfaces
        self.browser = None
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        from omlx_shared.discovery import Browser

        self._loop = asyncio.get_running_loop()
        # zeroconf blocks while it starts: off the event loop.
        self.browser = await asyncio.to_thread(Browser, self._added, self._removed,
                                               self.interfaces)

    def _added(self, announcement) -> None:  # on zeroconf's thread
        address = f"{announcement.host}:{announcement.port}"
        self._loop.call_soon_threadsafe(self._admit, address, announcement.node_id)

    def _removed(self, node_id: str) -> None:  # on zeroconf's thread
        log.info("node %s stopped announcing itself", cut(node_id))

    def _admit(self, address: str, node_id: str) -> None:
        task = asyncio.ensure_future(self.admit(address, node_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        if self.browser is not None:
            await asyncio.to_thread(self.browser.close)
        for t in list(self._tasks):
            t.cancel()


class Registrar:
    """Admits the nodes that register over HTTP (`join --coordinator`: Bonjour cannot reach
    them). Each registration is signed with the cluster secret (omlx_shared/auth.py
    `registration`) and its nonce accepted once, so nobody else can point the coordinator
    anywhere."""

    def __init__(self, secret: str | None, admit: Callable[[str, str], Awaitable[object]]):
        self.admit = admit
        self.signed = auth.Registrations(secret)
        self.admitting: set[asyncio.Task] = set()  # admissions under way (kept from the GC)

    def verify(self, body: dict) -> tuple[str, str]:
        """(address, node id) of a valid registration; raises auth.RegistrationError."""
        return self.signed.verify(body)

    def admit_soon(self, address: str, node_id: str) -> None:
        """Admits the node in a task of its own: the registration is answered at once."""
        task = asyncio.create_task(self.admit(address, node_id))
        self.admitting.add(task)
        task.add_done_callback(self.admitting.discard)
