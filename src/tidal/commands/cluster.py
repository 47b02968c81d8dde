"""``tidal cluster up|down|status|kill-node``: a real multi-node Ray cluster on this machine.

In: a cluster name and node count. Out: raylets (head + workers) started with ``ray start``,
each worker node in its own network namespace on a bridge (``tidal.runtime.localcluster``;
loopback addresses where namespaces cannot be made, said in the output), and the address to
give ``tidal run --address``. ``down`` ends exactly this cluster's processes and removes its
network.
"""

from __future__ import annotations

import click

_NAME = click.option(
    "--name", default="tidal", show_default=True, help="Cluster name (at most 8 letters or digits)."
)
_DIR = click.option(
    "--dir",
    "directory",
    default=None,
    help="State and Ray temp directory (default /tmp/tidal-cluster-<name>).",
)


def _state(name: str, directory: str | None):
    from tidal.runtime.localcluster import ClusterState, default_dir

    return ClusterState.load(directory or default_dir(name))


@click.group("cluster", help="Start, inspect and stop a local multi-node Ray cluster.")
def command() -> None:
    pass


@command.command("up", help="Start a head and N-1 worker raylets, one network namespace each.")
@click.option(
    "--nodes",
    default=3,
    show_default=True,
    type=click.IntRange(1, 16),
    help="Nodes in all: the head and N-1 workers.",
)
@click.option(
    "--cpus",
    default=1.0,
    show_default=True,
    type=click.FloatRange(min=0.5),
    help="CPUs each node declares to Ray.",
)
@click.option(
    "--head-cpus",
    default=None,
    type=click.FloatRange(min=0.0),
    help="CPUs the head declares (default --cpus; 0: the head hosts only the "
    "driver, every engine runs on a worker node).",
)
@click.option(
    "--subnet",
    default="10.77.0",
    show_default=True,
    help="The bridge's /24 prefix: the head is .1, node i is .i+1.",
)
@click.option(
    "--port",
    default=6390,
    show_default=True,
    type=click.IntRange(1024, 65535),
    help="The head's GCS port.",
)
@click.option(
    "--object-store-mb",
    default=512,
    show_default=True,
    type=click.IntRange(min=80),
    help="Ray object store of each node (/dev/shm).",
)
@click.option(
    "--netns/--no-netns",
    default=True,
    show_default=True,
    help="Each worker node in its own network namespace (needs root; without it, "
    "or with --no-netns, nodes get loopback addresses 127.0.0.x).",
)
@_NAME
@_DIR
def up(
    nodes: int,
    cpus: float,
    head_cpus: float | None,
    subnet: str,
    port: int,
    object_store_mb: int,
    netns: bool,
    name: str,
    directory: str | None,
) -> None:
    from tidal.runtime import localcluster

    st = localcluster.up(
        name,
        nodes,
        cpus,
        subnet,
        port,
        directory,
        store_mb=object_store_mb,
        head_cpus=head_cpus,
        netns=netns,
    )
    click.echo(
        f"cluster {st.name}: {len(st.nodes)} nodes ({st.mode} mode"
        + (
            ""
            if st.mode == "netns"
            else ": nodes share this host's network "
            "namespace on loopback addresses, so loopback hops are not caught"
        )
        + ")"
    )
    for n in st.nodes:
        click.echo(f"  node {n.index}: {n.ip}" + (f" (netns {n.netns})" if n.netns else ""))
    click.echo(f"address: {st.address}  (tidal run CONFIG --address {st.address})")


@command.command("status", help="The cluster's alive nodes, as Ray sees them.")
@_NAME
@_DIR
def status(name: str, directory: str | None) -> None:
    from tidal.runtime.localcluster import alive_nodes

    st = _state(name, directory)
    nodes = alive_nodes(st)
    click.echo(
        f"cluster {st.name} at {st.address} ({st.mode}): {len(nodes)} of "
        f"{len(st.nodes)} nodes alive"
    )
    for n in nodes:
        click.echo(f"  {n['ip']}  {n['id']}  CPU {n['resources'].get('CPU', 0):g}")


@command.command("kill-node", help="Lose a worker node: SIGKILL its raylet and its processes.")
@click.argument("index", type=int)
@_NAME
@_DIR
def kill_node(index: int, name: str, directory: str | None) -> None:
    from tidal.runtime.localcluster import kill_node as kill

    pids = kill(_state(name, directory), index)
    click.echo(f"node {index}: {len(pids)} processes killed")


@command.command("down", help="End every process of the cluster; remove its network.")
@_NAME
@_DIR
def down(name: str, directory: str | None) -> None:
    from tidal.runtime.localcluster import down as stop

    n = stop(_state(name, directory))
    click.echo(f"cluster {name}: {n} processes ended, network removed")
