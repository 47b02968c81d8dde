"""``trace.json`` (Chrome trace-event format, for Perfetto) of a real run directory and of a real
simulation, checked against the format by ``tidal.viz.trace_format``."""

import json

import pytest

from tidal.cli import main
from tidal.rundir import read_jsonl
from tidal.viz import trace_format


def _events(path, ph=None, cat=None):
    evs = json.loads(path.read_text())["traceEvents"]
    return [
        e for e in evs if (ph is None or e["ph"] == ph) and (cat is None or e.get("cat") == cat)
    ]


@pytest.mark.parametrize("name", ["tiny-calibration", "tiny-waterlevel", "tiny-static"])
def test_report_writes_a_valid_trace_showing_every_move(run_copy, name):
    run = run_copy(name)
    assert main(["report", str(run)]) == 0
    path = run / "trace.json"
    assert trace_format.validate(json.loads(path.read_text())) == []
    decisions = read_jsonl(run / "decisions.jsonl")
    started = {d["plan_id"] for d in decisions if d["type"] == "plan_start"}
    moves = _events(path, "X", "move")
    assert {int(e["name"].split()[1]) for e in moves} == started  # every move, once
    steps = read_jsonl(run / "steps.jsonl")
    assert len(_events(path, "X", "step")) == len(steps)
    for mv in moves:  # each move holds its own steps, in order
        plan = int(mv["name"].split()[1])
        inside = [
            s["name"]
            for s in _events(path, "X", "step")
            if mv["ts"] <= s["ts"] and s["ts"] + s["dur"] <= mv["ts"] + mv["dur"] + 1e-3
        ]
        want = [s["step"] for s in steps if s["plan_id"] == plan]
        assert sorted(inside) == sorted(want)
    metrics = read_jsonl(run / "metrics.jsonl")
    trainer = _events(path, "X", "trainer")
    assert [e["args"]["step"] for e in trainer] == [m["step"] for m in metrics]
    # the cell tracks' role spans reach the end of the run's timeline
    timeline = json.loads((run / "timeline.json").read_text())["cells"]
    roles = _events(path, "X", "role")
    for tid, segs in enumerate(timeline):
        ends = [e["ts"] + e["dur"] for e in roles if e["tid"] == tid]
        assert max(ends) == pytest.approx(segs[-1][1] * 1e6, abs=1.0)
    assert "trace.json" in (run / "report.md").read_text()
    # the executions counter: one sample per state.jsonl line, with the rollout capacity
    counters = _events(path, "C")
    assert len(counters) == len(read_jsonl(run / "state.jsonl"))
    assert all({"waterlevel", "running", "queued", "capacity"} <= set(c["args"]) for c in counters)


def test_reroutes_are_flow_arrows_between_engine_tracks(run_copy):
    run = run_copy("tiny-calibration")
    assert main(["report", str(run)]) == 0
    execs = read_jsonl(run / "executions.jsonl")
    moved = sum(len(c["engines"]) - 1 for e in execs for c in e["calls"])
    starts = _events(run / "trace.json", "s")
    ends = _events(run / "trace.json", "f")
    assert moved > 0 and len(starts) == len(ends) == moved
    for s in starts:  # c0 -> its cell track; s0 -> the standalone track
        f = next(f for f in ends if f["id"] == s["id"])
        assert s["tid"] != f["tid"]


def test_simulation_trace_is_valid_with_a_process_per_policy(tmp_path):
    out = tmp_path / "sim"
    assert (
        main(
            [
                "simulate",
                "dapo-math-32gpu",
                "--bursts",
                "2",
                "-p",
                "tidal",
                "-p",
                "verl-default",
                "--out",
                str(out),
                "--no-plots",
            ]
        )
        == 0
    )
    trace = json.loads((out / "trace.json").read_text())
    assert trace_format.validate(trace) == []
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {"simulate tidal", "simulate verl-default"}
    summary = json.loads((out / "summary.json").read_text())
    arrows = 0
    for pid, run in enumerate(summary["runs"], start=1):
        evs = [e for e in trace["traceEvents"] if e["pid"] == pid]
        moves = [e for e in evs if e.get("cat") == "move"]
        assert len(moves) == run["switches"] + run["plans_aborted"]
        assert all(e["args"]["outcome"] == "done" for e in moves) or run["plans_aborted"]
        assert len([e for e in evs if e.get("cat") == "trainer"]) == run["trainer_steps"]
        # a move to nowhere (parked until an engine frees a slot) draws no arrow
        n = len([e for e in evs if e["ph"] == "s"])
        assert n <= run["reroutes"]
        arrows += n
        assert [e for e in evs if e.get("cat") == "weights"]
        assert [e for e in evs if e["ph"] == "C" and "capacity" in e["args"]]
    assert arrows > 0


@pytest.mark.parametrize(
    ("trace", "problem"),
    [
        ({"traceEvents": [{"ph": "Q", "name": "a", "pid": 1, "tid": 1, "ts": 0}]}, "phase"),
        ({"traceEvents": [{"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 0}]}, "dur"),
        (
            {
                "traceEvents": [
                    {"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 5, "dur": 1},
                    {"ph": "X", "name": "b", "pid": 1, "tid": 1, "ts": 2, "dur": 1},
                ]
            },
            "monotonic",
        ),
        (
            {
                "traceEvents": [
                    {"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 0, "dur": 5},
                    {"ph": "X", "name": "b", "pid": 1, "tid": 1, "ts": 3, "dur": 5},
                ]
            },
            "nest",
        ),
        (
            {
                "traceEvents": [
                    {"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 0, "dur": 5},
                    {"ph": "s", "name": "r", "cat": "c", "id": 1, "pid": 1, "tid": 1, "ts": 1},
                ]
            },
            "one of each",
        ),
        (
            {
                "traceEvents": [
                    {"ph": "s", "name": "r", "cat": "c", "id": 1, "pid": 1, "tid": 1, "ts": 1},
                    {"ph": "f", "name": "r", "cat": "c", "id": 1, "pid": 1, "tid": 2, "ts": 2},
                ]
            },
            "no slice",
        ),
        ({"traceEvents": [{"ph": "s", "name": "r", "pid": 1, "tid": 1, "ts": 1}]}, "cat"),
        ({"traceEvents": [{"ph": "M", "name": "thread_name", "pid": 1, "tid": 1}]}, "args.name"),
        ({"traceEvents": [{"ph": "B", "name": "a", "pid": 1, "tid": 1, "ts": 1}]}, "never ended"),
        ({"traceEvents": [], "displayTimeUnit": "s"}, "displayTimeUnit"),
    ],
)
def test_the_validator_refuses_what_the_format_forbids(trace, problem):
    problems = trace_format.validate(trace)
    assert problems and problem in " ".join(problems)
