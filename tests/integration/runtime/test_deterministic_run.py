"""``runtime.deterministic``: two seeded runs of ``configs/tiny.yaml`` with it on are
token-identical end to end: every execution's completion, prompt and output token ids, log-probs
and weight versions, its reward, every step's groups, loss and gradient norm, and the final
published weights bit for bit, although cells move while calls run (drains, KV handoffs) and
the two runs' timings differ.

The task is tiny.yaml's single-turn arithmetic prompts scored by a reward that varies from
sample to sample (the share of digits in the answer: the random tiny model never answers a sum
right, and all-equal rewards would give zero advantages and leave the weights untouched)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from tidal.cli import main

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml"
REWARD = '''
def digits(answer: str) -> float:
    """The share of digits in the answer: varies per sample, so GRPO has a signal."""
    return sum(c.isdigit() for c in answer) / max(1, len(answer))
'''


def _config(tmp: Path) -> Path:
    rows = [
        {"prompt": f"What is {a} + {b}? Answer with the number.", "answer": str(a + b)}
        for a, b in ((2, 3), (14, 9), (7, 31), (40, 2), (5, 55), (12, 12))
    ]
    (tmp / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "digits.py").write_text(REWARD)
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["task"] = {
        "source": {
            "kind": "jsonl",
            "path": str(tmp / "rows.jsonl"),
            "prompt": "prompt",
            "answer": "answer",
        },
        "reward": {"function": f"{tmp / 'digits.py'}:digits"},
    }
    path = tmp / "tiny-digits.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _executions(out: Path) -> dict[str, dict]:
    lines = [json.loads(x) for x in (out / "executions.jsonl").read_text().splitlines()]
    keep = ("prompt_token_ids", "token_ids", "logprobs", "versions")
    return {
        x["execution"]: {
            "reason": x["reason"],
            "reward": x["reward"],
            "transcript": x["transcript"],
            "calls": [{k: c[k] for k in keep} for c in x["calls"]],
        }
        for x in lines
    }


def _steps(out: Path) -> list[dict]:
    keep = ("step", "version", "groups", "mean_reward", "loss", "grad_norm", "n_tokens")
    return [
        {k: m[k] for k in keep}
        for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    ]


def test_two_deterministic_runs_are_identical(tmp_path):
    cfg = _config(tmp_path)
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        assert (
            main(
                [
                    "run",
                    str(cfg),
                    "--out",
                    str(out),
                    "--set",
                    "runtime.deterministic=true",
                    "--set",
                    "runtime.keep_weights=1",
                ]
            )
            == 0
        )
    a, b = (json.loads((o / "summary.json").read_text()) for o in outs)
    for s in (a, b):
        assert s["deterministic"] is True and s["deterministic_boundaries"] == 2
        assert s["deterministic_hold_s"] >= 0 and s["failed_requests"] == 0
        assert s["satellite_joins"] == 0  # the core computes every micro-step
        assert s["switches_to_training"] >= 1  # cells moved while the runs went on
    ea, eb = _executions(outs[0]), _executions(outs[1])
    assert len(ea) == 48 and ea.keys() == eb.keys()
    for eid in ea:
        assert ea[eid] == eb[eid], eid
    calls = [c for e in ea.values() for c in e["calls"]]
    assert all(len(c["token_ids"]) == len(c["logprobs"]) > 0 for c in calls)
    # the hold: every token of burst b came from the version published before it (v0, v2)
    for eid, e in ea.items():
        burst = int(eid.split("-")[0][1:])
        assert {v for c in e["calls"] for v in c["versions"]} == {f"v{2 * burst}"}, eid
    assert len({e["reward"] for e in ea.values()}) > 1  # a signal to train on
    sa, sb = _steps(outs[0]), _steps(outs[1])
    assert len(sa) == 4 and sa == sb
    assert all(s["grad_norm"] > 0 for s in sa)
    # groups train in dispatch order, whatever order they closed in
    assert [g for s in sa for g in s["groups"]] == [f"b{b}-g{g}" for b in (0, 1) for g in range(6)]
    wa, wb = (load_file(str(o / "weights" / "v4.safetensors")) for o in outs)
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa), [
        k for k in wa if not torch.equal(wa[k], wb[k])
    ]
    first = load_file(str(next((outs[0] / "model").glob("*.safetensors"))))
    assert any(not torch.equal(wa[k], first[k]) for k in wa if k in first)  # it trained
