from __future__ import annotations

import asyncio
import random

import pytest

from tidal.agents import ArithmeticTask, EventLog, ExecutionRegistry, WorkspaceTask
from tidal.agents.environments import ToolLatency


def _fast(seed, **kw):
    return WorkspaceTask(seed, ToolLatency(random.Random(seed), median_s=0.001, cap_s=0.01), **kw)


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
    (first,), steps = _play(env2, tmp_path / "ws2",
                            ["read data0.txt data1.txt", f"write answer.txt {a + b}", "ls"])
    assert "data0.txt" in first and "answer.txt" in first
    assert steps[0].observation.splitlines() == [f"data0.txt: {a}", f"data1.txt: {b}",
                                                 "Now write their sum to answer.txt."]
    assert not steps[0].done and steps[0].reward == 0.0
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
        assert steps[0].reward == 1.0 and env.exact_commands == i  # only the second is exact
    env = _fast(5)  # the last integer is the answer: a wrong result after the right one fails
    _, steps = _play(env, tmp_path / "w", [f"write answer.txt {a + b} or {a + b + 1}"])
    assert steps[0].reward == pytest.approx(0.2)


def test_bad_commands_and_path_escapes_are_refused(tmp_path):
    env = _fast(3)
    ws = tmp_path / "w" / "ws"
    ws.mkdir(parents=True)
    (tmp_path / "w" / "secret.txt").write_text("42\n")
    _, steps = _play(env, ws, ["read ../secret.txt /etc/passwd",
                               "write ../evil.txt 5\nwrite data0.txt 99\nwrite answer.txt",
                               "readme please\nls\nWrite the sum to answer.txt."])
    obs = [s.observation for s in steps]
    assert "no such file" in obs[0] and "42" not in obs[0] and "root" not in obs[0]
    assert obs[1].count("only new files") == 2 and "invalid: write answer.txt" in obs[1]
    assert not (tmp_path / "w" / "evil.txt").exists()
    assert (ws / "data0.txt").read_text() != "99\n" and not (ws / "answer.txt").exists()
    assert obs[2].splitlines()[:3] == ["invalid: readme please", "data0.txt data1.txt",
                                       "write: answer.txt needs a NUMBER"]
    assert not any(s.done for s in steps)
    # 7 command lines, one exact (ls), nothing read, no answer
    assert env.score() == pytest.approx(0.1 / 7, abs=1e-6)


def test_commands_per_turn_are_capped_and_done_ends(tmp_path):
    env = _fast(4, max_commands=2)
    _, steps = _play(env, tmp_path / "ws", ["ls\nls\nread data0.txt", "done\nread data1.txt"])
    assert steps[0].observation.count("data0.txt") == 2 and env.read_files == set()
    assert steps[1].done and steps[1].observation == "done"
    assert steps[1].reward == pytest.approx(0.1) and env.commands == 3


def test_workspace_tasks_are_deterministic_per_seed(tmp_path):
    contents = []
    for i in range(2):
        env = _fast(7, n_files=3, max_number=50)
        asyncio.run(env.reset(tmp_path / f"ws{i}"))
        contents.append((_numbers(tmp_path / f"ws{i}", env), env.expected))
    assert contents[0] == contents[1] and len(contents[0][0]) == 3
    assert sum(contents[0][0]) == contents[0][1]
    other = _fast(8, n_files=3, max_number=50)
    asyncio.run(other.reset(tmp_path / "ws9"))
    assert _numbers(tmp_path / "ws9", other) != contents[0][0]


def test_tool_latency_is_long_tailed_and_seeded():
    lat = ToolLatency(random.Random(0), median_s=0.3, sigma=1.5, cap_s=1e9)
    draws = sorted(lat.median_s * lat.rng.lognormvariate(0, lat.sigma) for _ in range(2000))
    assert 0.2 < draws[1000] < 0.45 and draws[1980] > 10 * draws[1000]
    assert WorkspaceTask(0, latency_median_s=0.1).latency.median_s == 0.1


def test_arithmetic_task_checks_the_sum(tmp_path):
    async def main():
        env = ArithmeticTask(3)
        q = await env.reset(tmp_path)
        assert (await env.step(str(env.a + env.b))).reward == 1.0
        assert (await env.step("no idea")).reward == 0.0
        return q

    assert "plus" in asyncio.run(main())


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
