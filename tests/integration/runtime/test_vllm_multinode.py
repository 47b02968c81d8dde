"""vLLM tier (``make test-vllm``): ``tidal run configs/vllm.yaml`` on a real multi-node Ray cluster
on this machine (``tidal cluster up``: a head that hosts only the driver, three worker raylets,
each in its own network namespace on a bridge), so every vLLM server sits on another node than
the driver and the proxy, and nothing reaches it over loopback.

Checks: the three vLLM engines (one standalone, two elastic cells) run on three different worker
nodes and answer on those nodes' addresses; cells move both ways with their one vLLM server
each, live calls rerouted between nodes; every published version reaches every engine through
Ray's object store (the decision log names the transport per publication), each engine ends at
the final version it read back from its server; nothing fails or is lost; and no process of the
run outlives it on any node. Mid-run the standalone engine's vLLM server (on its worker node) is
killed while it serves live calls: the supervisor starts a new server there, loads the current
version into it through the object store and rejoins it, and the lost calls are retried
elsewhere. Calls drained mid-call keep their KV across nodes (each export carried to the next
server's node; 0 re-prefilled tokens, the destinations' own counters show the loads). Every
route of those servers needs the run's token
(``test_vllm_cell.py`` checks the guard itself).

Skipped unless ``TIDAL_VLLM_PYTHON`` names the vLLM venv's python.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import httpx
import pytest

from tidal.config import RunConfig, load_yaml
from tidal.runtime import localcluster
from tidal.runtime.checkpoint import end_log_writers
from tidal.runtime.driver import Runtime
from tidal.runtime.engines import EngineId

from .busy import engines_listed, wait_until_busy
from .clusters import four_node_cluster

VLLM_PYTHON = os.environ.get("TIDAL_VLLM_PYTHON")
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not VLLM_PYTHON, reason="set TIDAL_VLLM_PYTHON (make test-vllm)"),
]
CONFIG = Path(__file__).resolve().parents[3] / "configs" / "vllm.yaml"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with four_node_cluster("v", 150, tmp_path_factory.mktemp("cluster")) as st:
        yield st


def _kill_server_when_busy(runtime: Runtime, name: str, seen: dict) -> None:
    """SIGKILL engine ``name``'s vLLM server (its actor lives on) once it serves live calls."""
    import ray

    listed = wait_until_busy(runtime, name, 300.0)
    if listed is None:
        return
    seen["inflight_at_kill"] = next(e["inflight"] for e in listed if e["id"] == name)
    ray.get(runtime.engines.actors[EngineId.parse(name)].kill_engine.remote(), timeout=60)
    seen["killed"] = True


def _watch_kv_counters(runtime: Runtime, seen: dict, stop: threading.Event) -> None:
    """Until ``stop``: every vLLM server's own prompt-token counters (``/metrics``, by
    source), last seen per server (a replaced server starts from zero under a new URL)."""
    from tidal.testing.vllm_servers import counters

    token = {"Authorization": f"Bearer {runtime.engine_token}"}
    while not stop.wait(0.25):
        if runtime.wired is None:
            continue
        try:
            for e in engines_listed(runtime):
                text = httpx.get(f"{e['url']}/metrics", timeout=5, headers=token).text
                seen[(e["id"], e["url"])] = counters(text)
        except (httpx.HTTPError, KeyError, ValueError):
            continue


@pytest.mark.timeout(1200)
def test_vllm_engines_on_three_other_nodes(cluster, smollm2, tmp_path):
    cfg = load_yaml(CONFIG).model_dump(mode="json")
    cfg["runtime"].update(ray_address=cluster.address, placement_strategy="STRICT_SPREAD")
    cfg["runtime"]["vllm"]["python"] = VLLM_PYTHON
    out = tmp_path / "run"
    runtime = Runtime(RunConfig.model_validate(cfg), out)
    seen: dict = {}
    killer = threading.Thread(
        target=_kill_server_when_busy, args=(runtime, "s0", seen), daemon=True
    )
    killer.start()
    kv_seen: dict = {}
    stop = threading.Event()
    watcher = threading.Thread(
        target=_watch_kv_counters, args=(runtime, kv_seen, stop), daemon=True
    )
    watcher.start()
    s = runtime.run()
    stop.set()
    killer.join(5)
    watcher.join(10)
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
                    for k in (
                        "run_time_s",
                        "rerouted_requests",
                        "reprefill_tokens",
                        "switch_s",
                        "cells_replaced",
                        "engine_failures",
                        "kv_handoffs",
                        "kv_handoff_failures",
                    )
                },
            }
        )
    )
    assert s["backend_by_engine"] == {"s0": "vllm", "c0": "vllm", "c1": "vllm"}
    # one engine per worker node, as Ray placed them, none on the driver's head node
    assert len({node for node, _ in placed.values()}) == 3
    assert {node: ip for node, ip in placed.values()} == workers
    for name, (_, ip) in placed.items():  # each serves on its node's address, not loopback
        log = (out / "logs" / f"engine-{name}.log").read_text(errors="replace")
        assert f"Starting vLLM server on http://{ip}:" in log, name
    assert s["nodes"] == 4 and s["nodes_lost"] == 0
    assert s["switches_to_training"] >= 2 and s["switches_to_rollout"] >= 2
    assert s["failed_requests"] == 0 and s["lost_executions"] == 0, s
    assert s["dispatched"] == s["closed"] == s["trained_executions"] == 32, s
    # the killed server was replaced on its node, with the current weights, and its calls moved
    assert seen.get("killed") and seen["inflight_at_kill"] > 0, seen
    assert s["cells_replaced"] == ["s0"], s["cells_replaced"]
    assert s["rerouted_requests"] >= seen["inflight_at_kill"]
    for name, engine in s["engines"].items():
        assert engine["restarted"] == (name == "s0"), (name, engine)
        assert engine["version"] == "v4", (name, engine)
    records = [json.loads(x) for x in (out / "decisions.jsonl").read_text().splitlines()]
    # while s0's new server started (a minute), a cell leaving rollout had nowhere to move its
    # calls: those plans were aborted with their roles restored (and tried again later), never
    # a call dropped; no plan failed for another reason
    aborted = [r["error"] for r in records if r["type"] == "plan_aborted"]
    assert all("no routable engine left" in e for e in aborted), aborted
    pubs = [r for r in records if r["type"] == "weights_published"]
    assert [p["version"] for p in pubs] == [2, 4]
    # every engine is on another node than the driver: the bucketed broadcast carries each
    # version there (Ray's object store only as its fallback; never the driver's shm or file)
    assert all(
        p["transports"] and set(p["transports"].values()) <= {"broadcast", "object"} for p in pubs
    ), pubs
    assert any("broadcast" in p["transports"].values() for p in pubs), pubs
    # calls drained mid-call kept their KV across nodes: every engine is on its own node, so
    # each handoff carried its export to another node's folder (a gloo broadcast between the
    # two servers), and the destination's scheduler loaded it instead of prefilling: tidal's
    # accounting (from that scheduler's acknowledgement) finds 0 re-prefilled tokens in every
    # handed-off call, and the destinations' own counters show tokens loaded from outside
    calls = [
        c
        for line in (out / "executions.jsonl").read_text().splitlines()
        for c in json.loads(line)["calls"]
    ]
    handed = [c for c in calls if len(c["engines"]) > 1 and c["cached_tokens"] > 0]
    loaded = sum(c.get("external_kv_transfer", 0.0) for c in kv_seen.values())
    print(json.dumps({"handed_off_calls": handed, "external_kv_transfer": loaded}))
    assert s["kv_handoffs"] > 0 and s["kv_handoff_failures"] == 0, s
    assert handed and all(c["reprefill_tokens"] == 0 for c in handed), handed
    assert all(len({placed[e][0] for e in c["engines"]}) > 1 for c in handed), handed
    assert loaded > 0, kv_seen
    assert end_log_writers(out) == 0  # no process of the run outlived it, on any node
