"""The built-in task sources (``tidal.agents.builtin_tasks``): the workspace task's commands,
score and latency, the arithmetic task, as the ``chat`` kind's step and reward see them."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

from tidal.agents import EventLog, ExecutionRegistry
from tidal.agents import builtin_tasks as bt


@pytest.fixture(autouse=True)
def _fast_tools(monkeypatch):
    monkeypatch.setattr(bt, "LATENCY_CAP_S", 0.01)


class _Env:
    """One execution of the workspace task driven turn by turn, as the chat kind does."""

    def __init__(self, seed):
        self.row = bt.workspace_row(seed, tool_latency_s=0.001)
        self.data_files = self.row.metadata["data_files"]
        self.ws = None

    async def reset(self, ws):
        ws.mkdir(parents=True, exist_ok=True)
        for name, text in self.row.metadata["workspace_files"].items():
            (ws / name).write_text(text)
        self.ws = ws
        return self.row.messages[-1]["content"]

    async def step(self, action):
        return SimpleNamespace(**await bt.workspace_step(self.row, action, self.ws))

    def score(self):
        return bt.workspace_reward(self.row, self.ws)

    @property
    def counts(self):
        return bt.Episode.load(self.row, self.ws).counts


def _fast(seed):
    return _Env(seed)


def _numbers(ws, env):
    return [int((ws / name).read_text()) for name in env.data_files]


def _play(env, ws, actions):
    async def main():
        obs = [await env.reset(ws)]
        steps = []
        for a in actions:
            steps.append(await env.step(a))
            if steps[-1].done:
                break
        return obs, steps

    return asyncio.run(main())


def test_exact_solution_scores_one_and_ends_the_task(tmp_path):
    env = _fast(1)
    ws = tmp_path / "ws"
    asyncio.run(env.reset(ws))
    a, b = _numbers(ws, env)
    env2 = _fast(1)
    (first,), steps = _play(
        env2, tmp_path / "ws2", ["read data0.txt data1.txt", f"write answer.txt {a + b}", "ls"]
    )
    assert "data0.txt" in first and "answer.txt" in first
    assert steps[0].observation.splitlines() == [
        f"data0.txt: {a}",
        f"data1.txt: {b}",
        "Now write their sum to answer.txt.",
    ]
    assert not steps[0].done and steps[0].reward == pytest.approx(0.4)  # the score so far
    assert len(steps) == 2 and steps[1].done and steps[1].reward == 1.0
    assert env2.score() == 1.0
    assert (tmp_path / "ws2" / "answer.txt").read_text() == f"{a + b}\n"


def test_partial_credit_for_reads_format_and_a_wrong_answer(tmp_path):
    env = _fast(2)
    _, steps = _play(env, tmp_path / "a", ["read data0.txt", "write answer.txt 1000"])
    # exact commands 2/2 -> 0.1, one of two files read -> 0.15, an integer answer -> 0.1
    assert steps[-1].done and steps[-1].reward == pytest.approx(0.35)

    env = _fast(2)
    _, steps = _play(env, tmp_path / "b", ["read data0.txt data1.txt\nhello there"])
    assert "invalid: hello there" in steps[0].observation
    assert "Commands: read data0.txt data1.txt" in steps[0].observation
    assert not steps[0].done and env.score() == pytest.approx(0.05 + 0.3)

    env = _fast(2)  # prose around the command: read, but not an exact command
    _, steps = _play(env, tmp_path / "c", ["Sure! I will Read `data1.txt`, then the rest."])
    assert steps[0].observation.startswith("data1.txt: ")
    assert env.score() == pytest.approx(0.15)

    env = _fast(2)  # no command at all, and nothing at all
    _, steps = _play(env, tmp_path / "d", ["The sum is easy to compute."])
    assert env.score() == 0.0
    env = _fast(2)
    _, steps = _play(env, tmp_path / "e", ["   \n"])
    assert steps[0].observation.startswith("no command") and env.score() == 0.0


def test_right_sum_in_a_sloppy_line_still_scores_one(tmp_path):
    env = _fast(5)
    ws = tmp_path / "ws"
    asyncio.run(env.reset(ws))
    total = sum(_numbers(ws, env))
    env = _fast(5)
    _, steps = _play(env, ws, [f"I write answer.txt: {total}, done"])
    assert steps[0].done and steps[0].reward == 1.0
    a, b = _numbers(ws, env)
    lines = [f"write {a + b} to answer.txt", f"write answer.txt {a} + {b} = {a + b}"]
    for i, line in enumerate(lines):
        env = _fast(5)
        _, steps = _play(env, tmp_path / f"v{i}", [line])
        assert steps[0].reward == 1.0 and env.counts.exact_commands == i  # only the second is exact
    env = _fast(5)  # the last integer is the answer: a wrong result after the right one fails
    _, steps = _play(env, tmp_path / "w", [f"write answer.txt {a + b} or {a + b + 1}"])
    assert steps[0].reward == pytest.approx(0.2)


def test_bad_commands_and_path_escapes_are_refused(tmp_path):
    env = _fast(3)
    ws = tmp_path / "w" / "ws"
    ws.mkdir(parents=True)
    (tmp_path / "w" / "secret.txt").write_text("42\n")
    _, steps = _play(
        env,
        ws,
        [
            "read ../secret.txt /etc/passwd",
            "write ../evil.txt 5\nwrite data0.txt 99\nwrite answer.txt",
            "readme please\nls\nWrite the sum to answer.txt.",
        ],
    )
    obs = [s.observation for s in steps]
    assert "no such file" in obs[0] and "42" not in obs[0] and "root" not in obs[0]
    assert obs[1].count("only new files") == 2 and "invalid: write answer.txt" in obs[1]
    assert not (tmp_path / "w" / "evil.txt").exists()
    assert (ws / "data0.txt").read_text() != "99\n" and not (ws / "answer.txt").exists()
    assert obs[2].splitlines()[:3] == [
        "invalid: readme please",
        "data0.txt data1.txt",
        "write: answer.txt needs a NUMBER",
    ]
    assert not any(s.done for s in steps)
    # 7 command lines, one exact (ls), nothing read, no answer
    assert env.score() == pytest.approx(0.1 / 7, abs=1e-6)


def test_commands_per_turn_are_capped_and_done_ends(tmp_path, monkeypatch):
    monkeypatch.setattr(bt, "MAX_COMMANDS", 2)
    env = _fast(4)
    _, steps = _play(env, tmp_path / "ws", ["ls\nls\nread data0.txt", "done\nread data1.txt"])
    assert steps[0].observation.count("data0.txt") == 2 and env.counts.read_files == []
    assert steps[1].done and steps[1].observation == "done"
    assert steps[1].reward == pytest.approx(0.1) and env.counts.commands == 3


def test_workspace_tasks_are_deterministic_per_seed(tmp_path):
    rows = [bt.workspace_row(7) for _ in range(2)]
    assert rows[0] == rows[1] and len(rows[0].metadata["workspace_files"]) == 2
    numbers = [int(t) for t in rows[0].metadata["workspace_files"].values()]
    assert sum(numbers) == rows[0].answer
    others = [bt.workspace_row(s).metadata["workspace_files"] for s in range(8, 14)]
    assert any(o != rows[0].metadata["workspace_files"] for o in others)


def test_tool_latency_is_long_tailed_seeded_and_replayed(tmp_path, monkeypatch):
    monkeypatch.setattr(bt, "LATENCY_CAP_S", 1e9)
    rng = random.Random(0)
    draws = sorted(0.3 * rng.lognormvariate(0, bt.LATENCY_SIGMA) for _ in range(2000))
    assert 0.2 < draws[1000] < 0.45 and draws[1980] > 10 * draws[1000]
    # the k-th command of an execution waits the k-th draw of its group's latency stream
    row = bt.workspace_row(3, tool_latency_s=0.3)
    stream = random.Random(row.metadata["latency_seed"])
    want = [0.3 * stream.lognormvariate(0, bt.LATENCY_SIGMA) for _ in range(3)]
    ep = bt.Episode(row, tmp_path)
    got = []
    for k in range(3):
        ep.counts.commands = k
        got.append(ep._latency_s())
    assert got == want


def test_arithmetic_task_checks_the_sum():
    row = bt.arithmetic_row(3)
    assert "plus" in row.messages[-1]["content"]
    assert row.messages[0] == {"role": "system", "content": bt.ARITHMETIC_PROMPT}
    assert bt.arithmetic_step(row, str(row.answer)) == {
        "observation": "",
        "done": True,
        "reward": 1.0,
    }
    assert bt.arithmetic_reward(row, "no idea") == 0.0
    assert bt.arithmetic_reward(row, f"{row.answer} or {row.answer + 1}") == 1.0


def test_registry_closes_exactly_once_and_emits_events():
    from tidal.errors import LedgerError

    log = EventLog()
    reg = ExecutionRegistry(log)
    st = reg.dispatch("g1")
    assert reg.close(st.execution_id, "timeout", 0.2)
    assert not reg.close(st.execution_id, "completed", 1.0) and reg.duplicate_closes == 1
    kinds = [e[0] for e in log.events]
    assert kinds == ["dispatched", "launched", "closed"]
    assert log.events[-1][3:] == ("timeout", 0.2)
    with pytest.raises(LedgerError):
        reg.close("nope")
    with pytest.raises(LedgerError):
        reg.close(st.execution_id, "exploded")


def test_a_sampled_name_with_a_nul_byte_is_no_such_file(tmp_path):
    """A model can sample any byte; a name the OS refuses is an observation, never a failed
    execution (the chaos soak found one: ``embedded null byte``)."""
    env = _fast(4)
    ws = tmp_path / "ws"
    ws.mkdir()
    _, steps = _play(env, ws, ["read data\x000.txt", "write ans\x00wer.txt 5"])
    assert "no such file" in steps[0].observation
    assert not steps[1].done and not (ws / "answer.txt").exists()


def test_the_builtin_sources_behave_as_the_environments_they_replaced(tmp_path, monkeypatch):
    """``tests/fixtures/builtin_tasks_before.json`` holds what the former ``WorkspaceTask`` and
    ``ArithmeticTask`` (``agents/environments.py``, main at f1516d2) gave for 24 seeds and
    scripted answers: prompts, observations, ends, scores and each command's tool latency. The
    task sources, run turn by turn as the chat kind runs them, give the same."""
    import json
    from pathlib import Path

    before = json.loads(
        (Path(__file__).parents[2] / "fixtures" / "builtin_tasks_before.json").read_text()
    )
    waits: list[float] = []

    async def no_wait(delay_s):
        waits.append(delay_s)

    monkeypatch.setattr(bt.asyncio, "sleep", no_wait)
    monkeypatch.setattr(bt, "LATENCY_CAP_S", 5.0)
    for case in before["workspace"]:
        row = bt.workspace_row(case["seed"], tool_latency_s=0.15)
        assert row.messages == [
            {"role": "system", "content": case["system"]},
            {"role": "user", "content": case["first"]},
        ]
        ws = tmp_path / f"ws{case['seed']}"
        ws.mkdir()
        for name, text in row.metadata["workspace_files"].items():
            (ws / name).write_text(text)
        waits.clear()
        steps = []
        for action in case["actions"]:
            out = asyncio.run(bt.workspace_step(row, action, ws))
            steps.append([out["observation"], out["done"]])
            if out["done"]:
                break
        assert steps == case["steps"], case["seed"]
        assert bt.workspace_reward(row, ws) == case["score"]
        assert waits == case["latencies_s"]
    for case in before["arithmetic"]:
        row = bt.arithmetic_row(case["seed"])
        assert row.messages[0]["content"] == case["system"]
        assert row.messages[1]["content"] == case["prompt"] and row.answer == case["sum"]
        assert bt.arithmetic_step(row, str(case["sum"]))["reward"] == case["right"]
