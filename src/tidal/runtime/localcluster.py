"""A real multi-node Ray cluster on this machine: one raylet per node, each worker node in its
own network namespace with an address on a bridge (``tidal cluster up`` / ``down``).

In: a cluster name, a node count, CPUs per node, a /24 prefix and a GCS port. Out: a running
cluster whose head (node 0) listens on the bridge's address in the host's namespace and whose
worker nodes (1..N-1) live in namespaces ``tidal-<name>-<i>``, each reached only through its
veth on the bridge (so any hop that used loopback across nodes fails), and a state file
``<dir>/cluster.json`` naming the address, nodes and namespaces. Without the rights to make
namespaces (not root, no ``ip``), nodes get distinct loopback addresses 127.0.0.<i+1> instead;
``mode`` says which, and ``up`` prints it.

Every process of the cluster carries ``TIDAL_CLUSTER=<name>`` in its environment (Ray's
workers, engines and satellites inherit it), so ``down`` ends exactly the cluster's processes,
by pid, never another Ray on the same machine; it then removes the namespaces and the bridge.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tidal.errors import ConfigError, TidalError

log = logging.getLogger(__name__)
MARKER = "TIDAL_CLUSTER"


class ClusterError(TidalError):
    """The local cluster could not be started, found or stopped."""


@dataclass
class NodeSpec:
    index: int
    ip: str
    netns: str | None  # None: the host's namespace (the head, or loopback mode)


@dataclass
class ClusterState:
    name: str
    mode: str  # "netns" | "loopback"
    address: str  # the GCS address: what ``tidal run --address`` takes
    dir: str
    nodes: list[NodeSpec] = field(default_factory=list)
    bridge: str | None = None

    @property
    def state_file(self) -> Path:
        return Path(self.dir) / "cluster.json"

    def save(self) -> None:
        self.state_file.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, directory: str | Path) -> ClusterState:
        path = Path(directory) / "cluster.json"
        if not path.is_file():
            raise ClusterError(
                f"no local cluster at {directory} (no cluster.json): "
                "start one with 'tidal cluster up'"
            )
        data = json.loads(path.read_text())
        data["nodes"] = [NodeSpec(**n) for n in data["nodes"]]
        return cls(**data)


def default_dir(name: str) -> Path:
    return Path("/tmp") / f"tidal-cluster-{name}"


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *args] if ns is None else ["ip", "netns", "exec", ns, "ip", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise ClusterError(f"{' '.join(cmd)}: {r.stderr.strip() or r.returncode}")


def _names(name: str, i: int) -> tuple[str, str]:
    """The namespace of node ``i`` and its veth's host end (at most 15 characters)."""
    return f"tidal-{name}-{i}", f"tv{name}{i}"[:15]


def make_network(name: str, prefix: str, n_nodes: int) -> tuple[str, list[NodeSpec]]:
    """The bridge (``<prefix>.1``, the head's address) and one namespace per worker node with
    ``<prefix>.<i+1>`` on a veth enslaved to it; undone on any failure."""
    bridge = f"tb{name}"[:15]
    nodes = [NodeSpec(0, f"{prefix}.1", None)]
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{prefix}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i in range(1, n_nodes):
            ns, veth = _names(name, i)
            ip = f"{prefix}.{i + 1}"
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", bridge)
            _ip("link", "set", veth, "up")
            _ip("addr", "add", f"{ip}/24", "dev", "eth0", ns=ns)
            _ip("link", "set", "eth0", "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
            nodes.append(NodeSpec(i, ip, ns))
    except (ClusterError, OSError) as exc:
        remove_network(name, bridge, n_nodes)
        raise ClusterError(f"network namespaces: {exc}") from None
    return bridge, nodes


def remove_network(name: str, bridge: str | None, n_nodes: int) -> None:
    for i in range(1, n_nodes):
        ns, veth = _names(name, i)
        for args in (("link", "del", veth), ("netns", "del", ns)):
            subprocess.run(["ip", *args], capture_output=True, timeout=30)
    if bridge is not None:
        subprocess.run(["ip", "link", "del", bridge], capture_output=True, timeout=30)


def _env(name: str) -> dict[str, str]:
    """Every process of the cluster: marked, Ray's token auth off (the run's own token guards
    tidal's routes), and this tidal importable by Ray's workers."""
    import tidal

    src = str(Path(tidal.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)
    # a lost node is declared dead after ~3 s of failed health checks (Ray's default ~15 s)
    return {
        **os.environ,
        MARKER: name,
        "RAY_AUTH_MODE": "disabled",
        "PYTHONPATH": path,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_health_check_period_ms": "1000",
        "RAY_health_check_failure_threshold": "3",
    }


def _ray_start(st: ClusterState, node: NodeSpec, cpus: float, port: int, store_mb: int) -> None:
    ray = str(Path(sys.executable).with_name("ray"))
    args = [
        ray,
        "start",
        "--node-ip-address",
        node.ip,
        "--num-cpus",
        f"{cpus:g}",
        "--object-store-memory",
        str(store_mb << 20),
        "--disable-usage-stats",
        "--temp-dir",
        str(Path(st.dir) / "ray"),
        "--resources",
        json.dumps({f"tidal_node_{node.index}": 1}),
    ]
    if node.index == 0:
        args += ["--head", "--port", str(port), "--include-dashboard", "false"]
    else:
        args += ["--address", st.address]
    if st.mode == "loopback":  # one namespace: every node needs its own ports
        from tidal.serving.launch import free_port

        for opt in (
            "--node-manager-port",
            "--object-manager-port",
            "--metrics-export-port",
            "--dashboard-agent-listen-port",
            "--dashboard-agent-grpc-port",
            "--runtime-env-agent-port",
        ):
            args += [opt, str(free_port())]
    if node.netns is not None:
        args = ["ip", "netns", "exec", node.netns, *args]
    r = subprocess.run(args, capture_output=True, text=True, env=_env(st.name), timeout=120)
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        raise ClusterError(f"ray start of node {node.index} ({node.ip}): {' | '.join(tail)}")


def up(
    name: str = "tidal",
    n_nodes: int = 3,
    cpus: float = 1.0,
    prefix: str = "10.77.0",
    port: int = 6390,
    directory: str | Path | None = None,
    store_mb: int = 128,
    timeout_s: float = 120.0,
    head_cpus: float | None = None,
    netns: bool = True,
) -> ClusterState:
    """Start the cluster and wait (bounded) until every node is alive in Ray. ``head_cpus``
    (default ``cpus``): 0 keeps every engine off the head, which then only hosts the driver,
    so every hop of a run crosses the bridge. ``netns`` False: loopback addresses at once."""
    if not name.isalnum() or len(name) > 8:
        raise ConfigError("--name", f"{name!r}: at most 8 letters or digits")
    if n_nodes < 1:
        raise ConfigError("--nodes", "at least 1")
    d = Path(directory) if directory is not None else default_dir(name)
    if (d / "cluster.json").is_file():
        raise ClusterError(
            f"a cluster is already up at {d}: 'tidal cluster down --name {name}' first"
        )
    d.mkdir(parents=True, exist_ok=True)
    try:
        if not netns:
            raise ClusterError("network namespaces not asked for (--no-netns)")
        bridge, nodes = make_network(name, prefix, n_nodes)
        mode = "netns"
    except ClusterError as exc:
        log.warning(
            "%s; falling back to loopback node addresses 127.0.0.<i+1> (one "
            "network namespace: isolation between nodes is not tested)",
            exc,
        )
        bridge, mode = None, "loopback"
        nodes = [NodeSpec(i, f"127.0.0.{i + 1}", None) for i in range(n_nodes)]
    st = ClusterState(name, mode, f"{nodes[0].ip}:{port}", str(d), nodes, bridge)
    st.save()
    try:
        for node in nodes:
            _ray_start(
                st, node, cpus if node.index or head_cpus is None else head_cpus, port, store_mb
            )
        wait_nodes(st, n_nodes, timeout_s)
    except BaseException:
        down(st)
        raise
    return st


def alive_nodes(st: ClusterState) -> list[dict]:
    """Ray's view of the cluster's alive nodes (a short-lived driver connection)."""
    code = (
        "import json, sys, ray; ray.init(address=sys.argv[1], log_to_driver=False, "
        "logging_level='ERROR'); print(json.dumps([{'id': n['NodeID'], 'ip': "
        "n['NodeManagerAddress'], 'resources': n['Resources']} for n in ray.nodes() "
        "if n['Alive']]))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, st.address],
        capture_output=True,
        text=True,
        env=_env(st.name),
        timeout=60,
    )
    if r.returncode != 0:
        raise ClusterError(
            f"cannot reach the cluster at {st.address}: "
            f"{(r.stderr.strip().splitlines() or ['?'])[-1]}"
        )
    return json.loads(r.stdout.strip().splitlines()[-1])


def wait_nodes(st: ClusterState, n: int, timeout_s: float) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        nodes = alive_nodes(st)
        if len(nodes) >= n:
            return nodes
        if time.monotonic() > deadline:
            raise ClusterError(
                f"{len(nodes)} of {n} nodes alive after {timeout_s:g} s "
                f"(see {st.dir}/ray/session_latest/logs)"
            )
        time.sleep(1.0)


def cluster_pids(name: str, netns: str | None = None) -> list[int]:
    """The processes marked as this cluster's (in ``netns`` only, when given)."""
    import psutil

    allowed: set[int] | None = None
    if netns is not None:
        r = subprocess.run(
            ["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=30
        )
        allowed = {int(p) for p in r.stdout.split()}
    out = []
    for p in psutil.process_iter(["pid"]):
        if p.pid == os.getpid() or (allowed is not None and p.pid not in allowed):
            continue
        try:
            if p.environ().get(MARKER) == name:
                out.append(p.pid)
        except (psutil.Error, OSError):
            continue
    return out


def _end(pids: list[int], grace_s: float = 5.0) -> None:
    import psutil

    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
            os.kill(pid, signal.SIGTERM)
        except (ProcessLookupError, psutil.Error):
            continue
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(alive, timeout=grace_s)


def kill_node(st: ClusterState, index: int) -> list[int]:
    """Lose worker node ``index``: SIGKILL its raylet and every process it started (what a
    machine failure looks like to Ray); returns the pids ended."""
    node = next((n for n in st.nodes if n.index == index), None)
    if node is None or index == 0:
        raise ConfigError(
            "--node", f"{index}: a worker node of {st.name} is 1..{len(st.nodes) - 1}"
        )
    if node.netns is not None:
        pids = cluster_pids(st.name, node.netns)
    else:  # loopback mode: the processes of the raylet that holds this node's address
        pids = [p for p in cluster_pids(st.name) if _on_ip(p, node.ip)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    return pids


def _on_ip(pid: int, ip: str) -> bool:
    import psutil

    try:
        cmd = " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return False
    return (
        f"--node-ip-address={ip}" in cmd
        or f"--node-ip-address {ip}" in cmd
        or f"node_ip_address={ip}" in cmd
    )


def down(st: ClusterState) -> int:
    """End every process of the cluster (workers first, the head last), then remove the
    namespaces, the bridge and the state file; returns how many processes were ended."""
    n = 0
    for node in sorted(st.nodes, key=lambda x: -x.index):
        if node.netns is not None:
            pids = cluster_pids(st.name, node.netns)
            _end(pids)
            n += len(pids)
    rest = cluster_pids(st.name)
    _end(rest)
    n += len(rest)
    if st.mode == "netns":
        remove_network(st.name, st.bridge, len(st.nodes))
    st.state_file.unlink(missing_ok=True)  # Ray's logs stay in <dir>/ray for reading
    return n
