"""Task rows from the user's data (JSONL, Parquet, a saved dataset, reasoning-gym, generated
repos) with a field mapping, the seeded group order, and one-line errors naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tidal.agents.tasks import load_rows, row_for
from tidal.config import TaskSourceConfig
from tidal.errors import ConfigError

FIXTURES = Path(__file__).parents[2] / "fixtures" / "agents"


def _src(**kw) -> TaskSourceConfig:
    return TaskSourceConfig.model_validate(kw)


def test_jsonl_rows_are_mapped():
    rows = load_rows(
        _src(kind="jsonl", path=str(FIXTURES / "tasks.jsonl"), prompt="question", answer="answer"),
        0,
    )
    assert len(rows) == 4 and rows[0].prompt == "What is 2 + 3?" and rows[0].answer == "5"
    assert rows[0].data_source == "openai/gsm8k"  # the verl column, found by its name
    assert rows[0].metadata == {"level": 1}  # every column not mapped
    assert rows[0].chat("sys") == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "What is 2 + 3?"},
    ]


def test_parquet_and_saved_dataset_rows(tmp_path):
    import datasets

    msgs = [[{"role": "user", "content": f"q{i}"}] for i in range(3)]
    ds = datasets.Dataset.from_dict({"chat": msgs, "gold": ["a", "b", "c"], "x": [1, 2, 3]})
    ds.to_parquet(str(tmp_path / "t.parquet"))
    rows = load_rows(
        _src(
            kind="parquet",
            path=str(tmp_path / "t.parquet"),
            messages="chat",
            answer="gold",
            metadata=["x"],
        ),
        0,
    )
    assert rows[2].messages == msgs[2] and rows[2].answer == "c" and rows[2].metadata == {"x": 3}
    assert rows[2].text() == "q2"
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "saved"))
    src = _src(kind="disk", path=str(tmp_path / "saved"), split="train", messages="chat")
    assert [r.text() for r in load_rows(src, 0)] == ["q0", "q1", "q2"]
    with pytest.raises(ConfigError, match=r"^task.source.split: .* holds splits \['train'\]"):
        load_rows(_src(kind="disk", path=str(tmp_path / "saved"), messages="chat"), 0)


def test_reasoning_gym_rows_are_generated_here():
    rows = load_rows(
        _src(
            kind="reasoning_gym",
            name="basic_arithmetic",
            size=5,
            args={"min_terms": 2, "max_terms": 2},
        ),
        7,
    )
    again = load_rows(
        _src(
            kind="reasoning_gym",
            name="basic_arithmetic",
            size=5,
            args={"min_terms": 2, "max_terms": 2},
        ),
        7,
    )
    assert [r.prompt for r in rows] == [r.prompt for r in again] and len(rows) == 5
    assert rows[0].metadata["entry"]["answer"] == rows[0].answer


def test_group_order_is_seeded_and_covers_every_row():
    rows = load_rows(_src(kind="swe_repos", size=6), 0)
    first_epoch = [row_for(rows, 1, 0, g, 6).index for g in range(6)]
    assert sorted(first_epoch) == list(range(6))
    assert first_epoch == [row_for(rows, 1, 0, g, 6).index for g in range(6)]
    second_epoch = [row_for(rows, 1, 1, g, 6).index for g in range(6)]
    assert sorted(second_epoch) == list(range(6))  # the next epoch: every row again
    other_seed = [row_for(rows, 2, 0, g, 6).index for g in range(6)]
    assert other_seed != first_epoch  # (one chance in 720 of the same order)


@pytest.mark.parametrize(
    ("kw", "field", "says"),
    [
        (
            {"kind": "jsonl", "path": "/nope.jsonl", "prompt": "q"},
            "task.source.path",
            "no such file",
        ),
        ({"kind": "jsonl", "prompt": "q"}, "task.source.path", "needs a path"),
        (
            {"kind": "jsonl", "path": str(FIXTURES / "tasks.jsonl"), "prompt": "prompt"},
            "task.source.prompt",
            "no column 'prompt'",
        ),
        (
            {
                "kind": "jsonl",
                "path": str(FIXTURES / "tasks.jsonl"),
                "prompt": "question",
                "answer": "solution",
            },
            "task.source.answer",
            "no column 'solution'",
        ),
        (
            {
                "kind": "jsonl",
                "path": str(FIXTURES / "tasks.jsonl"),
                "prompt": "question",
                "metadata": ["level", "nope"],
            },
            "task.source.metadata.1",
            "no column 'nope'",
        ),
        (
            {
                "kind": "jsonl",
                "path": str(FIXTURES / "tasks.jsonl"),
                "prompt": "question",
                "messages": "question",
            },
            "task.source.prompt",
            "exactly one of",
        ),
        ({"kind": "reasoning_gym", "name": "no_such_task"}, "task.source.name", "not registered"),
        (
            {"kind": "reasoning_gym", "name": "basic_arithmetic", "args": {"bogus": 1}},
            "task.source.args",
            "bogus",
        ),
    ],
)
def test_bad_source_is_one_line_naming_the_field(kw, field, says):
    with pytest.raises(ConfigError) as err:
        load_rows(_src(**kw), 0)
    assert err.value.field == field and says in err.value.message
    assert "\n" not in str(err.value)


def test_a_bad_jsonl_line_names_its_line(tmp_path):
    (tmp_path / "t.jsonl").write_text(json.dumps({"q": "a"}) + "\n{oops\n")
    with pytest.raises(ConfigError, match=r"t.jsonl:2: not JSON"):
        load_rows(_src(kind="jsonl", path=str(tmp_path / "t.jsonl"), prompt="q"), 0)
