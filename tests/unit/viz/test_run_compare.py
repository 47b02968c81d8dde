"""``compare_runs`` and ``tidal report`` on copies of real static and waterlevel runs."""

import json

import pytest
import yaml
from click.testing import CliRunner

from tidal.cli import cli, main
from tidal.errors import ConfigError
from tidal.viz.run_compare import compare_runs


def summary(run):
    return json.loads((run / "summary.json").read_text())


def test_compare_writes_plot_markdown_json_with_the_right_ratio(run_copy, tmp_path):
    static, elastic = run_copy("tiny-static"), run_copy("tiny-waterlevel")
    s, w = summary(static), summary(elastic)
    comp = compare_runs([static, elastic], tmp_path / "cmp")
    assert [p.name for p in comp.files] == ["reward_compare.png", "compare.md", "compare.json"]
    assert (tmp_path / "cmp" / "reward_compare.png").stat().st_size > 5000
    assert [r["label"] for r in comp.rows] == ["static", "waterlevel"]
    (pair,) = comp.ratios
    assert (pair["numerator"], pair["denominator"]) == ("static", "waterlevel")
    assert pair["run_time_s"] == pytest.approx(s["run_time_s"] / w["run_time_s"])
    assert pair["bursts_s"] == pytest.approx(s["bursts_s"] / w["bursts_s"])
    data = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert data["ratios"][0]["bursts_s"] == pytest.approx(s["bursts_s"] / w["bursts_s"])
    assert data["rows"][1]["switches_to_training"] == w["switches_to_training"]
    assert data["rows"][1]["rerouted_requests"] == w["rerouted_requests"]
    assert data["notes"] == []  # same config apart from the policy
    text = (tmp_path / "cmp" / "compare.md").read_text()
    assert (
        f"| static / waterlevel | {s['run_time_s'] / w['run_time_s']:.3f} | "
        f"{s['bursts_s'] / w['bursts_s']:.3f} |"
    ) in text
    vs = w["run_time_s"] / s["run_time_s"], w["bursts_s"] / s["bursts_s"]
    assert (
        f"| waterlevel | {w['run_time_s']:.2f} | {w['bursts_s']:.2f} | {vs[0]:.3f} | "
        f"{vs[1]:.3f} | 4 |"
    ) in text
    assert "](reward_compare.png)" in text


def test_ratio_follows_the_order_given_and_three_runs_give_three_pairs(run_copy, tmp_path):
    static, elastic = run_copy("tiny-static"), run_copy("tiny-waterlevel")
    other = run_copy("tiny-static", "static-again")
    back = compare_runs([elastic, static], tmp_path / "a")
    fwd = compare_runs([static, elastic], tmp_path / "b")
    assert back.ratios[0]["run_time_s"] == pytest.approx(1 / fwd.ratios[0]["run_time_s"])
    three = compare_runs([static, elastic, other], tmp_path / "c")
    assert [(p["numerator"], p["denominator"]) for p in three.ratios] == [
        ("static (tiny-static)", "waterlevel"),
        ("static (tiny-static)", "static (static-again)"),
        ("waterlevel", "static (static-again)"),
    ]
    assert three.ratios[1]["run_time_s"] == pytest.approx(1.0)
    # each run against the best of the others: the two statics are each other's best
    times = [summary(d)["bursts_s"] for d in (static, elastic, other)]
    for i, row in enumerate(three.rows):
        best = min(t for j, t in enumerate(times) if j != i)
        assert row["bursts_s_vs_best_other"] == pytest.approx(times[i] / best)
    assert min(r["run_time_s_vs_best_other"] for r in three.rows) <= 1.0


def test_reward_quarters_per_run(run_copy, tmp_path):
    static, elastic = run_copy("tiny-static"), run_copy("tiny-waterlevel")
    lines = [json.loads(x) for x in (elastic / "metrics.jsonl").read_text().splitlines()]
    for m, r in zip(lines, (0.25, 0.5, 0.5, 0.75), strict=True):
        m["mean_reward"] = r
    (elastic / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    comp = compare_runs([static, elastic], tmp_path / "cmp")
    assert (comp.rows[0]["reward_first_quarter"], comp.rows[0]["reward_last_quarter"]) == (0, 0)
    assert (comp.rows[1]["reward_first_quarter"], comp.rows[1]["reward_last_quarter"]) == (
        0.25,
        0.75,
    )


def test_configs_that_differ_beyond_the_policy_are_noted(run_copy, tmp_path):
    static, elastic = run_copy("tiny-static"), run_copy("tiny-waterlevel")
    cfg = yaml.safe_load((elastic / "config.yaml").read_text())
    cfg["control"]["bursts"] = 3
    (elastic / "config.yaml").write_text(yaml.safe_dump(cfg))
    comp = compare_runs([static, elastic], tmp_path / "cmp")
    assert comp.notes == [
        "tiny-waterlevel differs from tiny-static beyond the policy: control.bursts"
    ]
    assert "control.bursts" in (tmp_path / "cmp" / "compare.md").read_text()


def test_compare_rejects_one_run_the_same_run_twice_and_bad_dirs(run_copy, tmp_path):
    static = run_copy("tiny-static")
    with pytest.raises(ConfigError, match="at least two runs"):
        compare_runs([static], tmp_path / "cmp")
    with pytest.raises(ConfigError, match="the same run given twice"):
        compare_runs([static, tmp_path / "tiny-static"], tmp_path / "cmp")
    with pytest.raises(ConfigError, match=r"no summary\.json"):
        compare_runs([static, tmp_path], tmp_path / "cmp")
    assert not (tmp_path / "cmp").exists()


def test_cli_report_one_run(run_copy):
    run = run_copy("tiny-waterlevel")
    result = CliRunner().invoke(cli, ["report", str(run)])
    assert result.exit_code == 0, result.output
    assert (
        "roles.png, reward.png, waterlevel.png, utilization.png, trace.json, report.md"
        in result.output
    )
    assert (run / "report.md").is_file()


def test_cli_report_compares_into_the_default_and_a_given_dir(run_copy, tmp_path):
    static, elastic = run_copy("tiny-static"), run_copy("tiny-waterlevel")
    s, w = summary(static), summary(elastic)
    result = CliRunner().invoke(cli, ["report", str(static), str(elastic)])
    assert result.exit_code == 0, result.output
    assert "static / waterlevel" in result.output
    assert f"{s['bursts_s'] / w['bursts_s']:.3f}" in result.output
    assert (tmp_path / "compare" / "compare.json").is_file()  # the first run's parent
    for run in (static, elastic):
        assert (run / "report.md").is_file()
    result = CliRunner().invoke(
        cli, ["report", str(static), str(elastic), "--out", str(tmp_path / "elsewhere")]
    )
    assert result.exit_code == 0, result.output
    assert (tmp_path / "elsewhere" / "reward_compare.png").stat().st_size > 5000


def test_cli_errors_are_one_line(run_copy, tmp_path, capsys):
    static = run_copy("tiny-static")
    assert main(["report", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"tidal: error: {tmp_path / 'missing'}: no such run directory"
    # a bad second directory: nothing is written for the good first one either
    assert main(["report", str(static), str(tmp_path)]) == 2
    assert "no summary.json" in capsys.readouterr().err
    assert not (static / "report.md").exists()
    assert main(["report", str(static), "--out", str(tmp_path / "x")]) == 2
    assert "two or more runs" in capsys.readouterr().err


def _write_executions(run, rewards_by_group):
    lines = [
        {
            "execution": f"{g}-e{i}",
            "group": g,
            "burst": 0,
            "reason": "completed",
            "reward": r,
            "calls": [],
        }
        for g, rs in rewards_by_group.items()
        for i, r in enumerate(rs)
    ]
    (run / "executions.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_reward_noise_is_the_standard_error_over_groups_and_pairs_get_z(run_copy, tmp_path):
    static, elastic = run_copy("tiny-static"), run_copy("tiny-waterlevel")
    # group means 0.25, 0.5, 0.75: mean 0.5, sd 0.25, se 0.25 / sqrt(3)
    _write_executions(static, {"b0-g0": [0.0, 0.5], "b0-g1": [0.5, 0.5], "b0-g2": [1.0, 0.5]})
    _write_executions(elastic, {"b0-g0": [0.5, 0.5], "b0-g1": [0.5, 0.5], "b0-g2": [0.5, 0.5]})
    comp = compare_runs([static, elastic], tmp_path / "cmp")
    se = 0.25 / 3**0.5
    assert comp.rows[0]["reward_mean"] == pytest.approx(0.5)
    assert comp.rows[0]["reward_se"] == pytest.approx(se)
    assert comp.rows[0]["reward_groups"] == 3
    assert comp.rows[1]["reward_se"] == 0.0
    (pair,) = comp.ratios
    assert pair["reward_diff"] == pytest.approx(0.0) and pair["reward_z"] == pytest.approx(0.0)
    _write_executions(elastic, {"b0-g0": [1.0, 1.0], "b0-g1": [1.0, 1.0]})
    pair = compare_runs([static, elastic], tmp_path / "cmp2").ratios[0]
    assert pair["reward_diff"] == pytest.approx(-0.5)
    assert pair["reward_z"] == pytest.approx(-0.5 / se)
    text = (tmp_path / "cmp2" / "compare.md").read_text()
    assert f"| 0.500 ± {se:.3f} |" in text and f"-0.500 (z {-0.5 / se:+.2f})" in text


def test_runs_without_executions_have_no_reward_noise_and_bad_lines_are_one_error(
    run_copy, tmp_path
):
    static, elastic = run_copy("tiny-static"), run_copy("tiny-waterlevel")
    comp = compare_runs([static, elastic], tmp_path / "cmp")
    assert comp.rows[0]["reward_mean"] is None and comp.ratios[0]["reward_z"] is None
    assert "| – |" in (tmp_path / "cmp" / "compare.md").read_text()
    (elastic / "executions.jsonl").write_text('{"group": "g", "reward": "high"}\n')
    with pytest.raises(ConfigError, match=r"executions\.jsonl:1"):
        compare_runs([static, elastic], tmp_path / "cmp3")


def test_reward_change_compares_the_groups_of_the_first_and_last_quarter(tmp_path):
    from tidal.rundir import RunData

    steps = [
        ["a", "b"],
        ["c", "d"],
        ["e", "f"],
        ["g", "h"],
        ["i", "j"],
        ["k", "l"],
        ["m", "n"],
        ["o", "p"],
    ]
    rewards = dict(
        zip(
            "abcdefghijklmnop", [0.1, 0.3, 0.2, 0.2] + [0.5] * 8 + [0.6, 0.8, 0.7, 0.7], strict=True
        )
    )
    metrics = [
        {"t": i, "burst": 0, "step": i, "mean_reward": 0.0, "groups": g}
        for i, g in enumerate(steps)
    ]
    run = RunData(tmp_path, {}, None, metrics, None, None, rewards)
    c = run.reward_change()
    assert c["steps_each"] == 2 and c["first_groups"] == c["last_groups"] == 4
    assert c["first"] == pytest.approx(0.2) and c["last"] == pytest.approx(0.7)
    se = 0.0816496580927726 / 2  # stdev of (0.1, 0.3, 0.2, 0.2) over sqrt(4)
    assert c["first_se"] == pytest.approx(se) and c["last_se"] == pytest.approx(se)
    assert c["change_se"] == pytest.approx(se * 2**0.5)
    assert c["z"] == pytest.approx(0.5 / (se * 2**0.5))
    # without per-step group lists, or one group a quarter, there is no figure (never a 0)
    assert (
        RunData(
            tmp_path, {}, None, [{**m, "groups": None} for m in metrics], None, None, rewards
        ).reward_change()
        is None
    )
    single = [{**m, "groups": m["groups"][:1]} for m in metrics[:4]]
    assert RunData(tmp_path, {}, None, single, None, None, rewards).reward_change() is None
