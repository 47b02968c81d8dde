"""The run's own agents through the proxy and real engines: a black-box ``command`` agent (a
plain shell script with curl, no tidal code) and the shipped ``python`` agent example
(``AsyncOpenAI``), each execution identified by its own base URL / key, every model call
recorded under its execution, the verl reward file scoring what the agent printed."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx

from tidal.agents import EventLog, HarnessPool, PoolConfig
from tidal.agents.workload import Workload
from tidal.config import RunConfig

ROOT = Path(__file__).parents[3]
FIXTURES = ROOT / "tests" / "fixtures" / "agents"


def _workload(agent: dict, reward: dict | None) -> Workload:
    return Workload(
        RunConfig.model_validate(
            {
                "control": {
                    "group_size": 2,
                    "batch_groups": 2,
                    "updates_per_burst": 1,
                    "bursts": 1,
                },
                "task": {
                    "source": {
                        "kind": "jsonl",
                        "path": str(FIXTURES / "tasks.jsonl"),
                        "prompt": "question",
                        "answer": "answer",
                    },
                    "reward": reward,
                    "agent": agent,
                },
            }
        )
    )


def _run(cluster, tmp_path, workload: Workload, events: EventLog):
    pool = HarnessPool(
        PoolConfig(proxy_url=cluster.url, max_tokens_per_turn=8, timeout_s=60, token=cluster.token),
        tmp_path,
        events,
    )
    tasks, ids = [], []
    for g in range(2):
        job = workload.job(0, g, seed=g)
        for e in range(2):
            tasks.append((f"b0-g{g}", job))
            ids.append(f"{tmp_path.name[:20]}-g{g}-e{e}")
    return asyncio.run(pool.run(tasks, ids))


def _calls(cluster, eid: str) -> list[dict]:
    return httpx.get(f"{cluster.url}/tidal/executions/{eid}/records", headers=cluster.admin).json()[
        "calls"
    ]


def test_a_shell_script_with_curl_is_an_agent(cluster, tmp_path):
    events = EventLog()
    workload = _workload(
        {"kind": "command", "command": [str(FIXTURES / "curl_agent.sh"), "{prompt}"]},
        {"function": f"{FIXTURES / 'verl_reward.py'}:compute_score"},
    )
    results = _run(cluster, tmp_path, workload, events)
    for r in results:
        assert (r.outcome.reason, r.outcome.exit_code) == ("completed", 0), (
            r,
            ((tmp_path / r.execution_id) / ".tidal" / "stderr.log").read_text(),
        )
        assert r.outcome.reward in (0.0, 0.1, 1.0)
        calls = _calls(cluster, r.execution_id)
        assert len(calls) == 2  # both curl calls, counted to this execution by its key
        assert all(c["segments"] and c["segments"][0]["token_ids"] for c in calls)
        second = json.loads(((tmp_path / r.execution_id) / "turn2.json").read_text())
        assert second["choices"][0]["message"]["content"] is not None
        outcome = (tmp_path / r.execution_id) / ".tidal" / "outcome.json"
        assert json.loads(outcome.read_text())["exit_code"] == 0
    assert [e[0] for e in events.events].count("closed") == 4


def test_the_python_agent_example_runs_with_asyncopenai(cluster, tmp_path):
    events = EventLog()
    workload = _workload(
        {"kind": "python", "function": f"{ROOT / 'examples' / 'agents' / 'python_agent.py'}:solve"},
        {"builtin": "exact"},
    )
    results = _run(cluster, tmp_path, workload, events)
    for r in results:
        assert r.outcome.reason == "completed" and r.outcome.reward in (0.0, 1.0), r
        assert len(_calls(cluster, r.execution_id)) == 2
        assert ((tmp_path / r.execution_id) / "answer.txt").is_file()
    closed = [e for e in events.events if e[0] == "closed"]
    assert len(closed) == 4 and {e[3] for e in closed} == {"completed"}


def test_the_chat_loop_takes_the_environment_feedback_of_a_step_function(cluster, tmp_path):
    events = EventLog()
    workload = _workload({"kind": "chat", "step": f"{FIXTURES / 'guess_env.py'}:step"}, None)
    pool = HarnessPool(
        PoolConfig(
            proxy_url=cluster.url,
            max_turns=5,
            max_tokens_per_turn=8,
            timeout_s=60,
            token=cluster.token,
        ),
        tmp_path,
        events,
    )
    job = workload.job(0, 0, seed=0)
    (result,) = asyncio.run(pool.run([("b0-g0", job)], [f"{tmp_path.name[:20]}-chat"]))
    out = result.outcome
    assert out.reason == "completed" and out.reward in (0.25, 1.0)
    assert out.turns == 3  # the step ended the episode at its third answer, not max_turns
    assert out.transcript[0].observation.startswith("Not yet")
    calls = _calls(cluster, result.execution_id)
    assert len(calls) == 3
    # each call's prompt extends the previous one: the feedback went back to the model
    assert len(calls[2]["prompt_token_ids"]) > len(calls[1]["prompt_token_ids"])
