"""A user's engine backend in a file outside ``src/`` serves a real run: the command of
``docs/engines.md`` ("Your own backend"), pasted (its ``--out`` in a temporary directory), runs
the tiny job on ``examples/backends/audited_builtin.py``'s ``audited-builtin``. The driver loads
the module from the config, the proxy from ``--backend-module``, Ray's workers get its host class
by value; every engine writes the host's audit lines, the cells that moved to training slept and
loaded each version they came back on, and nothing is lost."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import yaml

from tidal.cli import main

ROOT = Path(__file__).resolve().parents[3]


def _doc_command() -> list[str]:
    text = (ROOT / "docs" / "engines.md").read_text()
    section = text.split("## Your own backend", 1)[1].split("\n## ", 1)[0]
    block = re.findall(r"```bash\n(.*?)```", section, re.S)[0]
    argv = shlex.split(block.replace("\\\n", " "))
    assert argv[0].endswith("tidal")
    return argv[1:]


def test_the_docs_user_backend_serves_a_run_on_ray(isolated_backends, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    argv = _doc_command()
    i = argv.index("--out")
    out = tmp_path / "run"
    assert main([*argv[: i + 1], str(out), *argv[i + 2 :]]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["switches_to_training"] > 0 and s["switches_to_rollout"] > 0
    assert s["failed_requests"] == 0 and s["lost_executions"] == 0
    assert s["dispatched"] == s["closed"] == s["trained_executions"]
    rt = yaml.safe_load((out / "config.yaml").read_text())["runtime"]
    assert rt["backend_modules"] == [str(ROOT / "examples" / "backends" / "audited_builtin.py")]
    assert rt["cell_backend"] == rt["standalone_backend"] == "audited-builtin"
    audits = {
        p.name: [json.loads(x) for x in p.read_text().splitlines()]
        for p in (out / "logs").glob("audit-*.jsonl")
    }
    assert sorted(audits) == ["audit-c0.jsonl", "audit-c1.jsonl", "audit-s0.jsonl"]
    for lines in audits.values():
        assert lines[0]["event"] == "start" and lines[0]["url"].startswith("http://")
    # each move to training put the cell's engine to sleep; each move back loaded a version
    sleeps = [e for lines in audits.values() for e in lines if e["event"] == "sleep"]
    assert len(sleeps) == s["switches_to_training"]
    loads = [
        e["version"] for lines in audits.values() for e in lines if e["event"] == "load_weights"
    ]
    assert len(loads) >= s["switches_to_rollout"]
    assert all(re.fullmatch(r"v\d+", v) for v in loads)
