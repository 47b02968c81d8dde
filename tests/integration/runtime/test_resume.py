"""Killing the driver of ``tidal run`` mid-burst (SIGKILL: no clean-up) and resuming it with
``tidal run --resume DIR``: the run completes, and the set of trained executions is exactly
the uninterrupted run's (every group of every burst, each once), with no execution lost and
no failed request. What the killed driver left running is ended by the resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import yaml

from tidal.cli import main

from .test_tiny_run import CONFIG, expected_groups


def _checkpoint_step(out: Path) -> int | None:
    try:
        return json.loads((out / "checkpoint" / "state.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return None


def test_driver_killed_mid_burst_resumes_without_loss_or_repeats(tmp_path):
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["control"]["bursts"] = 3
    config = tmp_path / "tiny3.yaml"
    config.write_text(yaml.safe_dump(cfg))
    upb = cfg["control"]["updates_per_burst"]
    out = tmp_path / "run"
    log = open(tmp_path / "first.log", "w")  # noqa: SIM115 - closed below
    first = subprocess.Popen(
        [sys.executable, "-m", "tidal.cli", "run", str(config), "--out", str(out)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    killed_at = None
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and first.poll() is None:
            step = _checkpoint_step(out)
            if step is not None and step % upb:  # between the two updates of a burst
                os.kill(first.pid, signal.SIGKILL)
                killed_at = step
                break
            time.sleep(0.05)
        first.wait(30)
    finally:
        if first.poll() is None:
            first.kill()
        log.close()
    assert killed_at is not None, (tmp_path / "first.log").read_text()[-2000:]
    left = json.loads((out / "processes.json").read_text())["processes"]

    assert main(["run", "--resume", str(out)]) == 0
    # kept while the run could be resumed, deleted once it succeeded
    assert not list(out.glob("checkpoint*")) and not (out / "weights").exists()

    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed"]["at_step"] == killed_at
    assert summary["lost_executions"] == 0 and summary["failed_requests"] == 0
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(3 * upb))
    trained = [g for m in metrics for g in m["groups"]]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert sorted(trained) == expected_groups(cfg)
    assert summary["trained_executions"] == len(trained) * cfg["control"]["group_size"]
    # issue 38 item 17: executions.jsonl holds every execution once, those closed before the
    # kill included (on main only the resumed incarnation's were there)
    lines = [json.loads(x) for x in (out / "executions.jsonl").read_text().splitlines()]
    ids = [x["execution"] for x in lines]
    assert len(ids) == len(set(ids)), "an execution has two lines"
    assert {x["group"] for x in lines} >= set(trained)
    assert len(lines) == sum(summary["close_reasons"].values()), summary["close_reasons"]
    # the killed driver's engines, proxy and Ray processes are gone
    for row in left:
        if row["pid"] == first.pid:
            continue
        try:
            p = psutil.Process(row["pid"])
            assert (
                abs(p.create_time() - row["create_time"]) > 1e-3
                or p.status() == psutil.STATUS_ZOMBIE
            ), row
        except psutil.NoSuchProcess:
            pass


def test_resume_refuses_bad_input(tmp_path, capsys):
    assert main(["run", "--resume", str(tmp_path)]) == 2
    assert "no config.yaml" in capsys.readouterr().err
    (tmp_path / "config.yaml").write_text(CONFIG.read_text())
    assert main(["run", "--resume", str(tmp_path)]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    assert main(["run", str(CONFIG), "--resume", str(tmp_path)]) == 2
    assert "run directory only" in capsys.readouterr().err
    assert main(["run", "--resume", str(tmp_path), "--bursts", "1"]) == 2
    assert "run directory only" in capsys.readouterr().err


def test_sigterm_stops_every_part_and_points_to_resume(tmp_path):
    """SIGTERM (``kill``, a batch scheduler's stop) ends the run like Ctrl-C: the driver stops
    its engines, proxy, satellites and Ray before it exits, and says how to continue."""
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tidal.cli", "run", str(CONFIG), "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None and _checkpoint_step(out) is None:
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        left = json.loads((out / "processes.json").read_text())["processes"]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert f"tidal run --resume {out}" in err
    alive = []
    for row in left:
        try:
            p = psutil.Process(row["pid"])
            if (
                abs(p.create_time() - row["create_time"]) < 1e-3
                and p.status() != psutil.STATUS_ZOMBIE
            ):
                alive.append((row, p.cmdline()[:4]))
        except psutil.NoSuchProcess:
            pass
    assert not alive, alive
