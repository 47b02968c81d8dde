"""``write_report`` on copies of real ``tidal run`` directories; numbers checked from the files."""

import json

import pytest

from tidal.errors import ConfigError, TidalError
from tidal.rundir import burst_rows, load_run, quarter_means
from tidal.viz.run_report import moving_average, training_cells, write_report

PNGS = ("roles.png", "reward.png", "waterlevel.png", "utilization.png")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def read_jsonl(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def write_jsonl(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


@pytest.mark.parametrize("name", ["tiny-waterlevel", "tiny-static"])
def test_report_writes_four_plots_and_the_markdown(run_copy, name):
    run = run_copy(name)
    files = write_report(run)
    assert [p.name for p in files] == [*PNGS, "trace.json", "report.md"]
    for png in PNGS:
        data = (run / png).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000
    text = (run / "report.md").read_text()
    for png in PNGS:
        assert f"]({png})" in text
    assert "skipped" not in text


def test_report_numbers_come_from_the_files(run_copy):
    run = run_copy("tiny-waterlevel")
    summary = json.loads((run / "summary.json").read_text())
    metrics = read_jsonl(run / "metrics.jsonl")
    write_report(run)
    text = (run / "report.md").read_text()
    assert "policy `waterlevel` · 2 cells × 1 GPU (4 slots) + 1 standalone engine" in text
    assert "model `tiny` · task `arithmetic` · 2 bursts × 2 updates × 3 groups of 4" in text
    assert (
        f"| run time | {summary['run_time_s']:.2f} s (first dispatch to last publication "
        f"{summary['bursts_s']:.2f} s) |" in text
    )
    assert f"| optimizer steps | {len(metrics)} |" in text
    assert (
        f"| switches | {summary['switches_to_training']} to training, "
        f"{summary['switches_to_rollout']} to rollout |"
    ) in text
    assert f"| rerouted requests | {summary['rerouted_requests']} |" in text
    assert f"| failed requests | {summary['failed_requests']} |" in text
    assert f"| lost executions | {summary['lost_executions']} |" in text
    assert "satellite joins" not in text  # this runtime does not write the key yet
    prev = 0.0
    for burst in sorted({m["burst"] for m in metrics}):
        lines = [m for m in metrics if m["burst"] == burst]
        end, final = lines[-1]["t"], lines[-1]
        util = final["dynamic_resource/rollout_resource_utilization"]
        assert (
            f"| {burst} | {len(lines)} | {prev:.2f} | {end:.2f} | {end - prev:.2f} "
            f"| {final['version']} | "
        ) in text
        assert f"| {util:.3f} |" in text
        prev = end


def test_reward_quarters_in_report_and_plot_title(run_copy):
    run = run_copy("tiny-waterlevel")
    metrics = read_jsonl(run / "metrics.jsonl")
    # eight steps (the real four, twice, renumbered) with rewards 0.0 .. 0.7: quarters of 2
    lines = [dict(m) for m in metrics + metrics]
    for i, m in enumerate(lines):
        m.update(step=i, mean_reward=i / 10, burst=i // 2, t=1.0 + i)
    write_jsonl(run / "metrics.jsonl", lines)
    write_report(run)
    text = (run / "report.md").read_text()
    assert "first quarter 0.050, last quarter 0.650 (2 steps each)" in text
    assert load_run(run).rewards() == (list(range(8)), [i / 10 for i in range(8)])


def test_quarter_means_and_moving_average_worked_numbers():
    assert quarter_means([]) == (None, None)
    assert quarter_means([3.0]) == (3.0, 3.0)
    assert quarter_means([1.0, 2.0, 3.0, 5.0]) == (1.0, 5.0)
    assert quarter_means([0, 2, 4, 6, 8, 10, 12, 14, 16]) == (1.0, 15.0)  # q = 9 // 4 = 2
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_burst_rows_cover_the_run_to_the_last_step(run_copy):
    run = load_run(run_copy("tiny-static"))
    rows = burst_rows(run)
    assert [r["burst"] for r in rows] == [0, 1]
    assert rows[0]["start_s"] == 0.0 and rows[1]["start_s"] == rows[0]["end_s"]
    assert rows[-1]["end_s"] == run.metrics[-1]["t"]
    assert sum(r["time_s"] for r in rows) == pytest.approx(run.metrics[-1]["t"])
    assert all(r["train_utilization"] is not None for r in rows)


def test_training_cells_follow_the_timeline(run_copy):
    static = load_run(run_copy("tiny-static"))
    assert set(training_cells(static)[1]) == {1}  # core trains throughout, nothing moves
    run = load_run(run_copy("tiny-waterlevel"))
    edges, count = training_cells(run)
    core = run.timeline[0]
    start, end, role = next(s for s in core if s[2] == "training" and s[1] > s[0])
    assert count[edges.index(start)] >= 1
    assert count[0] == 0  # every cell starts in rollout under waterlevel
    assert edges[-1] == max(b for segs in run.timeline for _, b, _ in segs)


def test_missing_optional_files_skip_their_plots_with_a_note(run_copy):
    run = run_copy("tiny-waterlevel")
    write_report(run)  # a first report leaves every PNG behind
    (run / "timeline.json").unlink()
    (run / "state.jsonl").unlink()
    files = write_report(run)
    assert [p.name for p in files] == ["reward.png", "utilization.png", "trace.json", "report.md"]
    assert not (run / "roles.png").exists() and not (run / "waterlevel.png").exists()
    text = (run / "report.md").read_text()
    assert "- `roles.png` skipped: no timeline.json" in text
    assert "- `waterlevel.png` skipped: no state.jsonl samples" in text
    assert "](roles.png)" not in text


def test_summary_only_run_uses_the_summarys_rewards(run_copy):
    run = run_copy("tiny-waterlevel")
    for name in ("metrics.jsonl", "state.jsonl", "timeline.json", "config.yaml"):
        (run / name).unlink()
    summary = json.loads((run / "summary.json").read_text())
    summary["mean_reward_per_step"] = [0.0, 0.5, 0.5, 1.0]
    summary["satellite_joins"] = 3
    (run / "summary.json").write_text(json.dumps(summary))
    files = write_report(run)
    assert [p.name for p in files] == ["reward.png", "trace.json", "report.md"]
    text = (run / "report.md").read_text()
    assert "first quarter 0.000, last quarter 1.000" in text
    assert "| satellite joins | 3 |" in text
    assert "no config.yaml" in text and "No metrics.jsonl lines" in text
    assert "- `utilization.png` skipped: no optimizer steps in metrics.jsonl" in text


def test_not_a_run_directory_is_a_one_line_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no such run directory"):
        write_report(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        write_report(tmp_path / "file")
    with pytest.raises(ConfigError, match=r"no summary\.json"):
        write_report(tmp_path)
    (tmp_path / "summary.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"summary\.json: not valid JSON"):
        write_report(tmp_path)
    (tmp_path / "summary.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="not a JSON object"):
        write_report(tmp_path)


def test_corrupt_lines_name_file_and_line(run_copy):
    run = run_copy("tiny-waterlevel")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[2] = lines[2][:40]  # a line cut short, as by a crash mid-write
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(TidalError, match=r"metrics\.jsonl:3: not valid JSON") as exc:
        write_report(run)
    assert "\n" not in str(exc.value)
    assert not (run / "report.md").exists()

    run = run_copy("tiny-static", "s2")
    states = read_jsonl(run / "state.jsonl")
    del states[4]["t"]
    write_jsonl(run / "state.jsonl", states)
    with pytest.raises(ConfigError, match=r"state\.jsonl:5: missing key\(s\) t"):
        write_report(run)

    run = run_copy("tiny-static", "s3")
    (run / "timeline.json").write_text(json.dumps({"cells": [[[0.0, "x"]]]}))
    with pytest.raises(ConfigError, match=r"timeline\.json: cells\.0"):
        write_report(run)


def test_wall_clock_step_times_of_older_runs_leave_the_first_burst_unknown(run_copy):
    run = run_copy("tiny-waterlevel")
    metrics = read_jsonl(run / "metrics.jsonl")
    for m in metrics:
        m["t"] += 10_000.0  # the driver before 7d65262 wrote the wall clock
    write_jsonl(run / "metrics.jsonl", metrics)
    rows = burst_rows(load_run(run))
    assert rows[0]["time_s"] is None and rows[0]["start_s"] is None
    assert rows[1]["time_s"] == pytest.approx(metrics[3]["t"] - metrics[1]["t"])
    write_report(run)
    text = (run / "report.md").read_text()
    assert "the first burst's start and time are unknown" in text
    assert f"| 0 | 2 | – | {metrics[1]['t']:.2f} | – |" in text
