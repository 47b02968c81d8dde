"""Killing a cell actor in the middle of a burst, while its engine serves live requests, and
then the standalone engine's process under its live actor: the supervisor replaces both (new
actor, new engine with the current weights, same proxy id and role), the proxy retries the
lost requests elsewhere, and the run completes with no failed request and no execution lost
or trained twice."""

from __future__ import annotations

import json
import threading
import time

from tidal.config import load_yaml
from tidal.runtime.driver import Runtime
from tidal.runtime.engines import EngineId

from .busy import wait_until_busy
from .test_tiny_run import CONFIG


def _kill_when_busy(runtime: Runtime, name: str, seen: dict, deadline_s: float = 120.0):
    import ray

    listed = wait_until_busy(runtime, name, deadline_s)
    if listed is None:
        return
    seen["inflight_at_kill"] = next(e["inflight"] for e in listed if e["id"] == name)
    ray.kill(runtime.engines.actors[EngineId.parse(name)], no_restart=True)
    time.sleep(0.5)
    # and an engine process under a live actor (the standalone engine)
    ray.get(runtime.engines.actors[EngineId("s", 0)].kill_engine.remote(), timeout=30)


def test_a_killed_cell_actor_is_replaced_and_nothing_is_lost(tmp_path):
    runtime = Runtime(load_yaml(CONFIG), tmp_path / "run")
    seen: dict = {}
    killer = threading.Thread(target=_kill_when_busy, args=(runtime, "c1", seen), daemon=True)
    killer.start()
    summary = runtime.run()
    killer.join(5)
    print(
        json.dumps(
            {
                k: summary[k]
                for k in ("run_time_s", "cells_replaced", "rerouted_requests", "engine_failures")
            }
        )
    )

    assert seen.get("inflight_at_kill", 0) > 0
    assert summary["cells_replaced"] == ["c1", "s0"]
    assert summary["engines"]["c1"]["restarted"] and summary["engines"]["s0"]["restarted"]
    assert summary["engines"]["s0"]["version"] == "v4"  # the replacement got the weights
    assert summary["rerouted_requests"] >= seen["inflight_at_kill"]
    assert summary["failed_requests"] == 0 and summary["timed_out_executions"] == 0
    assert summary["lost_executions"] == 0 and summary["record_errors"] == []
    assert summary["dispatched"] == summary["closed"] == summary["trained_executions"] == 48
    assert summary["duplicate_closes"] == 0 and summary["trainer_steps"] == 4
