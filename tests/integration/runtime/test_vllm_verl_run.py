"""``tidal run configs/vllm-verl.yaml`` (``make test-vllm-run``): verl's default policy on hybrid
cells whose engines are real vLLM servers, next to a vLLM standalone engine.

Checks: the run completes with activations and deactivations, nothing failed or lost, no plan
aborted, every engine vLLM and never restarted (one server per cell for the whole run), and
verl's step order in the decision log: every deactivation removes the cells from the load
balancer, aborts their in-flight calls (continued elsewhere), sleeps the engines and restores
training state, in that order; every activation offloads training state, wakes the engines,
syncs the weights (loaded in place, read back), adds them to the load balancer and resumes
generation, in that order.

Skipped unless ``TIDAL_VLLM_PYTHON`` names the vLLM venv's python.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tidal.cli import main
from tidal.control.plans import VERL_ACTIVATE, VERL_DEACTIVATE, StepKind

VLLM_PYTHON = os.environ.get("TIDAL_VLLM_PYTHON")
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not VLLM_PYTHON, reason="set TIDAL_VLLM_PYTHON (make test-vllm)"),
]
CONFIG = Path(__file__).resolve().parents[3] / "configs" / "vllm-verl.yaml"


@pytest.mark.timeout(900)
def test_verl_default_on_hybrid_vllm_cells(smollm2, tmp_path):
    out = tmp_path / "run"
    assert main(["run", str(CONFIG), "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    print(
        "summary:",
        json.dumps(
            {
                k: s[k]
                for k in (
                    "run_time_s",
                    "switches_to_training",
                    "switches_to_rollout",
                    "rerouted_requests",
                    "switch_s",
                    "reprefill_tokens",
                    "engine_memory",
                )
            }
        ),
    )
    assert s["policy"] == "verl-default"
    assert s["switches_to_rollout"] >= 1 and s["switches_to_training"] >= 1
    assert s["failed_requests"] == 0 and s["lost_executions"] == 0 and s["plans_aborted"] == 0
    assert s["backend_by_engine"] == {"s0": "vllm", "c0": "vllm", "c1": "vllm"}
    assert all(e["restarted"] is False for e in s["engines"].values()), s["engines"]
    lines = [json.loads(x) for x in (out / "decisions.jsonl").read_text().splitlines()]
    done: dict[int, list[str]] = {}
    for rec in lines:
        if rec.get("type") == "step_done":
            done.setdefault(rec["plan_id"], []).append(rec["step"])
    orders = {tuple(steps) for steps in done.values()}
    want = {
        tuple(k.value for k in VERL_DEACTIVATE),  # verl's rebalance is off by default
        tuple(k.value for k in VERL_ACTIVATE if k is not StepKind.REBALANCE),
    }
    assert orders == want, orders
    steps = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    assert steps and all(st["ok"] for st in steps), [st for st in steps if not st["ok"]]
