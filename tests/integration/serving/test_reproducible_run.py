"""Two seeded runs give identical completions and rewards (issue 19, item 7).

The smallest real path of a one-engine ``tiny.yaml`` run: the run's tasks (``plan_burst`` and
the ``Workload``'s job: task choice and tool latency from the seed and the group), the real harness
pool, a fresh proxy over HTTP per run stamping each call's seed from (run seed, execution id,
call index), one built-in engine process. The two runs are served by two engine processes
with different engine seeds (an engine's own stream must not matter); a run with another run
seed must differ, or the test proves nothing.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from tidal.agents import HarnessPool, PoolConfig
from tidal.agents.workload import Workload
from tidal.config import TaskConfig, load_yaml
from tidal.runtime.dispatcher import plan_burst
from tidal.serving.launch import start_engine, start_proxy

TOKEN = "repro-token"
CONFIG = Path(__file__).parents[3] / "configs" / "tiny.yaml"


def _config(seed: int, task: str):
    cfg = load_yaml(CONFIG)
    source = {"kind": task, **({"tool_latency_s": 0.01} if task == "workspace" else {})}
    return cfg.model_copy(
        update={
            "seed": seed,
            "runtime": cfg.runtime.model_copy(update={"max_tokens": 24}),
            "task": TaskConfig.model_validate(
                {"source": source, "max_turns": 3 if task == "workspace" else 1}
            ),
            "cluster": cfg.cluster.model_copy(update={"cell_count": 0, "standalone_count": 1}),
        }
    )


def _run(engine_url: str, logs: Path, seed: int, tag: str) -> dict[str, tuple]:
    """The first group of burst 0 of the arithmetic run and of the workspace run, through a
    fresh proxy: per execution, its reward, the texts it received and the token ids the
    proxy recorded."""
    proxy = start_proxy(
        [],
        [engine_url],
        TOKEN,
        require_registration=True,
        seed=seed,
        log_path=logs / f"proxy-{tag}.log",
    ).wait_healthy(60)
    try:
        out: dict[str, tuple] = {}
        for task in ("arithmetic", "workspace"):
            cfg = _config(seed, task)
            rt = cfg.runtime
            pool = HarnessPool(
                PoolConfig(
                    proxy_url=proxy.url,
                    max_turns=cfg.task.max_turns,
                    max_tokens_per_turn=rt.max_tokens,
                    temperature=rt.temperature,
                    token=TOKEN,
                ),
                logs / f"ws-{tag}-{task}",
            )
            _, groups = plan_burst(cfg, 0, set(), {})
            tasks, ids = [], []
            for grp in groups[:1]:  # one GRPO group of each task
                job = Workload(cfg).job(0, grp.index, grp.seed)
                tasks += [(grp.group_id, job)] * len(grp.run)
                ids += [f"{task}-{e}" for e in grp.run]
            for r in asyncio.run(pool.run(tasks, ids)):
                assert r.outcome.reason == "completed", r
                calls = httpx.get(
                    f"{proxy.url}/tidal/executions/{r.execution_id}/records",
                    headers={"Authorization": f"Bearer {TOKEN}"},
                ).json()["calls"]
                out[r.execution_id] = (
                    r.outcome.reward,
                    [t.action for t in r.outcome.transcript],
                    [c["output_token_ids"] for c in calls],
                )
        return out
    finally:
        proxy.stop()


def test_two_seeded_runs_give_identical_completions_and_rewards(tiny_model, tmp_path):
    # two engines, each with its own engine seed (the stream of unseeded requests)
    engines = [
        start_engine(
            tiny_model, log_path=tmp_path / f"engine-{s}.log", seed=s, max_batch=8, token=TOKEN
        )
        for s in (1, 2)
    ]
    try:
        for e in engines:
            e.wait_healthy(120)
        first = _run(engines[0].url, tmp_path, seed=0, tag="a")
        second = _run(engines[1].url, tmp_path, seed=0, tag="b")
        other = _run(engines[0].url, tmp_path, seed=1, tag="c")
    finally:
        for e in engines:
            e.stop()
    assert len(first) == 4 + 4
    assert any(len(calls) > 1 for _, _, calls in first.values())  # multi-turn: call index > 0
    assert first == second
    # the executions of a group got one problem but their own streams
    group = [first[f"arithmetic-b0-g0-e{k}"][2] for k in range(4)]
    assert len({str(g) for g in group}) == 4
    assert [v[2] for v in other.values()] != [v[2] for v in first.values()]
