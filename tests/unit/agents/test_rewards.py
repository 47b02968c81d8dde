"""Rewards from the user's code: verl's compute_score file used unchanged, tidal's signature,
the library scorers; a reward that raises or returns a non-number is a RewardError (the
execution closes ``reward_error``), never a silent 0."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tidal.agents.rewards import Reward, RewardError
from tidal.agents.tasks import TaskRow, load_rows
from tidal.config import RewardConfig, TaskSourceConfig
from tidal.contracts.executions import Outcome, Turn
from tidal.errors import ConfigError

FIXTURES = Path(__file__).parents[2] / "fixtures" / "agents"
VERL_FILE = FIXTURES / "verl_reward.py"


def _score(reward: Reward, row: TaskRow, answer: str, ws: Path = Path(".")) -> float:
    return asyncio.run(reward.score(row, Outcome(answer=answer), ws))


def test_a_verl_reward_file_is_used_unchanged():
    reward = Reward(RewardConfig(function=f"{VERL_FILE}:compute_score"))
    assert reward.style == "verl"
    row = TaskRow(0, prompt="What is 6 * 7?", answer="42", data_source="openai/gsm8k")
    assert _score(reward, row, "6 * 7 is 42.\n#### 42") == 1.0
    assert _score(reward, row, "#### 41") == 0.1
    assert _score(reward, row, "42") == 0.0


def test_tidal_signature_gets_workspace_and_transcript(tmp_path, monkeypatch):
    (tmp_path / "user_reward.py").write_text(
        "def score(row, workspace, transcript):\n"
        "    return float((workspace / 'out.txt').read_text() == row.answer) + len(transcript)\n"
        "async def ascore(answer):\n    return len(answer)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "out.txt").write_text("yes")
    reward = Reward(RewardConfig(function="user_reward:score"))
    out = Outcome(transcript=[Turn(action="a")])
    assert asyncio.run(reward.score(TaskRow(0, answer="yes"), out, tmp_path)) == 2.0
    assert _score(Reward(RewardConfig(function="user_reward:ascore")), TaskRow(0), "abc") == 3


def test_library_scorers():
    (row,) = load_rows(TaskSourceConfig(kind="reasoning_gym", name="basic_arithmetic", size=1), 3)
    rg = Reward(RewardConfig(builtin="reasoning_gym"))
    mv = Reward(RewardConfig(builtin="math_verify"))
    exact = Reward(RewardConfig(builtin="exact"))
    cases = [
        (rg, row, f"<answer>{row.answer}</answer>", 1.0),
        (rg, row, str(row.answer), 1.0),
        (rg, row, "no idea", 0.0),
        (mv, TaskRow(0, answer="$\\frac{1}{2}$"), "The answer is $0.5$", 1.0),
        (mv, TaskRow(0, answer="$3$"), "The answer is $4$", 0.0),
        (exact, TaskRow(0, answer="x"), " x ", 1.0),
    ]

    async def scores():  # one loop: the scorers' worker process starts once
        return [await r.score(w, Outcome(answer=a), Path(".")) for r, w, a, _ in cases]

    assert asyncio.run(scores()) == [want for *_, want in cases]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (
            "def r(answer):\n    raise KeyError('gold')\n",
            r"KeyError: 'gold' \(at bad_reward.py:2\)",
        ),
        ("def r(answer):\n    return 'high'\n", "returned str 'high', not a number"),
        ("def r(answer):\n    return None\n", "returned NoneType"),
        ("def r(answer):\n    return float('nan')\n", "not a finite number"),
    ],
)
def test_a_failing_reward_is_a_reward_error(tmp_path, body, says):
    (tmp_path / "bad_reward.py").write_text(body)
    reward = Reward(RewardConfig(function=f"{tmp_path / 'bad_reward.py'}:r"))
    with pytest.raises(RewardError, match=says):
        _score(reward, TaskRow(0), "x")


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("no_such_module_xyz:f", "no_such_module_xyz does not import: ModuleNotFoundError"),
        ("json:no_such_fn", "json has no attribute 'no_such_fn'"),
        ("json", "expected 'module:function'"),
        ("/nope/reward.py:f", "/nope/reward.py: no such file"),
        ("json:dumps", "parameter 'obj' is neither verl's"),
    ],
)
def test_a_reward_that_does_not_load_is_one_line(spec, says):
    with pytest.raises(ConfigError) as err:
        Reward(RewardConfig(function=spec))
    assert err.value.field == "task.reward.function" and says in err.value.message


def test_a_module_that_raises_at_import_names_its_error(tmp_path):
    (tmp_path / "broken.py").write_text("import os\nraise RuntimeError('no GPU here')\n")
    with pytest.raises(ConfigError, match=r"broken\.py does not import: RuntimeError: no GPU"):
        Reward(RewardConfig(function=f"{tmp_path / 'broken.py'}:f"))
