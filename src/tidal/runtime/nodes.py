"""Where a runtime part runs on a Ray cluster: its node's id and address, and the network
interface that carries that address.

In: the Ray context of the calling process (a driver or an actor) and the host's interfaces.
Out: ``here()`` (node id and address; loopback when Ray is not running), ``iface_of`` (the
interface holding an address, which gloo must use: ``GLOO_SOCKET_IFNAME``), and ``sweep``
(on every other alive node, the processes still writing to a run's ``logs/`` ended: at the end
of a run and before a resume). Invariant kept: a
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


def _end_here(run_dir: str) -> tuple[str, int]:
    """On one node: end what still writes to the run's logs (``checkpoint.end_log_writers``)
    and remove the run's spill files there."""
    from tidal.runtime import spill
    from tidal.runtime.checkpoint import end_log_writers

    ended = end_log_writers(run_dir)
    spill.remove(run_dir)  # weights of this node's engines that slept: after their end
    return here().ip, ended


def sweep(ray: object, run_dir: str, timeout_s: float = 60.0) -> dict[str, int]:
    """On every alive node but the driver's (whose own processes the driver ends), a task that
    ends this run's leftover processes; returns how many per node address (bounded)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    me = here().node_id
    task = ray.remote(num_cpus=0, max_retries=0)(_end_here)  # type: ignore[attr-defined]
    refs = [
        task.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
        ).remote(run_dir)
        for n in ray.nodes()
        if n.get("Alive") and n["NodeID"] != me
    ]  # type: ignore[attr-defined]
    if not refs:
        return {}
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)  # type: ignore
    out: dict[str, int] = {}
    for ref in ready:
        try:
            ip, n = ray.get(ref, timeout=1)  # type: ignore[attr-defined]
        except Exception:  # a node lost meanwhile: nothing of ours runs there any more
            continue
        out[ip] = out.get(ip, 0) + n
    return out
