"""A hostile command agent through a real ``tidal run`` (configs/tiny.yaml, one burst): each
execution asks the model once, then tries to read the run's tokens (every ``/proc/*/environ``,
its own environment), the run directory and other workspaces, to kill its namespace's first
process, leaves a daemon (own session, no environment, double-forked) and floods stderr.
Checked: every attempt refused, the run ends with every execution closed, none failed or lost,
no daemon left, each log cut at the cap."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from tidal.config import RunConfig, validate_model
from tidal.runtime.driver import Runtime

ROOT = Path(__file__).resolve().parents[3]
AGENT = ROOT / "tests" / "fixtures" / "agents" / "hostile_agent.py"
LIMIT = 65536
pytestmark = pytest.mark.slow  # a real run: ~80 s here


def _config() -> RunConfig:
    data = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    data["control"].update(bursts=1, batch_groups=2, updates_per_burst=1)
    data["runtime"].update(execution_timeout_s=60, run_timeout_s=400)
    data["task"] = {
        "source": {
            "kind": "jsonl",
            "path": str(ROOT / "tests" / "fixtures" / "agents" / "tasks.jsonl"),
            "prompt": "question",
            "answer": "answer",
        },
        "reward": {"builtin": "exact"},
        "agent": {
            "kind": "command",
            "command": ["{python}", str(AGENT)],
            "output_limit_bytes": LIMIT,
        },
    }
    return validate_model(RunConfig, data)


def _running(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if (
                marker.encode() in (entry / "cmdline").read_bytes()
                and "\nState:\tZ" not in (entry / "status").read_text()
            ):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.fixture
def run_dir():
    """A run directory under one every user may enter: the sandbox, not a parent's mode, must
    close it."""
    top = Path(tempfile.mkdtemp(prefix="tidal-hostile-", dir="/tmp"))
    top.chmod(0o755)
    yield top / "run"
    shutil.rmtree(top, ignore_errors=True)


def test_a_hostile_command_agent_reaches_nothing_and_the_run_ends_clean(run_dir):
    summary = Runtime(_config(), run_dir).run()
    assert summary["failed_requests"] == 0 and summary["lost_executions"] == 0
    assert summary["dispatched"] == summary["closed"] == 8, summary
    workspaces = sorted((run_dir / "workspaces").iterdir())
    assert len(workspaces) == 8
    for ws in workspaces:
        outcome = json.loads((ws / ".tidal" / "outcome.json").read_text())
        err = (ws / ".tidal" / "stderr.log").read_bytes()
        assert outcome["exit_code"] == 0, (ws.name, err[-300:])
        tried = json.loads((ws / "tried.json").read_text())
        read = {k: v for k, v in tried.items() if str(v).startswith("READ")}
        assert not read, (ws.name, read)
        if os.geteuid() == 0:
            assert tried["uid"] != 0
        assert len(err) < LIMIT + 200 and err.endswith(b"bytes dropped]\n"), len(err)
    deadline = time.monotonic() + 5
    while _running("61.0751") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running("61.0751"), "a hostile agent's daemon outlived the run"
