"""Issue 38 (7, 13, 14): ``tidal check`` checks every row of a task source, nothing coerced;
each mistake is one line naming the row (and the file's line) and the column; a file that is
not UTF-8, a directory given as the path and an empty file are each one clear line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tidal.agents.tasks import load_rows
from tidal.cli import main
from tidal.config import TaskSourceConfig
from tidal.errors import ConfigError

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml"


def _jsonl(tmp: Path, rows: list[dict]) -> Path:
    path = tmp / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _load(path: Path, **kw):
    return load_rows(
        TaskSourceConfig.model_validate({"kind": "jsonl", "path": str(path), "prompt": "q", **kw}),
        0,
    )


def _mistakes(path: Path, **kw) -> list[str]:
    with pytest.raises(ConfigError) as err:
        _load(path, **kw)
    assert err.value.field == "task.source"
    head, *lines = err.value.message.split("\n")
    assert head.endswith(" mistake(s) in the rows:")
    return [x.strip() for x in lines]


def test_every_row_is_checked_and_each_mistake_is_one_line(tmp_path):
    path = _jsonl(
        tmp_path,
        [
            {"q": "fine", "workspace_files": {"a.py": "x = 1\n"}},
            {"q": "a", "workspace_files": 5},  # main: passes check, the run stops (TypeError)
            {"q": "b", "workspace_files": ["a.py"]},
            {"q": None},  # main: the prompt "None"
            {"other": 1},  # main: KeyError traceback
            {"q": 7},
            {"q": "c", "workspace_files": {"a.py": 3, "../up.py": "x"}},
            {"q": "d", "test_command": "pytest -q"},
        ],
    )
    assert _mistakes(path) == [
        "row 1 (t.jsonl:2): column 'workspace_files' is int, not a mapping of relative paths "
        "to text",
        "row 2 (t.jsonl:3): column 'workspace_files' is list, not a mapping of relative paths "
        "to text",
        "row 3 (t.jsonl:4): column 'q' is null, not text",
        "row 4 (t.jsonl:5): no column 'q'",
        "row 5 (t.jsonl:6): column 'q' is int, not text",
        "row 6 (t.jsonl:7): column 'workspace_files': 'a.py' is int, not text",
        "row 6 (t.jsonl:7): column 'workspace_files': '../up.py' is not a relative path inside "
        "the workspace",
        "row 7 (t.jsonl:8): column 'test_command' is str, not a list of strings",
    ]


def test_a_chat_row_and_its_data_source_are_checked(tmp_path):
    path = _jsonl(
        tmp_path,
        [
            {"m": [{"role": "user", "content": "hi"}], "data_source": "x"},
            {"m": "hi", "data_source": "x"},
            {"m": [{"role": "user", "content": "hi"}], "data_source": 3},
        ],
    )
    assert _mistakes(path, prompt=None, messages="m") == [
        "row 1 (t.jsonl:2): column 'm' is not a list of {role, content} messages",
        "row 2 (t.jsonl:3): column 'data_source' is int, not text",
    ]


def test_many_mistakes_are_capped(tmp_path):
    lines = _mistakes(_jsonl(tmp_path, [{"q": None}] * 25))
    assert len(lines) == 21 and lines[-1] == "... and 5 more"
    assert lines[19] == "row 19 (t.jsonl:20): column 'q' is null, not text"


@pytest.mark.parametrize(
    "make, says",
    [
        (
            lambda p: p.write_bytes(b'{"q": "ok"}\n{"q": "caf\xe9"}\n'),
            "t.jsonl:2: not UTF-8 text (byte 0xe9 at column 11)",
        ),
        (lambda p: p.mkdir(), "a directory, not a JSONL file"),
        (lambda p: p.write_text(""), "holds no rows (an empty file: one JSON object per line"),
        (lambda p: p.write_text("\n\n"), "holds no rows (an empty file"),
    ],
)
def test_a_bad_file_is_one_line(tmp_path, make, says):
    path = tmp_path / "t.jsonl"
    make(path)
    with pytest.raises(ConfigError) as err:  # main: tracebacks, or "no column 'q'" if empty
        _load(path)
    assert err.value.field == "task.source.path" and says in err.value.message
    assert "\n" not in str(err.value)


def test_a_good_row_keeps_its_values(tmp_path):
    (row,) = _load(_jsonl(tmp_path, [{"q": "p", "workspace_files": {"d/a.py": "x"}}]))
    assert row.prompt == "p" and row.metadata == {"workspace_files": {"d/a.py": "x"}}


def test_tidal_check_names_each_bad_row(tmp_path, capsys):
    path = _jsonl(tmp_path, [{"q": "ok"}, {"q": "a", "workspace_files": 5}, {"q": None}])
    cfg = yaml.safe_load(TINY.read_text())
    cfg["task"] = {
        "source": {"kind": "jsonl", "path": str(path), "prompt": "q"},
        "reward": {"builtin": "exact"},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["check", str(tmp_path / "c.yaml")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "tidal: error: task.source: 2 mistake(s) in the rows:",
        "  row 1 (t.jsonl:2): column 'workspace_files' is int, not a mapping of relative paths "
        "to text",
        "  row 2 (t.jsonl:3): column 'q' is null, not text",
    ]
