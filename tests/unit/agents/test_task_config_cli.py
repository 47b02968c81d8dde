"""Bad input in a run's ``task:`` section is one line naming the field, refused by ``tidal check``
and by ``tidal run`` before anything starts (no Ray, no engine, no run directory), never a
traceback: an unknown field, a missing file, a mapping naming a missing column, a
``module:function`` that does not import, a command that is not executable."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from tidal.cli import main

FIXTURES = Path(__file__).parents[2] / "fixtures" / "agents"
ROOT = Path(__file__).parents[3]
GOOD = {
    "name": "t",
    "control": {"group_size": 2, "batch_groups": 1, "updates_per_burst": 1, "bursts": 1},
    "cluster": {"cell_count": 1, "cell_gpus": 1, "cell_slots": 2},
    "task": {
        "source": {
            "kind": "jsonl",
            "path": str(FIXTURES / "tasks.jsonl"),
            "prompt": "question",
            "answer": "answer",
        },
        "reward": {"function": f"{FIXTURES / 'verl_reward.py'}:compute_score"},
        "agent": {"kind": "command", "command": [str(FIXTURES / "curl_agent.sh"), "{prompt}"]},
    },
}


def _with(path: str, value) -> dict:
    cfg = copy.deepcopy(GOOD)
    *parents, last = path.split(".")
    node = cfg
    for p in parents:
        node = node[p]
    node[last] = value
    return cfg


CASES = [
    (_with("task.source.colum", "x"), "task.source.colum: unknown field"),
    (
        _with("task.source.path", "/no/such/tasks.jsonl"),
        "task.source.path: /no/such/tasks.jsonl: no such file or directory",
    ),
    (_with("task.source.answer", "solution"), "task.source.answer: no column 'solution'"),
    (
        _with("task.reward.function", "no_such_reward_mod:compute_score"),
        "task.reward.function: no_such_reward_mod does not import: ModuleNotFoundError",
    ),
    (
        _with("task.agent.command", [str(FIXTURES / "tasks.jsonl")]),
        f"task.agent.command.0: '{FIXTURES / 'tasks.jsonl'}': not executable",
    ),
    (
        _with("task.agent", {"kind": "python", "function": "examples.nope:solve"}),
        "task.agent.function: examples.nope does not import",
    ),
]


@pytest.mark.parametrize(
    ("cfg", "line"), CASES, ids=[c[1].split(":")[0] + str(i) for i, c in enumerate(CASES)]
)
@pytest.mark.parametrize("command", ["check", "run"])
def test_bad_task_input_is_one_line(tmp_path, capsys, cfg, line, command):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    argv = [command, str(path)] + (["--out", str(tmp_path / "run")] if command == "run" else [])
    assert main(argv) == 2
    # a machine-wide note (stale spill files of other runs in /tmp) may precede the error line
    lines = [
        x
        for x in capsys.readouterr().err.splitlines()
        if not x.startswith("tidal: warning: ") or "spill" not in x
    ]
    assert len(lines) == 1 and lines[0].startswith(f"tidal: error: {line}"), lines
    assert not (tmp_path / "run").exists()  # refused before anything started


@pytest.mark.parametrize("name", ["reasoning-gym", "python-agent", "mini-swe-agent"])
def test_the_shipped_agent_configs_check(name, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # as pasted from the docs: from the repository root
    assert main(["check", "-q", f"configs/{name}.yaml"]) == 0


@pytest.mark.parametrize(
    ("key", "value", "place"),
    [
        ("task", "workspace", "task.source.kind (arithmetic | workspace)"),
        ("max_turns", "3", "task.max_turns"),
        ("tool_latency_s", "0.1", "task.source.tool_latency_s"),
    ],
)
def test_the_old_task_keys_name_their_new_place(capsys, key, value, place):
    assert main(["check", str(ROOT / "configs" / "tiny.yaml")]) == 0
    capsys.readouterr()
    argv = ["run", str(ROOT / "configs" / "tiny.yaml"), "--set", f"runtime.{key}={value}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tidal: error: runtime.{key}: moved: set {place}"), err
    assert len(err.strip().splitlines()) == 1


def test_an_unknown_task_source_is_one_line(capsys):
    argv = ["run", str(ROOT / "configs" / "tiny.yaml"), "--set", "task.source.kind=mine"]
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith("tidal: error: task.source.kind: ")


def test_a_builtin_source_set_on_the_command_line_gets_its_own_step_and_reward():
    """The step and reward of a built-in source are decided when the workload is built, so a
    ``--set`` on a resolved config (which holds none) picks the new source's."""
    from tidal.agents.workload import Workload
    from tidal.commands.run import build_config

    cfg = build_config(
        str(ROOT / "configs" / "tiny.yaml"), sets=("task.source.kind=workspace", "task.max_turns=3")
    )
    assert cfg.task.agent.step is None and cfg.task.reward is None
    w = Workload(cfg)
    assert w.agent.step.__name__ == "workspace_step" and w.max_turns == 3
    assert w.job(0, 0, seed=5).row.metadata["data_files"] == ["data0.txt", "data1.txt"]
