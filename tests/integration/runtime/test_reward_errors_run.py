"""Issue 38 (4, 5, 6): a real ``tidal run`` (``configs/tiny.yaml``, one small burst) goes on
past rewards that fail. The rule (``tidal.control.ledger``): a ``reward_error`` member trains
nowhere and has no reward (null in ``executions.jsonl``, never 0.0), its group trains on its
scored members, a group with fewer than 2 scored members is dropped, and the step that would
have trained it trains the groups there are; ``summary.json`` counts both.

- ``raising``: the reward raises for member e1 of every group, and for e2 and e3 of group g0
  too (so g0 has one scored member and is dropped; the burst's second step trains 1 group).
- ``huge``: a Python agent (one model call) returns NaN as its reward for member e0, and the
  reward function gives member e1 1e308 (finite: its group's advantages stay finite)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import yaml

from tidal.cli import main

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml"
REWARD = """
def reward(answer: str, workspace) -> float:
    group, member = workspace.name.split("-")[1:]  # the workspace is named b<n>-g<n>-e<n>
    if member == "e1" or (group == "g0" and member in ("e2", "e3")):
        raise ValueError(f"no score for {workspace.name}")
    return sum(c.isdigit() for c in answer) / max(1, len(answer))
"""
HUGE = """
def reward(workspace) -> float:
    member = int(workspace.name.rsplit("-e", 1)[1])
    return 1e308 if member == 1 else 0.25 * member
"""
AGENT = """
async def run(client, model, row, workspace):
    out = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": row.text()}], max_tokens=8)
    if workspace.name.endswith("-e0"):
        return float("nan")
    return out.choices[0].message.content or ""
"""


def _config(tmp: Path, kind: str) -> Path:
    rows = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in ((2, 3), (4, 9))]
    (tmp / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["control"].update(bursts=1, batch_groups=2, updates_per_burst=2)
    task = {
        "source": {
            "kind": "jsonl",
            "path": str(tmp / "rows.jsonl"),
            "prompt": "prompt",
            "answer": "answer",
        }
    }
    if kind == "raising":
        (tmp / "reward.py").write_text(REWARD)
    else:
        (tmp / "reward.py").write_text(HUGE)
        (tmp / "agent.py").write_text(AGENT)
        task["agent"] = {"kind": "python", "function": f"{tmp / 'agent.py'}:run"}
    task["reward"] = {"function": f"{tmp / 'reward.py'}:reward"}
    cfg["task"] = task
    path = tmp / f"tiny-{kind}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["raising", "huge"])
def test_a_run_goes_on_past_failing_rewards(tmp_path, kind):
    out = tmp_path / "run"
    t0 = time.monotonic()
    assert main(["run", str(_config(tmp_path, kind)), "--out", str(out)]) == 0
    print(f"{kind}: tidal run took {time.monotonic() - t0:.1f} s")
    s = json.loads((out / "summary.json").read_text())
    lines = [json.loads(x) for x in (out / "executions.jsonl").read_text().splitlines()]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    errors = {x["execution"] for x in lines if x["reason"] == "reward_error"}
    assert all(x["reward"] is None for x in lines if x["execution"] in errors)
    assert all(x["reward"] is not None for x in lines if x["execution"] not in errors)
    assert s["dispatched"] == s["closed"] == 16 and s["lost_executions"] == 0
    assert s["reward_errors"] == s["close_reasons"]["reward_error"] == len(errors)
    assert s["trainer_steps"] == 2 and all(math.isfinite(m["loss"]) for m in metrics)
    trained = [g for m in metrics for g in m["groups"]]
    if kind == "raising":
        assert len(errors) == 6 and s["groups_dropped"] == 1
        assert sorted(trained) == ["b0-g1", "b0-g2", "b0-g3"]  # g0: one scored member
        assert [m["n_groups"] for m in metrics] == [2, 1]
        assert s["trained_executions"] == 9
    else:
        assert errors == {f"b0-g{g}-e0" for g in range(4)} and s["groups_dropped"] == 0
        assert {x["reward"] for x in lines if x["execution"].endswith("-e1")} == {1e308}
        assert sorted(trained) == [f"b0-g{g}" for g in range(4)]
        assert s["trained_executions"] == 12
        assert all(math.isfinite(m["grad_norm"]) for m in metrics)
