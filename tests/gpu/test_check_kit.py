"""The GPU check (``benchmarks/gpu/check.py``, what a lent GPU machine runs) dry-run on the CPU
with tiny sizes, so the kit cannot rot between GPU loans: every step runs (the two-rank NCCL step
is skipped with its reason), and the JSON and the markdown table have their full shape.

Runs only as the CPU dry run (``TIDAL_TEST_DEVICE=cpu``, what ``make test`` does for
``tests/gpu``); on a GPU machine run the check itself: ``benchmarks/gpu/check.sh``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT / "benchmarks" / "gpu"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        os.environ.get("TIDAL_TEST_DEVICE") != "cpu",
        reason="the kit's CPU dry run (on a GPU run benchmarks/gpu/check.sh)",
    ),
]
# one quick test of tests/gpu: the tests step's plumbing (make test runs all of them anyway)
ONE_TEST = "tests/gpu/test_cuda.py::test_kv_exported_on_device_continues_on_cpu_and_back[tiny]"


@pytest.fixture(scope="module")
def check():
    sys.path.insert(0, str(KIT))
    import check as module

    return module


def test_dry_run_writes_every_step_to_the_json_and_the_table(tmp_path, check):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        [
            sys.executable,
            str(KIT / "check.py"),
            "--out",
            str(out),
            "--device",
            "cpu",
            "--sizes",
            "tiny",
            "--tests",
            ONE_TEST,
            "--wheels",
            str(tmp_path / "no-wheels"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((out / "check.json").read_text())
    assert set(report) == {
        "date",
        "device",
        "sizes",
        "limit_s",
        "wheels",
        "columns",
        "steps",
        "wall_s",
    }
    steps = report["steps"]
    assert list(steps) == ["environment", *(s[0] for s in check.STEPS)]
    for name, res in steps.items():
        assert set(res) == {"status", "reason", "figures", "seconds"}, name
        want = "skipped" if name == "fsdp_two_ranks" else "ok"  # broadcast: gloo on CPU
        assert res["status"] == want, (name, res["reason"], proc.stdout[-4000:])
        for row in res["figures"]:
            assert set(row) == {"figure", "value", "unit", "sim", "note"}, (name, row)
    assert "one GPU per rank" in steps["fsdp_two_ranks"]["reason"]
    assert steps["tests_gpu"]["figures"][0] == {
        "figure": "passed",
        "value": 1,
        "unit": "tests",
        "sim": None,
        "note": "",
    }
    carriers = {r["figure"]: r for r in steps["weight_carriers"]["figures"]}
    assert carriers["tidal run: trainer -> engine"]["value"] > 0
    assert carriers["ipc: trainer -> engine (same GPU)"]["note"] == "CUDA IPC needs CUDA"
    (bcast,) = steps["weight_broadcast"]["figures"]
    assert bcast["figure"].startswith("broadcast (gloo") and bcast["value"] > 0
    decode = {r["figure"]: r for r in steps["decode"]["figures"]}
    for b in (1, 8, 32, 128):
        assert decode[f"decode b={b}"]["value"] > 0 and decode[f"decode b={b}"]["sim"] > 0
    table = (out / "check.md").read_text().splitlines()
    assert table[2] == "| " + " | ".join(check.COLUMNS) + " |"
    rows = [line for line in table[4:] if line.startswith("|")]
    assert all(line.count("|") == len(check.COLUMNS) + 1 for line in rows)
    assert [r.split("|")[1].strip() for r in rows if r.split("|")[1].strip()] == list(steps)
    assert proc.stdout.count("| environment | ok |") == 1  # the table is printed too


def test_a_step_past_its_timeout_is_killed_and_recorded(tmp_path, check):
    t0 = time.monotonic()
    res = check.run_step(_sleeps, check.Ctx(None, None, {}), 3.0, tmp_path)
    assert res["status"] == "timeout" and res["reason"] == "killed after 3 s"
    assert time.monotonic() - t0 < 20


def test_a_killed_step_keeps_the_figures_it_had(tmp_path, check):
    sys.path.insert(0, str(KIT))
    from kit import Figures

    figs = Figures(tmp_path / "step.partial")
    figs.add("measured before hanging", 1.5, "s")
    res = check._partial(tmp_path / "step.json", "timeout", "killed after 9 s")
    assert res == {
        "status": "timeout",
        "reason": "killed after 9 s",
        "figures": [
            {
                "figure": "measured before hanging",
                "value": 1.5,
                "unit": "s",
                "sim": None,
                "note": "",
            }
        ],
    }


def test_a_failing_step_keeps_the_check_going(tmp_path, check):
    res = check.run_step(_fails, check.Ctx(None, None, {}), 30.0, tmp_path)
    assert res["status"] == "failed"
    assert res["reason"] == "RuntimeError: out of memory, say"
    assert [r["figure"] for r in res["figures"]] == ["measured before failing"]


def test_the_budget_skips_what_no_longer_fits(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            str(KIT / "check.py"),
            "--out",
            str(out),
            "--device",
            "cpu",
            "--sizes",
            "tiny",
            "--limit-s",
            "1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = json.loads((out / "check.json").read_text())["steps"]
    assert {r["status"] for r in steps.values()} == {"skipped"}
    assert all(r["reason"] == "the check's 1 s are spent" for r in steps.values())


def _sleeps(ctx, figs) -> None:
    time.sleep(60)


def _fails(ctx, figs) -> None:
    figs.add("measured before failing", 1.0, "s")
    raise RuntimeError("out of memory, say")
