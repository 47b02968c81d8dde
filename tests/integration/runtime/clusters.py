"""A real four-raylet Ray cluster on this machine for a test module (``tidal cluster up``): a
head that hosts only the driver and three worker nodes, each in its own network namespace on a
bridge (root), or on loopback addresses where namespaces cannot be made
(``TIDAL_TEST_CLUSTER_NETNS=0`` forces that fallback)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tidal.runtime import localcluster
from tidal.serving.launch import free_port


@contextmanager
def four_node_cluster(tag: str, net: int, directory: Any) -> Iterator[Any]:
    """The cluster, named ``<tag><pid>`` on subnet ``10.<net + pid % 50>.<pid % 250>.0/24``
    (distinct per module and per concurrent test process); ended, every process of it, after
    the block."""
    pid = os.getpid()
    st = localcluster.up(
        f"{tag}{pid % 100000}",
        n_nodes=4,
        cpus=1.0,
        head_cpus=0.0,
        prefix=f"10.{net + pid % 50}.{pid % 250}",
        port=free_port(),
        directory=directory,
        netns=os.environ.get("TIDAL_TEST_CLUSTER_NETNS", "1") != "0",
    )
    print(f"cluster {st.name}: {st.mode} mode, {[n.ip for n in st.nodes]}")
    try:
        yield st
    finally:
        localcluster.down(st)
