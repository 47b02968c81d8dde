"""The numbers behind waterlevel.png, utilization.png and reward.png, on copies of real runs."""

import json
import statistics

import pytest

from tidal.rundir import load_run
from tidal.viz.run_figures import capacity_at, rollout_capacity, step_rewards, step_utilization
from tidal.viz.run_report import write_report


def test_rollout_capacity_counts_the_slots_of_cells_in_rollout(run_copy):
    run = load_run(run_copy("tiny-waterlevel"))  # 1 standalone + 2 cells, 4 slots each
    cap = rollout_capacity(run)
    assert capacity_at(cap, 0.0) == 12  # everything serves at the first dispatch
    start, end, _ = next(s for s in run.timeline[0] if s[2] == "training")
    mid = (start + end) / 2
    cell1 = next(r for a, b, r in run.timeline[1] if a <= mid < b)
    assert capacity_at(cap, mid) == 4 + (4 if cell1 == "rollout" else 0)


def test_utilisation_per_step_from_compute_time_and_busy_slots(run_copy):
    run = load_run(run_copy("tiny-calibration"))
    rows = step_utilization(run)
    assert [r["step"] for r in rows] == [m["step"] for m in run.metrics]
    m0 = run.metrics[0]
    assert rows[0]["start_s"] == 0.0
    busy = m0.get("compute_s", m0["step_s"])
    assert rows[0]["train"] == pytest.approx(busy / m0["t"])
    cap = rollout_capacity(run)
    samples = [s for s in run.states if 0.0 < s["t"] <= m0["t"]]
    assert rows[0]["rollout"] == pytest.approx(
        sum(s["running"] / capacity_at(cap, s["t"]) for s in samples) / len(samples)
    )
    assert all(0.0 <= r["train"] <= 1.0 for r in rows)


def test_reward_spread_per_step_over_its_groups_executions(run_copy):
    path = run_copy("tiny-calibration")
    lines = [json.loads(x) for x in (path / "executions.jsonl").read_text().splitlines()]
    for i, e in enumerate(lines):
        e["reward"] = float(i % 3 == 0)
    (path / "executions.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    run = load_run(path)
    rows = step_rewards(run)
    first = run.metrics[0]
    want = [e["reward"] for e in lines if e["group"] in first["groups"]]
    assert rows[0][0] == 0 and rows[0][3] == len(want) == 4 * len(first["groups"])
    assert rows[0][2] == pytest.approx(statistics.stdev(want))
    write_report(path)
    mean, se, n = run.reward_noise()
    assert (
        f"| mean reward over GRPO groups | {mean:.3f} ± {se:.3f} (standard error over {n} "
        in (path / "report.md").read_text()
    )
