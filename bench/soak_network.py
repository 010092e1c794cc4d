"""Where the chaos soak's cluster runs (bench/soak.py), so that a link can be dropped.

Node b (its join agent and every worker it starts) lives in a network namespace of its own,
joined by a veth pair to the hub's: the namespace of the coordinator, of node a and of the
soak's own threads (its clients, sampler and injector reach the gateway there). `cut` drops
every packet on that pair, as a pulled cable does (tc, `CUT` of tests/netns.py), and `heal`
takes that off again: b's control and data plane both go silent while its processes run on.
Only the network is b's own: its processes keep the host's pids (/proc and signals reach them
as on loopback) and see the mounts made before they start (its cache disk's tmpfs).

Without namespaces (not root, no `ip` or `tc`) everything runs on the host's loopback and
`reason` says why no link can be dropped.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Iterator

from tests.netns import CUT, Link, in_namespace, link, namespace, netns_unavailable_reason, shape

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Network:
    wire: Link | None = None  # the hub (its a side) to node b's namespace (its b side)
    reason: str = ""  # why there is no wire, when there is none

    def namespace_of(self, node: str) -> str | None:
        """The namespace node `node` ("a", "b") or the coordinator runs in; None: the host's."""
        if self.wire is None:
            return None
        return self.wire.b if node == "b" else self.wire.a

    def host_of(self, node: str) -> str:
        """The address node `node` or the coordinator listens on, reached from the hub."""
        if self.wire is None:
            return LOOPBACK
        return self.wire.b_ip if node == "b" else self.wire.a_ip

    def threads(self, n: int) -> AbstractContextManager[ThreadPoolExecutor]:
        """A pool of `n` threads in the hub: the soak's own, which call the gateway."""
        if self.wire is None:
            return ThreadPoolExecutor(n, thread_name_prefix="soak")
        return in_namespace(self.wire.a, n)

    def cut(self) -> None:
        assert self.wire is not None, self.reason
        shape(self.wire, *CUT)

    def heal(self) -> None:
        assert self.wire is not None, self.reason
        shape(self.wire)


def unavailable() -> str | None:
    """Why this process cannot make the namespaces and cut their link, or None."""
    if (why := netns_unavailable_reason()) is not None:
        return why
    return None if shutil.which("tc") else "iproute2's `tc` is not installed"


@contextmanager
def network() -> Iterator[Network]:
    """The hub and b's namespace, joined; both deleted on exit (stop their processes first)."""
    if (why := unavailable()) is not None:
        yield Network(reason=why)
        return
    with namespace("omlx-soak-hub") as hub, namespace("omlx-soak-b") as b:
        yield Network(wire=link(hub, b))
