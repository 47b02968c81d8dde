"""The rollout floor: a policy's makespan with its training made (almost) free.

In: a scenario and a policy spec. Out: the makespan of the same run (same mechanics, same
seeded workload) with every cost-model trainer doing ``1 / speedup`` of its FLOPs per token
(default 100: training ~free). The oracle bound (``tidal.sim.oracle``) is clairvoyant; this
floor is not: what is left of the makespan when training costs nothing is what the policy's
rollout side (dispatch, the version budget, the stragglers of each version) costs, so a
policy cannot beat it by scheduling training better. Tables print it beside the makespan, the
oracle ratio and the ratio to the best other policy (``tidal simulate``, ``tidal demo``,
``benchmarks/rollout_floor.py``, ``benchmarks/policy_robustness.py``). Scenarios without a
cost model have no FLOPs to scale: ``floor_makespan_s`` returns None.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from tidal.sim import perf
from tidal.sim.runner import run_policy
from tidal.sim.scenario import Scenario

SPEEDUP = 100.0


@contextlib.contextmanager
def faster_training(k: float) -> Iterator[None]:
    """Within the block, every cost-model trainer does 1/k of the FLOPs per token."""
    real = perf.train_flops_per_token
    perf.train_flops_per_token = lambda cm: real(cm) / k  # type: ignore[assignment]
    try:
        yield
    finally:
        perf.train_flops_per_token = real  # type: ignore[assignment]


def floor_makespan_s(scenario: Scenario, spec: str, speedup: float = SPEEDUP) -> float | None:
    """``spec``'s makespan on ``scenario`` with training ``speedup`` times cheaper; None
    without a cost model."""
    if scenario.costmodel is None:
        return None
    with faster_training(speedup):
        return float(run_policy(scenario, spec, keep_log=False).summary["makespan_s"])
