"""Node addresses and the local cluster's bookkeeping, without starting Ray: which interface
holds a node's address (gloo's GLOO_SOCKET_IFNAME), the names the cluster gives its network
parts (Linux caps interface names at 15 characters), its state file, and the one-line errors
of bad input."""

from __future__ import annotations

import socket

import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tidal.errors import ConfigError
from tidal.runtime import localcluster
from tidal.runtime.localcluster import ClusterError, ClusterState, NodeSpec
from tidal.runtime.nodes import Node, NodeError, iface_of


def test_a_node_address_maps_to_the_interface_that_holds_it():
    assert iface_of("127.0.0.1") == iface_of("127.0.0.3") == "lo"
    held = [
        (name, a.address)
        for name, addrs in psutil.net_if_addrs().items()
        for a in addrs
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]
    for name, ip in held:
        assert iface_of(ip) == name
    with pytest.raises(NodeError, match=r"no network interface .* holds the node address 198\.51"):
        iface_of("198.51.100.77")  # TEST-NET-2: no host holds it
    assert Node(None, "127.0.0.1").loopback and not Node("x", "10.77.0.2").loopback


@given(st.text("abcdefghijklmnopqrstuvwxyz0123456789", min_size=1, max_size=8), st.integers(1, 15))
def test_network_names_fit_linux_limits_and_differ_per_node(name, i):
    ns, veth = localcluster._names(name, i)
    assert len(veth) <= 15 and len(f"tb{name}") <= 15
    assert (ns, veth) != localcluster._names(name, i + 1)


def test_the_state_file_round_trips_and_its_absence_says_what_to_do(tmp_path):
    state = ClusterState(
        "ci",
        "netns",
        "10.77.0.1:6390",
        str(tmp_path),
        [NodeSpec(0, "10.77.0.1", None), NodeSpec(1, "10.77.0.2", "tidal-ci-1")],
        "tbci",
    )
    state.save()
    assert ClusterState.load(tmp_path) == state
    with pytest.raises(ClusterError, match=r"no local cluster at .* 'tidal cluster up'"):
        ClusterState.load(tmp_path / "other")


def test_bad_input_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match="--name"):
        localcluster.up("no-dashes", directory=tmp_path)
    with pytest.raises(ConfigError, match="--nodes"):
        localcluster.up("ok", n_nodes=0, directory=tmp_path)
    ClusterState("ok", "netns", "10.77.0.1:6390", str(tmp_path)).save()
    with pytest.raises(ClusterError, match=r"already up .* 'tidal cluster down --name ok'"):
        localcluster.up("ok", directory=tmp_path)
    with pytest.raises(ConfigError, match="--node"):
        localcluster.kill_node(ClusterState.load(tmp_path), 0)  # the head is not a worker


def test_the_cluster_command_answers_bad_input_in_one_line(tmp_path, capsys):
    from tidal.cli import main

    for argv, code, message in [
        (
            ["cluster", "status", "--dir", str(tmp_path)],
            1,
            f"no local cluster at {tmp_path} (no cluster.json)",
        ),
        (["cluster", "up", "--nodes", "0"], 2, "'--nodes': 0 is not in the range"),
        (
            ["cluster", "up", "--name", "a-b", "--dir", str(tmp_path)],
            2,
            "--name: 'a-b': at most 8 letters or digits",
        ),
    ]:
        assert main(argv) == code, argv
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and message in err, err
