"""``docs/custom-policy.md`` works when pasted: its example is the file under ``examples/``,
its ``tidal policies`` and ``tidal simulate`` commands run, its ``tidal run`` command line and
its config section validate with the example's policy built against the cluster (the run
itself: ``tests/integration/runtime/test_user_policy_run.py``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from tidal.cli import main
from tidal.commands import run
from tidal.config import PolicyConfig, validate_model
from tidal.control.factory import check_policy_config
from tidal.control.mechanics import QWENGYRE

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "policies" / "capped_waterlevel.py"


def _out(argv: list[str], out: Path) -> list[str]:
    i = argv.index("--out")
    return [*argv[: i + 1], str(out), *argv[i + 2 :]]


def test_the_doc_shows_the_example_file_whole(custom_policy_doc):
    text, commands = custom_policy_doc
    assert re.findall(r"```python\n(.*?)```", text, re.S) == [EXAMPLE.read_text()]
    assert [c[0] for c in commands] == ["policies", "simulate", "run"]
    assert len(re.findall(r"^## \d\. ", text, re.M)) == 4  # as many steps as verl's page


def test_the_docs_policies_and_simulate_commands_run(
    custom_policy_doc, isolated_policies, monkeypatch, tmp_path, capsys
):
    monkeypatch.chdir(ROOT)
    _, (policies, simulate, _) = custom_policy_doc
    assert main(policies) == 0
    listed = [x for x in capsys.readouterr().out.splitlines() if x.startswith("capped-")]
    assert len(listed) == 1 and "burst/stream/keep/kv" in listed[0]
    assert main(_out(simulate, tmp_path / "sim")) == 0
    runs = json.loads((tmp_path / "sim" / "summary.json").read_text())["runs"]
    assert [r["policy"] for r in runs] == ["capped-waterlevel:max_cells=2", "waterlevel"]
    assert runs[0]["policy_mechanics"] == QWENGYRE.model_dump(mode="json")


def test_the_docs_run_command_and_config_section_validate(
    custom_policy_doc, isolated_policies, monkeypatch
):
    monkeypatch.chdir(ROOT)
    text, (*_, argv) = custom_policy_doc
    ctx = run.command.make_context("run", argv[1:])
    p = ctx.params
    cfg = run.build_config(p["config"], p["policy"], p["address"], p["bursts"], p["sets"])
    assert cfg.policy.name == "capped-waterlevel" and cfg.policy.module == str(EXAMPLE)
    section = yaml.safe_load(re.findall(r"```yaml\n(.*?)```", text, re.S)[0])["policy"]
    assert check_policy_config(validate_model(PolicyConfig, section, "policy")).args == {
        "max_cells": 2
    }
