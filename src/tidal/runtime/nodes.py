"""Where a runtime part runs on a Ray cluster: its node's id and address, and the network
interface that carries that address.

In: the Ray context of the calling process (a driver or an actor) and the host's interfaces.
Out: ``here()`` (node id and address; loopback when Ray is not running) and ``iface_of`` (the
interface holding an address, which gloo must use: ``GLOO_SOCKET_IFNAME``). Invariant kept: a
part another node must reach listens on its node's address, never on loopback and never on
every interface; a part on a loopback-only (embedded) run stays on loopback.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from tidal.errors import TidalError


class NodeError(TidalError):
    """The node's address is not held by any interface of this host."""


@dataclass(frozen=True)
class Node:
    node_id: str | None  # Ray's hex node id (None: Ray not running in this process)
    ip: str

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.ip).is_loopback

    def gloo_iface(self) -> str:
        return iface_of(self.ip)


def here() -> Node:
    """This process's node: from Ray when it runs here, else loopback."""
    import ray

    if not ray.is_initialized():
        return Node(None, "127.0.0.1")
    ctx = ray.get_runtime_context()
    return Node(ctx.get_node_id(), ray.util.get_node_ip_address())


def iface_of(ip: str) -> str:
    """The name of the interface that holds ``ip`` (``lo`` for any loopback address)."""
    import socket

    import psutil

    if ipaddress.ip_address(ip).is_loopback:
        return "lo"
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addrs):
            return name
    raise NodeError(f"no network interface of this host holds the node address {ip}")
