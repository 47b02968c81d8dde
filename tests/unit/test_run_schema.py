"""The run directory's schema (``tidal.contracts.run_files``): every file of the fixture runs
conforms; a wrong value is one ``ConfigError`` naming file, line and field, for the reader of
``tidal report`` and for the one of ``tidal calibrate`` alike; close reasons come from one place."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tidal.contracts import run_files as schema
from tidal.errors import ConfigError
from tidal.rundir import load_run, read_jsonl, read_lines
from tidal.sim.from_run import scenario_from_run
from tidal.types import CloseReason

RUNS = Path(__file__).resolve().parents[1] / "fixtures" / "runs"
FILES = {
    "metrics.jsonl": schema.MetricsLine,
    "state.jsonl": schema.StateLine,
    "steps.jsonl": schema.StepLine,
    "executions.jsonl": schema.ExecutionLine,
    "decisions.jsonl": schema.DecisionLine,
}


@pytest.mark.parametrize("run", sorted(p.name for p in RUNS.iterdir()))
def test_every_fixture_run_conforms(run):
    for name, model in FILES.items():
        if (RUNS / run / name).is_file():
            assert read_jsonl(RUNS / run / name, model=model) is not None
    schema.check(schema.Timeline, json.loads((RUNS / run / "timeline.json").read_text()), run)
    schema.check(schema.Summary, json.loads((RUNS / run / "summary.json").read_text()), run)


def test_a_wrong_value_names_file_line_and_field(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(RUNS / "tiny-calibration", run)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    bad = json.loads(lines[1])
    bad["roles"] = "training rollout"  # a string where a list of roles belongs
    lines[1] = json.dumps(bad)
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=r"metrics\.jsonl:2: field roles") as info:
        load_run(run)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=r"metrics\.jsonl:2: field roles"):
        scenario_from_run(run)  # tidal calibrate reads through the same schema

    shutil.copy(RUNS / "tiny-calibration" / "metrics.jsonl", run / "metrics.jsonl")
    execs = (run / "executions.jsonl").read_text().splitlines()
    row = json.loads(execs[0])
    row["reason"] = "exploded"
    (run / "executions.jsonl").write_text("\n".join([json.dumps(row), *execs[1:]]) + "\n")
    with pytest.raises(ConfigError, match=r"executions\.jsonl:1: field reason: 'exploded'"):
        scenario_from_run(run)


def test_execution_readers_hold_models_and_a_missing_reward_is_refused(tmp_path):
    """Every reader of ``executions.jsonl`` (report, trace, reward plot, calibrate) holds
    ``ExecutionLine`` models; a line without its reward is an error naming it, never 0.0."""
    from tidal.viz.run_figures import step_rewards
    from tidal.viz.trace_sources import from_run_dir as from_run

    run = tmp_path / "run"
    shutil.copytree(RUNS / "tiny-calibration", run)
    rows = read_lines(run / "executions.jsonl", schema.ExecutionLine)
    assert rows and all(isinstance(r, schema.ExecutionLine) for r in rows)
    assert all(isinstance(c, schema.CallLine) for r in rows for c in r.calls)
    assert read_lines(run / "absent.jsonl", schema.ExecutionLine) is None
    before = step_rewards(load_run(run))
    assert before and all(n > 0 for *_, n in before)
    from_run(run)  # the trace's reroutes read the same models

    execs = (run / "executions.jsonl").read_text().splitlines()
    row = json.loads(execs[1])
    del row["reward"]
    (run / "executions.jsonl").write_text("\n".join([execs[0], json.dumps(row), *execs[2:]]) + "\n")
    for read in (load_run, lambda r: step_rewards(load_run(r)), from_run, scenario_from_run):
        with pytest.raises(
            ConfigError,
            match=r"executions\.jsonl:2: field reward: Field "
            r"required",
        ):
            read(run)


def test_close_reasons_are_the_ledgers():
    """The run directory's close reasons are the ones the ledger and the proxy's registry
    accept: one enum (``tidal.contracts.close``), not a copy of it."""
    from tidal.serving import executions

    assert schema.ExecutionLine.model_fields["reason"].annotation is CloseReason
    assert tuple(r.value for r in CloseReason) == executions.CLOSE_REASONS
