"""Issue 28: a user's policy in a file outside ``src/`` is selected by config in ``tidal run``:
the command of ``docs/custom-policy.md`` step 4, pasted (its ``--out`` in a temporary
directory), runs ``examples/policies/capped_waterlevel.py`` on Ray; the run moves cells under
it, loses nothing, and reports the mechanics the policy declares."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tidal.cli import main
from tidal.control.mechanics import QWENGYRE

ROOT = Path(__file__).resolve().parents[3]


def test_the_docs_user_policy_runs_on_ray(
    custom_policy_doc, isolated_policies, monkeypatch, tmp_path
):
    monkeypatch.chdir(ROOT)
    argv = custom_policy_doc[1][-1]
    assert argv[0] == "run"
    i = argv.index("--out")
    out = tmp_path / "run"
    assert main([*argv[: i + 1], str(out), *argv[i + 2 :]]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["policy"] == "capped-waterlevel"
    assert s["policy_mechanics"] == QWENGYRE.model_dump(mode="json")
    assert s["switches_to_training"] > 0
    assert s["failed_requests"] == 0 and s["lost_executions"] == 0
    assert s["dispatched"] == s["closed"] == s["trained_executions"]
    cfg = yaml.safe_load((out / "config.yaml").read_text())["policy"]
    assert cfg["module"] == str(ROOT / "examples" / "policies" / "capped_waterlevel.py")
    decisions = [json.loads(x) for x in (out / "decisions.jsonl").read_text().splitlines()]
    assert {d["policy"] for d in decisions if d["type"] == "decision"} == {"capped-waterlevel"}
