"""``tidal run configs/tiny.yaml`` end to end on local Ray under the waterlevel policy: real
engine processes owned by cell actors, the proxy, the harness pool, the core trainer.

Checks the slice of issue 6 that exists: cells move both ways through real plan steps, the
core's drain moves live requests to other engines and every one is answered (no failed
request), every dispatched execution reaches the trainer (none lost), each burst's new weight
version is loaded by the engines in place (no restart), and the run directory is complete.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from tidal.cli import main
from tidal.viz.trace_format import validate

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml"


def expected_groups(cfg: dict) -> list[str]:
    """Every group an uninterrupted run of ``cfg`` trains: all groups of all bursts."""
    c = cfg["control"]
    per_burst = c.get("quota_groups") or c["batch_groups"] * c["updates_per_burst"]
    return sorted(f"b{b}-g{g}" for b in range(c["bursts"]) for g in range(per_burst))


# one rank per cell trains the plain model by default (FSDP2 would shard nothing); 'on' runs
# the same job on one-rank FSDP2 cells, so the sharded path stays covered end to end, and with
# two proxy processes (executions partitioned by id; the drains reach both: no failed request)
@pytest.mark.parametrize("fsdp", ["auto", "on"])
def test_tiny_waterlevel_run_moves_cells_and_loses_nothing(tmp_path, caplog, capsys, fsdp):
    out = tmp_path / "run"
    proxies = 2 if fsdp == "on" else 1
    args = ["--set", f"runtime.fsdp={fsdp}", "--set", f"runtime.proxy_processes={proxies}"]
    with caplog.at_level(logging.WARNING):
        assert main(["run", str(CONFIG), "--out", str(out), *args]) == 0
    # a run where nothing went wrong warns about nothing (satellite departures are INFO)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    printed = capsys.readouterr().out.splitlines()
    assert "warnings: none" in printed and printed[-1].startswith(f"report: {out / 'report.md'}")
    assert any(" 100% ETA 0:00:00" in x for x in printed)  # the final progress line
    summary = json.loads((out / "summary.json").read_text())
    assert not (out / "spill").exists()  # asleep engines' weights gone with the run (issue 29)

    assert summary["policy"] == "waterlevel"
    plane = summary["control_plane"]  # the control plane's own costs (docs/scale.md)
    assert plane["proxy"]["processes"] == proxies and plane["proxy"]["calls"] > 0
    assert plane["proxy"]["cpu_ms_per_call"] > 0 and plane["controller_decision"]["n"] > 0
    assert plane["driver"]["loop_lag"]["n"] > 0 and plane["memory"]["peak_open_executions"] > 0
    assert summary["switches_to_training"] >= 1 and summary["switches_to_rollout"] >= 1
    assert summary["plans_aborted"] == 0
    # Whether the core still holds a live request when it leaves rollout is a race at this
    # toy scale (most runs drain 2-6; CI once saw 0), so the count is not asserted here; nor
    # is rerouted >= drained: a drained request that finishes at the source before its cancel
    # lands needs no retry. Every one was answered (no failed request, below). Drains of live
    # requests are asserted deterministically in tests/integration/serving/test_soak.py.
    assert summary["failed_requests"] == 0 and summary["timed_out_executions"] == 0
    assert summary["lost_executions"] == 0 and summary["record_errors"] == []
    assert summary["dispatched"] == summary["closed"] == summary["trained_executions"] == 48
    assert summary["duplicate_closes"] == 0 and summary["ledger_waterlevel_end"] == 0
    assert summary["trainer_steps"] == 4 and summary["version"] == 4
    for name, engine in summary["engines"].items():
        assert not engine["restarted"], name
        if engine["state"] == "awake":
            assert engine["version"] == "v4", (name, engine)

    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    trained = [g for m in metrics for g in m["groups"]]  # each group once, all of them
    assert sorted(trained) == expected_groups(yaml.safe_load(CONFIG.read_text()))
    assert (out / "timeline.json").is_file()
    # a successful run keeps only what was asked for (runtime.keep_checkpoints / keep_weights
    # default 0): no checkpoint, no published weights
    assert not list(out.glob("checkpoint*")) and not (out / "weights").exists()
    assert all(m["max_staleness"] <= 2 for m in metrics)
    records = [json.loads(x) for x in (out / "decisions.jsonl").read_text().splitlines()]
    done = [r for r in records if r["type"] == "plan_done"]
    assert len(done) == summary["switches_to_training"] + summary["switches_to_rollout"]
    moves = [r for r in records if r["type"] == "decision" and r["action"] == "to_training"]
    # invariant 3 as the decision saw it: capacity after the move covered the waterlevel
    for r in moves:
        cell = r["cells"][0]
        assert r["inputs"]["capacity"] - 4 >= r["inputs"]["waterlevel"], (cell, r)
    steps = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    assert steps and all(s["ok"] for s in steps)
    # one clock: decisions count from the first dispatch, as metrics.jsonl does
    assert datetime.fromisoformat(summary["t0_utc"]).tzinfo is not None
    assert all(-1.0 <= r["t"] <= summary["run_time_s"] for r in records)
    # trace.json (Perfetto) passes the format and shows every move with its steps
    trace = json.loads((out / "trace.json").read_text())
    assert validate(trace) == []
    moves = [e for e in trace["traceEvents"] if e.get("cat") == "move"]
    assert len(moves) == len([r for r in records if r["type"] == "plan_start"]) == len(done)
    assert len([e for e in trace["traceEvents"] if e.get("cat") == "step"]) == len(steps)
    assert (out / "config.yaml").is_file()
    # peak memory per process (issue 25): every part of the run sampled, named by its role
    mem = summary["memory"]
    print("memory:", json.dumps(mem))
    assert {"driver", "proxy", "engine-s0", "engine-c0", "engine-c1", "satellite-c1"} <= set(
        mem["processes_mb"]
    ), mem["processes_mb"]
    assert any(k.startswith("ray-") for k in mem["processes_mb"])
    # every part of the run is a real process of some size (a short-lived helper the sampler
    # caught exiting, e.g. ldconfig at 0 MB, is not a part of the run)
    roles = ("driver", "proxy", "engine-", "satellite-", "ray-actor-")
    parts = {k: v for k, v in mem["processes_mb"].items() if k.startswith(roles)}
    assert all(v > 10 for v in parts.values()), mem["processes_mb"]
    assert mem["machine_peak_mb"] >= mem["machine_baseline_mb"] and mem["samples"] > 10
    # the satellite lives for the run: started once, parked between its cell's stints
    assert summary["satellite_starts"] == 1 and mem["processes_started"] == {}
