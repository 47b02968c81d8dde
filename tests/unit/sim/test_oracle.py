"""The oracle is a lower bound for every registered policy, and no weaker than before.

Each shipped scenario runs scaled down (as the golden runs are) with several seeds; the
workload, the candidate groups and the bound all change with the seed.
"""

import math

import pytest

from tidal.control.policy import registered
from tidal.sim.oracle import (
    lower_hull,
    min_train_gpus,
    oracle_bound,
    pipeline_bound,
    training_configs,
)
from tidal.sim.runner import run_policy
from tidal.sim.scenario import load
from tidal.testing.sim_scenarios import tiny_scenario

CASES = {  # scenario: (scale factor, bursts)
    "dapo-math-32gpu": (0.5, 3),
    "mixed": (0.5, 2),
    "swe-agent-long-tail": (0.25, 2),
}
SEEDS = (1, 2, 3)


def specs(cells: int) -> list[str]:
    out = []
    for name in sorted(registered()):
        out += sorted({"static:cells=1", f"static:cells={cells}"}) if name == "static" \
            else [name]
    return out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scenario", sorted(CASES))
def test_no_policy_finishes_below_the_bound(scenario, seed):
    factor, bursts = CASES[scenario]
    sc = load(scenario).scaled(factor, bursts=bursts).model_copy(update={"seed": seed})
    bound = oracle_bound(sc)
    assert bound.makespan_s >= bound.legacy_s > 0
    assert bound.makespan_s == max(bound.work_s, bound.critical_path_s, bound.slots_s,
                                   bound.trainer_lp_s, bound.pipeline_s)
    for spec in specs(len(sc.cluster.cell_specs())):
        makespan = run_policy(sc, spec, oracle=bound, keep_log=False).summary["makespan_s"]
        assert makespan >= bound.makespan_s, (spec, makespan, bound)


def test_the_new_bounds_tighten_dapo_math():
    bound = oracle_bound(load("dapo-math-32gpu").scaled(1.0, bursts=6))
    assert bound.trainer_lp_s > bound.work_s
    assert bound.makespan_s > bound.legacy_s


def test_training_hull_time_shares_cells():
    sc = tiny_scenario()
    configs = training_configs(sc)  # two 8-GPU cells, 90 % per doubling
    (r1, g1), (r2, g2) = configs
    assert (g1, g2) == (8.0, 16.0) and r2 == pytest.approx(2 * 0.9 * r1)
    hull = lower_hull(configs)
    assert min_train_gpus(0.0, hull) == 0.0
    assert min_train_gpus(r1 / 2, hull) == pytest.approx(4.0)  # one cell half the time
    mid = (r1 + r2) / 2
    assert min_train_gpus(mid, hull) == pytest.approx(12.0)
    assert min_train_gpus(r2 * 1.01, hull) == math.inf


def test_pipeline_waits_for_the_budget_and_the_cap():
    # One group per step, budget = one version: each version's group cannot start before the
    # previous update is published, so the versions add up.
    sc = tiny_scenario(control={"group_size": 1, "batch_groups": 1, "updates_per_burst": 1,
                                "bursts": 3},
                       sim={"staleness_threshold": 0.0})
    fastest = [100.0, 10.0, 10.0, 10.0]
    tokens = [1.0] * 4
    end = pipeline_bound(sc, fastest, tokens)
    opt, sync = sc.trainer.optimizer_s, sc.costs.sync_s
    # Version 0: group 0 (100 s); versions 1 and 2: one 10 s group each after the sync.
    assert end >= 100 + opt + 2 * (sync + 10 + opt)
