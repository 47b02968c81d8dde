"""Issue 38 (6, 7): no value an agent or a task row produces stops the run. A Python agent's
reward that is NaN, an infinity or a bool closes its execution ``reward_error`` with no reward
(never a stand-in 0.0, never a traceback); a row whose ``workspace_files`` cannot be written
closes its execution ``failed`` with the reason logged."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from tidal.agents.agent_python import outcome_of
from tidal.agents.kinds import AgentContext, build_agent
from tidal.agents.rewards import Reward
from tidal.agents.tasks import TaskRow
from tidal.agents.workload import AgentJob, run_job
from tidal.config import AgentConfig, RewardConfig


def _ctx(ws: Path, row: TaskRow) -> AgentContext:
    return AgentContext(
        "b0-g0-e0",
        "b0-g0",
        row,
        ws,
        "http://127.0.0.1:9/x/b0-g0-e0/v1",
        "tx-key",
        "http://127.0.0.1:9",
        "m",
        20.0,
        8,
        1,
        1.0,
        0,
    )


@pytest.mark.parametrize(
    "value",
    [
        float("nan"),
        float("inf"),
        -float("inf"),
        True,
        {"reward": float("nan")},
        {"reward": False, "answer": "a"},
        {"reward": -float("inf"), "answer": "b"},
    ],
)
def test_a_non_finite_or_bool_reward_is_a_reward_error(value):
    out = outcome_of(value)
    assert (out.reason, out.reward) == ("reward_error", None)


@pytest.mark.parametrize(
    "value, reward", [(3, 3.0), (0.5, 0.5), (1e308, 1e308), ({"reward": 2}, 2.0)]
)
def test_a_finite_reward_is_kept(value, reward):
    out = outcome_of(value)
    assert (out.reason, out.reward) == ("completed", reward)


def test_a_python_agent_returning_nan_closes_reward_error_without_a_score(tmp_path, caplog):
    (tmp_path / "agent.py").write_text("async def run(row):\n    return float('nan')\n")
    (tmp_path / "r.py").write_text("def r(answer):\n    raise AssertionError('not called')\n")
    agent = build_agent(AgentConfig(kind="python", function=f"{tmp_path / 'agent.py'}:run"))
    reward = Reward(RewardConfig(function=f"{tmp_path / 'r.py'}:r"))
    row = TaskRow(0, prompt="p")
    with caplog.at_level(logging.ERROR, "tidal.agents.workload"):
        done = asyncio.run(run_job(AgentJob(row, agent, reward, 0, {}), _ctx(tmp_path / "w", row)))
    assert (done.reason, done.reward) == ("reward_error", None)  # main: reward nan, "completed"
    assert [r.getMessage() for r in caplog.records] == [
        "execution b0-g0-e0: reward_error: the agent's reward is not a finite number"
    ]


def test_a_failing_reward_gives_no_reward(tmp_path):
    (tmp_path / "r.py").write_text("def r(answer):\n    raise ValueError('boom')\n")
    agent = build_agent(AgentConfig(kind="command", command=["true"]))
    row = TaskRow(0, prompt="p")
    job = AgentJob(row, agent, Reward(RewardConfig(function=f"{tmp_path / 'r.py'}:r")), 0, {})
    done = asyncio.run(run_job(job, _ctx(tmp_path / "w", row)))
    assert (done.reason, done.reward) == ("reward_error", None)  # main: 0.0


@pytest.mark.parametrize(
    "files, says",
    [
        (5, "workspace_files is int, not a mapping path -> text"),
        (["a.py"], "workspace_files is list, not a mapping path -> text"),
        ({"a.py": 3}, "workspace_files['a.py'] is int, not text"),
        ({"../x.py": "x"}, "workspace file '../x.py' is outside the workspace"),
    ],
)
def test_a_bad_workspace_files_row_fails_its_execution_not_the_run(tmp_path, caplog, files, says):
    agent = build_agent(AgentConfig(kind="command", command=["true"]))
    row = TaskRow(7, prompt="p", metadata={"workspace_files": files})
    with caplog.at_level(logging.WARNING, "tidal.agents.workload"):
        done = asyncio.run(
            run_job(AgentJob(row, agent, None, 0, {}), _ctx(tmp_path / "w", row))
        )  # main: TypeError for 5
    assert done.reason == "failed"
    assert [r.getMessage() for r in caplog.records] == [
        f"execution b0-g0-e0 failed: task row 7: {says}"
    ]
