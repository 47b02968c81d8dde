"""``tidal run`` on a real multi-node Ray cluster on this machine (``tidal cluster up``): a head
that hosts only the driver and three worker raylets, each in its own network namespace on a
bridge, so every hop between the driver, the proxy, the engines and the satellites crosses the
bridge with the run's token (a loopback address would not reach another node). As root (CI)
the cluster must be in namespaces: a fallback to loopback node addresses fails the tests unless
asked for (``TIDAL_TEST_CLUSTER_NETNS=0``); without root that fallback is what runs, and the
fixture prints the mode.

Checks: the engines of ``tiny.yaml`` sit on three different nodes (node ids from Ray); cells
move both ways and a drained request's KV cache moves between nodes (one engine per node: every
handoff crosses the bridge); weights reach every engine across nodes by the broadcast carrier
(the decision log names it per engine and publication); a satellite on another node joins the
core's steps; and a node lost mid-run (its raylet and every process on it killed)
costs nothing: its cell is replaced on a surviving node, no request fails, no execution is lost
or trained twice, and the summary counts the node in ``nodes_lost``. After every run no process
of it is left on any node.
"""

from __future__ import annotations

import ipaddress
import json
import os
import threading

import pytest
import yaml

from tidal.config import RunConfig, load_yaml
from tidal.runtime import localcluster
from tidal.runtime.checkpoint import end_log_writers
from tidal.runtime.driver import Runtime
from tidal.runtime.engines import EngineId

from .busy import drain_when_busy, wait_until_busy
from .clusters import four_node_cluster
from .test_tiny_run import CONFIG, expected_groups

pytestmark = pytest.mark.slow
GROUPS = expected_groups(yaml.safe_load(CONFIG.read_text()))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with four_node_cluster("t", 200, tmp_path_factory.mktemp("cluster")) as st:
        forced = os.environ.get("TIDAL_TEST_CLUSTER_NETNS") == "0"
        if os.geteuid() == 0 and not forced:  # root can make namespaces: no silent fallback
            assert st.mode == "netns", f"cluster fell back to {st.mode} as root"
        yield st


def _config(cluster, strategy: str, **runtime) -> RunConfig:
    cfg = load_yaml(CONFIG).model_dump(mode="json")
    cfg["runtime"].update(ray_address=cluster.address, placement_strategy=strategy, **runtime)
    return RunConfig.model_validate(cfg)


def _trained(out) -> list[str]:
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return sorted(g for m in metrics for g in m["groups"])


def _nothing_lost(s: dict, out) -> None:
    assert s["failed_requests"] == 0 and s["timed_out_executions"] == 0, s
    assert s["lost_executions"] == 0 and s["record_errors"] == [], s
    assert s["dispatched"] == s["closed"] == s["trained_executions"] == 48, s
    assert s["duplicate_closes"] == 0 and s["trainer_steps"] == 4
    assert _trained(out) == GROUPS  # every group trained exactly once
    assert end_log_writers(out) == 0  # no process of the run outlived it, on any node


def test_tiny_run_spreads_its_engines_over_three_nodes(cluster, tmp_path):
    out = tmp_path / "run"
    # calls long enough (and all of a burst at once) that a cell's drain may find some in
    # flight; besides the plans' drains, the standalone engine is drained while it serves a
    # call, so at least one call moves between nodes with its KV whatever the timing
    runtime = Runtime(
        _config(cluster, "STRICT_SPREAD", max_tokens=160, dispatch_interval_s=0.0), out
    )
    seen: dict = {}
    mover = threading.Thread(target=drain_when_busy, args=(runtime, "s0", seen), daemon=True)
    mover.start()
    s = runtime.run()
    mover.join(10)
    workers = {
        n["id"]: n["ip"]
        for n in localcluster.alive_nodes(cluster)
        if n["resources"].get("CPU", 0) > 0
    }  # the head declares none
    placed = {name: (e["node_id"], e["node_ip"]) for name, e in s["engines"].items()}
    print(
        json.dumps(
            {
                "placed": placed,
                "seen": seen,
                **{
                    k: s[k]
                    for k in ("run_time_s", "engine_handoffs", "drained_requests", "kv_handoffs")
                },
            }
        )
    )
    # one engine per worker node, as Ray placed them; none on the driver's head node
    assert len({node for node, _ in placed.values()}) == 3
    assert {node: ip for node, ip in placed.values()} == workers
    if cluster.mode == "netns":  # each engine on its own namespace's bridge address
        assert not any(ipaddress.ip_address(ip).is_loopback for _, ip in placed.values())
    # a drained call moved with its KV cache, from one node's engine to another's
    assert seen.get("drained", {}).get("moved", 0) >= 1, seen
    # every call the test's drain moved was handed its KV (the plans' drains may add more;
    # whether they find a call still running is timing, and a call its engine finished
    # before the abort landed is not counted as moved: ``drained_requests`` sums theirs)
    assert s["kv_handoffs"] >= seen["drained"]["moved"], (s["kv_handoffs"], seen)
    assert s["drained_requests"] <= s["rerouted_requests"], s
    assert s["nodes"] == 4 and s["nodes_lost"] == 0
    assert s["switches_to_training"] >= 1 and s["switches_to_rollout"] >= 1
    assert s["plans_aborted"] == 0
    _nothing_lost(s, out)
    for name, engine in s["engines"].items():
        assert not engine["restarted"], name
        if engine["state"] == "awake":
            assert engine["version"] == "v4", (name, engine)
    # every publication crossed nodes by the broadcast carrier (a gloo group across the
    # bridge, into each node's shared memory; no engine on the driver's node), none fell back
    records = [json.loads(x) for x in (out / "decisions.jsonl").read_text().splitlines()]
    pubs = [r for r in records if r["type"] == "weights_published"]
    assert [p["version"] for p in pubs] == [2, 4]
    assert all(p["transports"] and set(p["transports"].values()) == {"broadcast"} for p in pubs)
    assert not any("fell_back_from" in e for p in pubs for e in p["engines"].values()), pubs


def test_a_satellite_on_another_node_joins_the_cores_steps(cluster, tmp_path):
    out = tmp_path / "run"
    cfg = _config(cluster, "STRICT_SPREAD")
    cfg = cfg.model_copy(update={"policy": cfg.policy.from_spec("static:cells=2")})
    s = Runtime(cfg, out).run()
    head = next(
        n["id"] for n in localcluster.alive_nodes(cluster) if not n["resources"].get("CPU", 0)
    )
    assert s["engines"]["c1"]["node_id"] != head  # the core is in the driver, on the head
    assert s["satellite_joins"] >= 1, s
    assert s["micro_steps_by_cell"].get("1", 0) >= 1, s["micro_steps_by_cell"]
    _nothing_lost(s, out)


def _lose_node_when_busy(
    runtime: Runtime, cluster, name: str, seen: dict, deadline_s: float = 120.0
) -> None:
    """Kill the node hosting engine ``name`` once it serves live requests."""
    listed = wait_until_busy(runtime, name, deadline_s)
    if listed is None:
        return
    entry = next(e for e in listed if e["id"] == name)
    node = next(n for n in cluster.nodes if f"//{n.ip}:" in entry["url"])
    seen.update(
        inflight_at_kill=entry["inflight"],
        node=node.index,
        node_id=runtime.engines.nodes[EngineId.parse(name)],
        pids=localcluster.kill_node(cluster, node.index),
    )


def test_a_node_lost_mid_run_loses_nothing(cluster, tmp_path):
    out = tmp_path / "run"
    runtime = Runtime(_config(cluster, "SPREAD"), out)
    seen: dict = {}
    killer = threading.Thread(
        target=_lose_node_when_busy, args=(runtime, cluster, "c1", seen), daemon=True
    )
    killer.start()
    s = runtime.run()
    killer.join(5)
    print(
        json.dumps(
            {
                "seen": seen,
                **{
                    k: s[k]
                    for k in (
                        "run_time_s",
                        "cells_replaced",
                        "rerouted_requests",
                        "engine_failures",
                        "nodes_lost",
                    )
                },
            }
        )
    )
    assert seen.get("pids"), seen  # the node's raylet and its processes were killed
    assert s["nodes_lost"] == 1
    assert "c1" in s["cells_replaced"] and s["engines"]["c1"]["restarted"]
    assert s["engines"]["c1"]["node_id"] != seen["node_id"]  # on a surviving node
    assert s["rerouted_requests"] >= seen["inflight_at_kill"]
    _nothing_lost(s, out)
