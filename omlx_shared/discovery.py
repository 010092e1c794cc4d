"""Bonjour (mDNS / DNS-SD) discovery of node agents, on python-zeroconf.

A node agent (`omlx-cluster join`) announces itself with an `Advertiser`: one
`_omlx-node._tcp.local.` service whose instance name is the node id, whose SRV port is the
agent's gRPC port, whose A record is the address peers should dial, and whose TXT record carries
what the coordinator needs before it even connects (version, memory, chip, data-plane port).
The coordinator watches the LAN with a `Browser`, which turns zeroconf's add/remove events into
`NodeAnnouncement`s.

Threading: zeroconf runs its own event loop on a private thread, and `ServiceBrowser` delivers
events on another thread of its own. `Browser` callbacks therefore run on that browser thread,
never on the caller's asyncio loop: an asyncio caller hops back with
`loop.call_soon_threadsafe(...)`. The constructors and `close()` of both classes block (an
advertiser probes the name for ~1-2 s before it announces, and says goodbye when it closes), so
from asyncio call them through `asyncio.to_thread(...)`.

Only IPv4 is announced and listened to: the data plane (mx.distributed ring) and the gRPC
control plane dial IPv4 addresses, and IPv6 link-local mDNS adds scope-id trouble for nothing.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import threading
from dataclasses import dataclass
from typing import Callable, Mapping

from zeroconf import (
    InterfaceChoice,
    IPVersion,
    ServiceBrowser,
    ServiceInfo,
    ServiceStateChange,
    Zeroconf,
)

from omlx_shared.outsider_logs import cut

log = logging.getLogger(__name__)

SERVICE_TYPE = "_omlx-node._tcp.local."

# How long a browser waits for a newly seen service's SRV/TXT/A records. Answers on a LAN take
# milliseconds; the bound only stops a half-announced or vanished node from stalling the browser
# thread (events are handled one at a time, in order, on that thread).
RESOLVE_TIMEOUT_MS = 3000

# The mDNS IPv4 group. Connecting a UDP socket to it asks the kernel which source address
# multicast would leave from, without sending a packet (see `announce_address`).
_MDNS_GROUP = "224.0.0.251"
_MDNS_PORT = 5353

# DNS labels are at most 63 bytes; the instance name (the node id) is one label.
_MAX_LABEL_BYTES = 63


def _check_node_id(node_id: str) -> None:
    if not node_id:
        raise ValueError("node id must not be empty")
    if len(node_id.encode("utf-8")) > _MAX_LABEL_BYTES:
        raise ValueError(
            f"node id {node_id!r} is longer than {_MAX_LABEL_BYTES} bytes (one DNS label)"
        )


def _check_announce_host(host: str) -> str:
    """The announced address must be one peers can dial: an IPv4 literal, not 0.0.0.0."""
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"announced host must be an IPv4 address, got {host!r}") from None
    if addr.version != 4:
        raise ValueError(f"only IPv4 is announced, got {host!r}")
    if addr.is_unspecified:
        raise ValueError(
            "cannot announce 0.0.0.0: pass the address peers should dial "
            "(announce_address('0.0.0.0') picks the one multicast leaves from)"
        )
    return str(addr)


@dataclass
class NodeAnnouncement:
    """What one node agent tells the LAN about itself."""

    node_id: str  # unique per node; also the DNS-SD instance name
    host: str  # IPv4 address peers dial for gRPC and the data plane
    port: int  # gRPC control-plane port (the SRV port)
    version: str  # omlx-cluster version of the agent, so a coordinator can refuse a mismatch
    memory_bytes: int  # total memory of the machine (the planner subtracts its OS reserve)
    chip: str  # e.g. "Apple M2 Ultra"; informative, speed is measured not guessed
    data_port: int = 0  # data-plane (mx.distributed ring) port, 0 when not chosen yet

    def to_properties(self) -> dict[str, str]:
        """TXT record: every value a decimal or plain string (TXT is bytes; keep it readable)."""
        return {
            "id": self.node_id,
            "version": self.version,
            "memory": str(int(self.memory_bytes)),
            "chip": self.chip,
            # Duplicates the SRV port so a TXT-only consumer (dns-sd -L, a debugging human) sees it.
            "grpc_port": str(int(self.port)),
            "data_port": str(int(self.data_port)),
        }

    @classmethod
    def from_service_info(cls, info: ServiceInfo) -> "NodeAnnouncement":
        """Parse a resolved ServiceInfo; raises ValueError when it is not one of ours or is broken.

        A foreign or half-written announcement on the LAN must be skippable, never fatal, hence
        one exception type for every defect.
        """
        props = _decode_properties(info.properties or {})
        try:
            node_id = props["id"]
            version = props["version"]
            memory_bytes = int(props["memory"])
            chip = props.get("chip", "")
            data_port = int(props.get("data_port", "0") or 0)
            # The SRV port is authoritative; the TXT copy is the fallback.
            port = int(info.port) if info.port else int(props["grpc_port"])
        except (KeyError, ValueError, TypeError) as exc:
            raise ValueError(
                f"malformed {SERVICE_TYPE} announcement {info.name!r}: {exc!r}"
            ) from None
        addresses = info.parsed_addresses(IPVersion.V4Only)
        if not addresses:
            raise ValueError(f"announcement {info.name!r} has no IPv4 address")
        return cls(
            node_id=node_id,
            host=addresses[0],
            port=port,
            version=version,
            memory_bytes=memory_bytes,
            chip=chip,
            data_port=data_port,
        )


def _decode_properties(raw: Mapping[bytes | str, bytes | str | None]) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in raw.items():
        k = key.decode("utf-8", "replace") if isinstance(key, bytes) else str(key)
        if value is None:  # a TXT key without "=" (boolean attribute): not one of ours
            continue
        out[k] = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return out


def _address(host: str) -> str:
    """`host` as an IP literal: a host name (mac1.local) as the IPv4 address it resolves to,
    the one a bind to that name listens on."""
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    try:
        return socket.gethostbyname(host)
    except OSError as e:
        raise ValueError(f"cannot resolve the host {host!r} to an IPv4 address ({e}): pass "
                         "this machine's LAN address") from None


def default_interfaces(host: str) -> list[str] | None:
    """Which interfaces to run mDNS on for an agent listening on `host`.

    Loopback -> only loopback (a single-Mac cluster must not shout on the LAN); a specific
    address (a host name: as it resolves) -> that interface only; 0.0.0.0 / "" -> None, meaning
    all interfaces.
    """
    if host in ("", "0.0.0.0", "*"):
        return None
    if host == "localhost":
        return ["127.0.0.1"]
    addr = ipaddress.ip_address(_address(host))
    if addr.is_unspecified:
        return None
    if addr.is_loopback:
        # zeroconf cannot listen on ::1 and we are IPv4-only anyway.
        return ["127.0.0.1"]
    return [str(addr)]


def announce_address(bind_host: str) -> str:
    """The address to announce for an agent bound to `bind_host`.

    A specific address is announced as is, a host name as the IPv4 address it resolves to (the
    address its bind listens on). For 0.0.0.0 the agent listens everywhere, so announce
    the address that multicast (hence mDNS) leaves from: that is the interface peers on the same
    LAN segment can reach. Connecting a UDP socket only consults the routing table; nothing is
    sent. Falls back to 127.0.0.1 when no route gives a usable source address.
    """
    if bind_host == "localhost":
        return "127.0.0.1"
    if bind_host not in ("", "0.0.0.0"):
        return _check_announce_host(_address(bind_host))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((_MDNS_GROUP, _MDNS_PORT))
            chosen = s.getsockname()[0]
        except OSError:
            return "127.0.0.1"
    # 0.0.0.0 back means the route names no source address (e.g. multicast routed on a loopback
    # whose only address is host-scoped): the machine has no LAN, loopback is all there is.
    return "127.0.0.1" if chosen == "0.0.0.0" else chosen


def _zeroconf_interfaces(interfaces: list[str] | None) -> list[str] | InterfaceChoice:
    return InterfaceChoice.All if interfaces is None else list(interfaces)


def _new_zeroconf(interfaces: list[str] | None) -> Zeroconf:
    """A Zeroconf instance that always runs its own loop thread.

    Built on a thread with a running asyncio loop, Zeroconf would attach to that loop, and its
    blocking calls (register, resolve, close) would then deadlock against the very loop they wait
    on. Building it on a helper thread (no running loop there) gives it a private loop thread
    whatever zeroconf version is installed.
    """
    kwargs = dict(interfaces=_zeroconf_interfaces(interfaces), ip_version=IPVersion.V4Only)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return Zeroconf(**kwargs)
    result: list[Zeroconf | BaseException] = []

    def build() -> None:
        try:
            result.append(Zeroconf(**kwargs))
        except BaseException as exc:  # re-raised on the caller's thread
            result.append(exc)

    t = threading.Thread(target=build, name="omlx-zeroconf-init", daemon=True)
    t.start()
    t.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def _service_name(node_id: str) -> str:
    return f"{node_id}.{SERVICE_TYPE}"


def _server_name(node_id: str) -> str:
    # A host name of our own rather than the machine's: macOS's mDNSResponder already owns
    # "<mac>.local." and two responders answering for one name would fight over it.
    label = "".join(c if c.isalnum() or c == "-" else "-" for c in node_id).strip("-") or "node"
    return f"omlx-{label}"[:_MAX_LABEL_BYTES] + ".local."


class Advertiser:
    """Announces one node on mDNS until `close()`.

    `interfaces`: None = all interfaces, else a list of IPv4 addresses (see `default_interfaces`).
    The constructor blocks while the name is probed and announced (~1-2 s).
    """

    def __init__(self, announcement: NodeAnnouncement, interfaces: list[str] | None = None) -> None:
        _check_node_id(announcement.node_id)
        host = _check_announce_host(announcement.host)
        self.announcement = announcement
        self.info = ServiceInfo(
            SERVICE_TYPE,
            _service_name(announcement.node_id),
            port=int(announcement.port),
            properties=announcement.to_properties(),
            server=_server_name(announcement.node_id),
            addresses=[socket.inet_aton(host)],
        )
        self._lock = threading.Lock()
        self._closed = False
        self._zc = _new_zeroconf(interfaces)
        try:
            # As Bonjour does, a taken instance name is renamed rather than fatal (two Macs
            # given one --name); the node id in the TXT record is what the coordinator uses.
            self._zc.register_service(self.info, allow_name_change=True)
            if self.info.name != _service_name(announcement.node_id):
                log.warning("another node announces %r: this one announces itself as %r",
                            _service_name(announcement.node_id), self.info.name)
        except BaseException:
            self._zc.close()
            raise

    def close(self) -> None:
        """Unregister (sends goodbye packets so browsers drop the node at once); idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._zc.unregister_service(self.info)
        except Exception:  # the goodbye is best effort; the TTL expires it anyway
            log.warning("mDNS unregister of %s failed", self.info.name, exc_info=True)
        finally:
            self._zc.close()

    def __enter__(self) -> "Advertiser":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Browser:
    """Watches the LAN for node agents.

    `on_added(announcement)` runs when a node appears and again whenever its TXT record changes
    (treat it as an upsert keyed by node_id); `on_removed(node_id)` runs when a node we reported
    says goodbye or its records expire. Both run on zeroconf's ServiceBrowser thread, one event
    at a time and in order; keep them short and hop to your own loop
    (`loop.call_soon_threadsafe`). Do not call `close()` from inside a callback.

    A node that is killed without a goodbye disappears only when its records' TTL runs out
    (minutes): liveness belongs to the gRPC control plane, not to mDNS.
    """

    def __init__(
        self,
        on_added: Callable[[NodeAnnouncement], None],
        on_removed: Callable[[str], None],
        interfaces: list[str] | None = None,
    ) -> None:
        self._on_added = on_added
        self._on_removed = on_removed
        self._lock = threading.Lock()
        self._closed = False
        # service name -> node id of the nodes we reported as added, so a removal is reported
        # only for a node the caller knows about, with the id it was given.
        self._known: dict[str, str] = {}
        self._zc = _new_zeroconf(interfaces)
        self._browser = ServiceBrowser(self._zc, SERVICE_TYPE, handlers=[self._on_state_change])

    def _on_state_change(
        self,
        zeroconf: Zeroconf,
        service_type: str,
        name: str,
        state_change: ServiceStateChange,
    ) -> None:
        if self._closed:
            return
        try:
            if state_change is ServiceStateChange.Removed:
                with self._lock:
                    node_id = self._known.pop(name, None)
                if node_id is not None:
                    self._on_removed(node_id)
                return
            # Added or Updated: resolve (from the cache when the announcement carried everything,
            # else by asking, bounded).
            info = zeroconf.get_service_info(service_type, name, timeout=RESOLVE_TIMEOUT_MS)
            if info is None:
                log.warning("mDNS: could not resolve %s within %d ms", cut(name),
                            RESOLVE_TIMEOUT_MS)
                return
            try:
                announcement = NodeAnnouncement.from_service_info(info)
            except ValueError as exc:
                log.warning("mDNS: ignoring %s", cut(exc))
                return
            with self._lock:
                if self._closed:
                    return
                self._known[name] = announcement.node_id
            self._on_added(announcement)
        except Exception:
            # A failing callback must not kill the browser thread (later nodes would go unseen).
            log.exception("mDNS: handling %s %s failed", state_change, cut(name))

    def close(self) -> None:
        """Stop browsing; no callback runs after this returns. Idempotent."""
        if threading.current_thread() is self._browser:
            raise RuntimeError("Browser.close() called from its own callback")
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._browser.cancel()  # joins the browser thread
        finally:
            self._zc.close()

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
