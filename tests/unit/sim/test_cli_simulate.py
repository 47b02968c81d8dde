"""``tidal simulate`` and ``tidal demo`` end to end (small runs)."""

import json

from tidal.cli import main
from tidal.sim.scenario import available, resolve

FIELDS = (
    "policy",
    "makespan_s",
    "oracle_makespan_s",
    "train_utilization",
    "rollout_utilization",
    "cluster_utilization",
    "switches",
    "reroutes",
    "queued_executions",
    "queued_execution_s",
    "queued_execution_p99_s",
    "queued_execution_max_s",
    "rollout_floor_s",
)


def test_shipped_scenarios_are_found_by_name():
    assert {"dapo-math-32gpu", "swe-agent-long-tail", "mixed"} <= set(available())
    assert resolve("mixed").name == "mixed.yaml"


def test_simulate_writes_summary_decisions_and_plots(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(
        [
            "simulate",
            "dapo-math-32gpu",
            "--bursts",
            "2",
            "-p",
            "static:train=16",
            "-p",
            "verl-default",
            "-p",
            "tidal",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "makespan" in text and "speed-up" in text and "verl-default" in text
    assert "floor h" in text and "vs best" in text and "queued s" in text
    summary = json.loads((out / "summary.json").read_text())
    assert [r["policy"] for r in summary["runs"]] == ["static:train=16", "verl-default", "tidal"]
    for run in summary["runs"]:
        for f in FIELDS:
            assert f in run
        assert run["makespan_s"] >= run["oracle_makespan_s"]
        # training ~free leaves the rollout side: never slower than the run itself
        assert run["rollout_floor_s"] <= run["makespan_s"] * 1.001
    lines = [json.loads(x) for x in (out / "decisions.jsonl").read_text().splitlines()]
    assert {x["run"] for x in lines} == {"static:train=16", "verl-default", "tidal"}
    for png in ("roles.png", "waterlevel.png", "utilization.png"):
        assert (out / png).stat().st_size > 1000


def test_simulate_replays_a_trace(tmp_path, capsys):
    from tidal.sim.scenario import ExecutionClass
    from tidal.sim.workloads import ClassWorkload, write_trace

    trace = tmp_path / "t.jsonl"
    write_trace(trace, [ClassWorkload([ExecutionClass()], 1).group(8) for _ in range(20)])
    rc = main(
        [
            "simulate",
            "dapo-math-32gpu",
            "--bursts",
            "1",
            "-p",
            "tidal",
            "--trace",
            str(trace),
            "--no-plots",
        ]
    )
    assert rc == 0 and "tidal" in capsys.readouterr().out


def test_bad_policy_and_unknown_scenario_are_one_line_errors(capsys):
    assert main(["simulate", "dapo-math-32gpu", "-p", "nope"]) == 2
    assert "unknown policy" in capsys.readouterr().err
    assert main(["simulate", "no-such-scenario"]) == 2
    assert "unknown scenario" in capsys.readouterr().err


def test_demo_runs(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path / "demo")]) == 0
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert len(summary["runs"]) == 6


def test_simulate_runs_every_policy_with_the_mechanics_asked(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(
        [
            "simulate",
            "dapo-math-32gpu",
            "--bursts",
            "1",
            "-p",
            "static:train=16",
            "-p",
            "verl-default",
            "--mechanics",
            "tidal",
            "--no-plots",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    assert "demand/stream/keep/kv" in capsys.readouterr().out
    runs = json.loads((out / "summary.json").read_text())["runs"]
    assert {r["profile"]["trainer"] for r in runs} == {"streaming"}
    assert {r["profile"]["kv_handoff"] for r in runs} == {True}


def test_simulate_sweeps_static_splits_as_the_baseline(tmp_path, capsys):
    out = tmp_path / "sweep"
    rc = main(
        [
            "simulate",
            "dapo-math-32gpu",
            "--bursts",
            "2",
            "--sweep",
            "static",
            "--admission",
            "saturation",
            "-p",
            "tidal",
            "--out",
            str(out),
            "--no-plots",
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "static splits" in text and "baseline" in text and "(best)" in text
    summary = json.loads((out / "summary.json").read_text())
    best = summary["best_static"]
    assert best["spec"] in ("static:cells=1", "static:cells=2")
    assert best["split"] in ("8+24", "16+16") and best["makespan_s"] > 0
    assert main(["simulate", "dapo-math-32gpu", "--admission", "sometimes"]) == 2
    assert "control.admission" in capsys.readouterr().err


def test_calibrate_fits_a_verl_log_and_compares_policies(tmp_path, capsys):
    from tidal.testing.verl_logs import verl_rows, write_verl_log

    log = write_verl_log(tmp_path / "verl.jsonl", verl_rows(steps=4, seed=2))
    out = tmp_path / "fitted.yaml"
    rc = main(
        ["calibrate", "--verl-log", str(log), "--group-size", "8", "--out", str(out), "--compare"]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "samples_per_step" in text and "baseline" in text and "(best)" in text
    assert "colocate" in text
    assert "batch_groups: 16" in out.read_text()
    assert main(["calibrate", "--verl-log", str(log)]) == 2
    assert "--group-size" in capsys.readouterr().err
