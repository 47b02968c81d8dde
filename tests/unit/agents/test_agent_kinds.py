"""Agent kinds without a model server: a command runs in its workspace as its own process
group (exit code, output tails, ended with its execution: nothing outlives it), the reward is
computed after it exits (``reward_error`` logged with the execution id), and every bad input
is one line naming the field. (The per-execution identity a black box carries, at the proxy:
``tests/unit/serving/test_identity_rules.py``.)"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

import pytest

from tidal.agents.agent_command import GRACE_S
from tidal.agents.kinds import AgentContext, build_agent
from tidal.agents.rewards import Reward
from tidal.agents.tasks import TaskRow
from tidal.agents.workload import AgentJob, run_job
from tidal.config import AgentConfig, RewardConfig
from tidal.errors import ConfigError

FIXTURES = Path(__file__).parents[2] / "fixtures" / "agents"


def _ctx(ws: Path, row: TaskRow, timeout_s: float = 20.0) -> AgentContext:
    return AgentContext(
        "b0-g0-e0",
        "b0-g0",
        row,
        ws,
        "http://127.0.0.1:9/x/b0-g0-e0/v1",
        "tx-key",
        "http://127.0.0.1:9",
        "m",
        timeout_s,
        8,
        1,
        1.0,
        0,
    )


def _command(*argv: str, **kw) -> object:
    return build_agent(AgentConfig(kind="command", command=list(argv), **kw))


def test_a_command_runs_in_its_workspace_and_its_reward_follows(tmp_path):
    agent = _command(
        "sh",
        "-c",
        'cat "$1" > seen.json; echo "$OPENAI_BASE_URL"; echo "#### 42"; echo oops >&2; exit 3',
        "sh",
        "{task_file}",
        env={"WHERE": "{workspace}"},
    )
    reward = Reward(RewardConfig(function=f"{FIXTURES / 'verl_reward.py'}:compute_score"))
    row = TaskRow(0, prompt="6 * 7?", answer="42")
    done = asyncio.run(run_job(AgentJob(row, agent, reward, 0, {}), _ctx(tmp_path, row)))
    assert done.exit_code == 3 and done.reason == "failed"  # a non-zero exit
    assert done.reward == 1.0  # scored on its stdout (verl's solution_str)
    assert done.stdout_tail.startswith("http://127.0.0.1:9/x/b0-g0-e0/v1")
    assert done.stderr_tail == "oops\n"
    seen = (tmp_path / "seen.json").read_text()
    assert '"prompt": "6 * 7?"' in seen and '"answer"' not in seen  # never the reference


def test_a_command_past_its_timeout_is_ended_with_its_children(tmp_path):
    agent = _command("sh", "-c", "sleep 61.0731 & sleep 60")
    row = TaskRow(0, prompt="p", metadata={"workspace_files": {"src/a.py": "x = 1\n"}})
    reward = Reward(RewardConfig(function=f"{FIXTURES / 'verl_reward.py'}:compute_score"))
    t0 = time.monotonic()
    done = asyncio.run(run_job(AgentJob(row, agent, reward, 0, {}), _ctx(tmp_path, row, 4.0)))
    assert done.reason == "timeout" and done.reward == 0.0
    assert time.monotonic() - t0 < 4.0 + GRACE_S + 5  # the timeout, the grace, slack
    assert (tmp_path / "src" / "a.py").read_text() == "x = 1\n"  # the row's files came first
    assert not running("61.0731"), "the command's child outlived its execution"


def test_a_child_in_its_own_session_does_not_outlive_its_execution(tmp_path):
    # as mini-swe-agent runs each bash action: a new session, out of the program's group
    agent = _command("sh", "-c", "setsid sleep 61.0732 & sleep 0.3; exit 0")
    row = TaskRow(0, prompt="p")
    reward = Reward(RewardConfig(builtin="exact"))
    done = asyncio.run(run_job(AgentJob(row, agent, reward, 0, {}), _ctx(tmp_path, row)))
    assert done.exit_code == 0
    assert not running("61.0732"), "a child in its own session outlived its execution"


def running(marker: str) -> list[int]:
    """Live processes (not zombies) whose command line holds ``marker`` (an agent's children
    live in its PID namespace: the pids they see are not the host's)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            hit = marker.encode() in (entry / "cmdline").read_bytes()
            if hit and _alive(int(entry.name)):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state  # a zombie is dead, waiting for its reaper


def test_a_reward_error_closes_the_execution_and_is_logged(tmp_path, caplog):
    (tmp_path / "r.py").write_text("def r(answer):\n    return {'no': 'score'}\n")
    agent = _command("true")
    row = TaskRow(0, prompt="p")
    job = AgentJob(row, agent, Reward(RewardConfig(function=f"{tmp_path / 'r.py'}:r")), 0, {})
    with caplog.at_level(logging.ERROR, "tidal.agents.workload"):
        done = asyncio.run(run_job(job, _ctx(tmp_path / "ws", row)))
    assert done.reason == "reward_error"
    (line,) = [r.getMessage() for r in caplog.records]
    assert (
        line == "execution b0-g0-e0: reward_error: returned dict \"{'no': 'score'}\", not a number"
    )


@pytest.mark.parametrize(
    ("spec", "field", "says"),
    [
        ({"kind": "nope"}, "task.agent.kind", "unknown agent kind 'nope'"),
        ({"kind": "command"}, "task.agent.command", "needs a program"),
        (
            {"kind": "command", "command": ["/no/such/agent"]},
            "task.agent.command.0",
            "no such file",
        ),
        (
            {"kind": "command", "command": [str(FIXTURES / "verl_reward.py")]},
            "task.agent.command.0",
            "not executable",
        ),
        (
            {"kind": "command", "command": ["no-such-program-xyz"]},
            "task.agent.command.0",
            "not found on PATH",
        ),
        (
            {"kind": "command", "command": ["sh", "{promt}"]},
            "task.agent.command.1",
            "unknown placeholder {promt}",
        ),
        (
            {"kind": "command", "command": ["sh"], "function": "a:b"},
            "task.agent.function",
            "not used by the 'command' agent kind",
        ),
        ({"kind": "python"}, "task.agent.function", "needs 'module:function'"),
        ({"kind": "python", "function": "json:dumps"}, "task.agent.function", "async function"),
        (
            {"kind": "python", "function": "no_such_mod_q:f"},
            "task.agent.function",
            "does not import",
        ),
        ({"kind": "chat", "step": "json:nope"}, "task.agent.step", "no attribute 'nope'"),
        ({"kind": "chat", "args": {"temp": 1}}, "task.agent.args.temp", "unknown argument"),
    ],
)
def test_a_bad_agent_is_one_line_naming_the_field(spec, field, says):
    with pytest.raises(ConfigError) as err:
        build_agent(AgentConfig.model_validate(spec))
    assert err.value.field == field and says in err.value.message, str(err.value)
    assert "\n" not in str(err.value)


def test_no_program_group_is_left_after_a_cancelled_run(tmp_path):
    from tidal.agents.agent_command import _LIVE

    agent = _command("sleep", "60")

    async def cancelled():
        task = asyncio.ensure_future(agent.run(_ctx(tmp_path, TaskRow(0, prompt="p"))))
        await asyncio.sleep(0.5)
        pgid = next(iter(_LIVE))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return pgid

    pgid = asyncio.run(cancelled())
    assert not _LIVE and not _alive(pgid)
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)
