"""The oracle is a lower bound for every registered policy, and no weaker than before.

Each shipped scenario runs scaled down (as the golden runs are) with several seeds; the
workload, the candidate groups and the bound all change with the seed.
"""

import math

import pytest

from tidal.control.mechanics import MECHANICS_SETS
from tidal.control.policy import registered
from tidal.control.verl import dispatch_budget
from tidal.sim import perf
from tidal.sim.oracle import (
    draw_candidates,
    fastest_trainer,
    hull_rate_max,
    lower_hull,
    min_train_gpus,
    oracle_bound,
    pipeline_bound,
    sync_stops_every_cell,
    training_configs,
)
from tidal.sim.runner import run_policy
from tidal.sim.scenario import Scenario, load, train_work_tokens
from tidal.sim.workloads import make_workload
from tidal.testing.sim_scenarios import tiny_scenario

CASES = {  # scenario: (scale factor, bursts)
    "dapo-math-32gpu": (0.5, 3),
    "mixed": (0.5, 2),
    "swe-agent-long-tail": (0.25, 2),
    "qwengyre-long-tail": (0.25, 2),
}
SEEDS = (1, 2, 3)


def kv_context_tokens(spec) -> float:
    """Sum over decoded tokens of the context each one reads (the cost model's KV term)."""
    ctx, total = spec.prompt_tokens, 0.0
    for d, _, out in spec.turns:
        total += sum(ctx + i for i in range(d))
        ctx += d + out
    return total


def bound_before(sc: Scenario) -> float:
    """The oracle as it stood before the trainer LP and the pipeline (frozen copy), on the
    scenario the oracle reads (its fastest trainer: a policy that runs no old-log-prob pass)."""
    sc = perf.resolve(fastest_trainer(sc))
    cl, eng, tr, ctrl = sc.cluster, sc.engine, sc.trainer, sc.control
    gpus = sum(c.gpus for c in cl.cell_specs()) + cl.standalone_count * cl.standalone_gpus
    slots = sum(c.slots for c in cl.cell_specs()) + cl.standalone_count * cl.standalone_slots
    stale = max(
        [sc.sim.staleness_threshold]
        + [
            p.staleness_threshold
            for p in (*MECHANICS_SETS.values(), *sc.profiles.values())
            if p.staleness_threshold is not None
        ]
    )
    steps, n = sc.total_steps, sc.total_steps * ctrl.batch_groups
    budget = dispatch_budget(ctrl.batch_groups, stale, ctrl.updates_per_burst)
    m = max(n, n - ctrl.batch_groups * ctrl.updates_per_burst + budget)
    wl = make_workload(sc.workload, sc.seed, ctrl.batch_groups)
    work, tokens, duration, held = [], [], [], []
    for _ in range(m):
        roll = train = longest = slot_s = tok = 0.0
        for spec in wl.group(ctrl.group_size):
            roll += (
                spec.decode_tokens + spec.prefill_tokens * eng.prefill_equiv
            ) / eng.decode_tok_s_per_gpu + kv_context_tokens(spec) * eng.kv_gpu_s_per_ctx_token
            train += train_work_tokens(spec.train_tokens, tr) / tr.train_tok_s_per_gpu
            d = spec.min_duration_s(eng.seq_cap_tok_s)
            if spec.timeout_s is not None:
                d = min(d, spec.timeout_s)
            slot_s += d
            longest = max(longest, d)
            tok += train_work_tokens(spec.train_tokens, tr)  # attention included
        work.append(roll + train)
        tokens.append(tok)
        duration.append(longest)
        held.append(slot_s)
    one_batch_s = sum(sorted(tokens)[:n]) / steps / (tr.train_tok_s_per_gpu * gpus)
    critical = max(
        sorted(duration)[n - 1] + one_batch_s + tr.optimizer_s,
        steps * (one_batch_s + tr.optimizer_s),
    )
    return max(sum(sorted(work)[:n]) / gpus, critical, sum(sorted(held)[:n]) / slots)


def specs(cells: int, standalone: int = 1) -> list[str]:
    """Every registered policy; static on one cell and on all (all but one when no standalone
    engine is left to roll out)."""
    cells = cells if standalone else cells - 1
    out = []
    for name in sorted(registered()):
        out += sorted({"static:cells=1", f"static:cells={cells}"}) if name == "static" else [name]
    return out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scenario", sorted(CASES))
def test_no_policy_finishes_below_the_bound(scenario, seed):
    factor, bursts = CASES[scenario]
    sc = load(scenario).scaled(factor, bursts=bursts).model_copy(update={"seed": seed})
    bound = oracle_bound(sc)
    assert bound.makespan_s >= bound.legacy_s == pytest.approx(bound_before(sc), rel=1e-9)
    assert bound.makespan_s == max(
        bound.work_s, bound.critical_path_s, bound.slots_s, bound.trainer_lp_s, bound.pipeline_s
    )
    for spec in specs(len(sc.cluster.cell_specs()), sc.cluster.standalone_count):
        makespan = run_policy(sc, spec, oracle=bound, keep_log=False).summary["makespan_s"]
        assert makespan >= bound.makespan_s, (spec, makespan, bound)


def sync_heavy(seed: int) -> Scenario:
    """dapo-math scaled down with a slow weight sync (15 s: links at 10 %), where F7 charges
    every GPU."""
    base = load("dapo-math-32gpu").scaled(0.5, bursts=4)
    cm = base.costmodel
    assert cm is not None
    slow = cm.model_copy(update={"efficiency": cm.efficiency.model_copy(update={"link": 0.1})})
    return base.model_copy(update={"seed": seed, "costmodel": slow})


def f7_holds(sc: Scenario) -> bool:
    sc = perf.resolve(sc)
    cand = draw_candidates(sc)
    step_min_s = sum(sorted(cand.train_tok_timeout)[: sc.control.batch_groups]) / hull_rate_max(sc)
    return sync_stops_every_cell(sc, step_min_s, cand.max_context_tokens)


@pytest.mark.parametrize("seed", SEEDS)
def test_no_policy_beats_the_bound_with_slow_syncs(seed):
    sc = sync_heavy(seed)
    assert f7_holds(sc)
    bound = oracle_bound(sc)
    for spec in specs(len(sc.cluster.cell_specs())):
        makespan = run_policy(sc, spec, oracle=bound, keep_log=False).summary["makespan_s"]
        assert makespan >= bound.makespan_s, (spec, makespan, bound)


def test_f7_charges_every_gpu_only_when_no_plan_can_abort():
    sc = load("dapo-math-32gpu")
    assert f7_holds(sc)
    faulty = sc.model_copy(update={"sim": sc.sim.model_copy(update={"step_failure_rate": 0.1})})
    assert not f7_holds(faulty)
    # Without F7 the syncs charge the standalone GPUs and one cell only: a lower bound.
    assert oracle_bound(faulty).trainer_lp_s < oracle_bound(sc).trainer_lp_s


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
    sc = tiny_scenario(
        control={"group_size": 1, "batch_groups": 1, "updates_per_burst": 1, "bursts": 3},
        sim={"staleness_threshold": 0.0},
    )
    fastest = [100.0, 10.0, 10.0, 10.0]
    tokens = [1.0] * 4
    end = pipeline_bound(sc, fastest, tokens)
    opt, sync = sc.trainer.optimizer_s, sc.costs.sync_s
    # Version 0: group 0 (100 s); versions 1 and 2: one 10 s group each after the sync.
    assert end >= 100 + opt + 2 * (sync + 10 + opt)


@pytest.mark.parametrize("mechanics", sorted(MECHANICS_SETS))
@pytest.mark.parametrize("scenario", ["dapo-math-32gpu", "qwengyre-long-tail"])
def test_no_policy_beats_the_bound_under_any_mechanics(scenario, mechanics):
    factor, bursts = CASES[scenario]
    sc = load(scenario).scaled(factor, bursts=bursts).model_copy(update={"mechanics": mechanics})
    bound = oracle_bound(sc)
    for spec in specs(len(sc.cluster.cell_specs()), sc.cluster.standalone_count):
        makespan = run_policy(sc, spec, oracle=bound, keep_log=False).summary["makespan_s"]
        assert makespan >= bound.makespan_s, (spec, mechanics, makespan, bound)
