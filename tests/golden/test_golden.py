"""Golden simulator runs: each scenario, scaled down with its fixed seed, reproduces its
committed decision log; every DESIGN.md invariant the world can see is checked after every
simulated event (``check=True``).

Regenerate after an intended behaviour change (and review the diff):
    TIDAL_REGEN_GOLDEN=1 .venv/bin/python -m pytest tests/golden
"""

import json
import os
from pathlib import Path

import pytest

from tidal.sim.runner import run_policy
from tidal.sim.scenario import load

DATA = Path(__file__).parent / "data"
CASES = {  # scenario: (scale factor, bursts)
    "dapo-math-32gpu": (1.0, 3),
    "mixed": (1.0, 2),
    "swe-agent-long-tail": (0.25, 2),
    "qwengyre-long-tail": (0.25, 2),
}
POLICIES = ("verl-default", "waterlevel", "tidal")


def golden_lines(scenario: str, policy: str) -> list[dict]:
    factor, bursts = CASES[scenario]
    res = run_policy(load(scenario).scaled(factor, bursts=bursts), policy, check=True)
    s = res.summary
    tail = {
        "type": "summary",
        **{
            k: s[k]
            for k in (
                "makespan_s",
                "switches",
                "reroutes",
                "reprefill_tokens",
                "trainer_steps",
                "dispatched",
                "finished",
            )
        },
    }
    # the decisions and plans; plan steps and weight publications (records for trace.json) are
    # left out so the committed logs stay the decisions a change of policy would move
    records = [r for r in res.records if r["type"] not in ("step_done", "weights_published")]
    return [json.loads(json.dumps(r, sort_keys=True)) for r in [*records, tail]]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("scenario", sorted(CASES))
def test_reproduces_committed_decision_log(scenario, policy):
    path = DATA / f"{scenario}__{policy}.jsonl"
    got = golden_lines(scenario, policy)
    if os.environ.get("TIDAL_REGEN_GOLDEN"):
        DATA.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in got))
        pytest.skip(f"regenerated {path.name}")
    want = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert len(got) == len(want), f"{path.name}: {len(got)} records, committed {len(want)}"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"{path.name}: record {i} differs"
    if scenario == "dapo-math-32gpu":
        assert any(r.get("action") not in (None, "hold") for r in got), "no move in the log"
