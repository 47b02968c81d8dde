"""verl's metric formulas, with worked numbers taken from verl 0.9.1's code
(``detach_utils.MetricsAggregator``, ``FullyAsyncRollouter._compute_rollout_resource_utilization``
and ``reset_staleness``, ``FullyAsyncTrainer.fit_step``), and the role timeline. The
aggregator and the rollout utilization are also checked against verl's own code from the
wheel in ``test_verl_conformance.py``."""

import pytest

from tidal.control.metrics import (
    RoleTimeline,
    VerlMetrics,
    aggregate,
    aggregation_type,
    resource_utilization,
    rollout_resource_utilization,
    rollouter_idle_ratio,
    special_metrics,
)
from tidal.types import Role


def test_aggregation_rules_follow_verl():
    assert aggregation_type("dynamic_resource/mq_size") == "last"
    assert aggregation_type("dynamic_resource/train_allocated_time_s") == "sum"
    assert aggregation_type("timing_s/gen") == "time_sum"
    assert aggregation_type("fully_async/total_wait_time") == "sum"  # "total" in the name
    agg = aggregate(
        {
            "timing_s/step": [10.0, 20.0],
            "dynamic_resource/mq_size": [3.0, 1.0],
            "fully_async/total_wait_time": [1.0, 2.0],
        }
    )
    assert agg == {
        "timing_s/step": 30.0,
        "dynamic_resource/mq_size": 1.0,
        "fully_async/total_wait_time": 3.0,
    }


def test_train_utilization_is_a_ratio_of_sums_and_idle_ratio_gen_over_step():
    # per-step ratios 0.5 and 0.9 (mean 0.7); verl sums first: 10 / 12
    agg = special_metrics(
        aggregate(
            {
                "dynamic_resource/train_compute_time_s": [1.0, 9.0],
                "dynamic_resource/train_allocated_time_s": [2.0, 10.0],
                "timing_s/gen": [4.0, 1.0],
                "timing_s/step": [10.0, 15.0],
            }
        ),
        None,
        16,
        16,
    )
    assert agg["dynamic_resource/train_resource_utilization"] == pytest.approx(10 / 12)
    assert agg["fully_async/trainer/idle_ratio"] == pytest.approx(5 / 25)
    # verl adds the rollout and cluster figures only with the train one and a step time
    assert "dynamic_resource/resource_utilization" not in agg


def test_rollout_utilization_weights_each_interval_by_its_capacity():
    # [0,10): S 4, A 2 -> u .5: 20 of 40; [10,20): S 8, A 10 -> u 1: 80 of 80; [20,30): S 0
    points = [(0.0, 2, 4), (10.0, 10, 8), (20.0, 5, 0), (30.0, 5, 0)]
    assert rollout_resource_utilization(points) == pytest.approx(100 / 120)
    assert rollout_resource_utilization([(0.0, 3, 0), (10.0, 3, 0)]) == 0.0
    assert rollout_resource_utilization([(0.0, 3, 4)]) == 0.0


def test_cluster_utilization_formula_uses_the_step_time():
    # a=16 hybrid, b=16 standalone, x = wait_for_enough_samples / step = 30/100
    u = resource_utilization(0.8, 0.6, 16, 16, wait_s=30.0, step_s=100.0)
    assert u == pytest.approx(((0.7 * 16 * 0.8) + (0.3 * 16 + 16) * 0.6) / 32)
    assert resource_utilization(0.8, 0.6, 16, 16, wait_s=500.0, step_s=100.0) == pytest.approx(
        ((0 * 16 * 0.8) + (16 + 16) * 0.6) / 32
    )  # x clipped to 1


def test_rollouter_idle_ratio_from_reset_staleness():
    # window 100..200, drained and blocked at 160: active 60 of 100 s
    assert rollouter_idle_ratio(100.0, 160.0, 200.0) == (60.0, 100.0, pytest.approx(0.4))
    assert rollouter_idle_ratio(100.0, 90.0, 200.0) == (100.0, 100.0, 0)  # idle before


def test_one_version_through_verl_metrics():
    """trigger 2, hybrids active at the start. Step 1: asks at 0, deactivation decided at 5
    and done at 8, batch complete at 10, ends at 20. Step 2: 20..30, then the sync and the
    activation end at 40. verl logs the row before it adds the step that synced."""
    m = VerlMetrics(hybrid_gpus=16, standalone_gpus=16, budget_groups=6)
    m.launched("g0", 8)
    for _ in range(8):  # a group of 8 completes: no longer in generation
        m.closed("g0", 8)
    m.rollout(0.0, slots=128, idle=False)  # 16 groups of capacity, capped at the budget 6
    m.launched("g1", 8)
    m.launched("g2", 8)
    m.rollout(0.0, slots=128, idle=False)
    m.step_begin(0.0)
    m.rollout(5.0, slots=64, idle=False)  # the hybrids leave: still 8 >= 6 groups
    m.moved_to_training(5.0, 8.0)
    m.step_done(20.0, wait_s=2.0, compute_s=10.0, alloc_s=12.0, final=False, mq_size=3)
    m.step_begin(20.0)
    m.step_done(30.0, wait_s=0.0, compute_s=9.0, alloc_s=10.0, final=True, mq_size=1)
    m.generated()
    m.rollout(35.0, slots=64, idle=True)
    m.sync(1)
    row = m.sync_end(40.0, mq_size=4)
    assert row["timing_s/step"] == 20.0
    assert row["timing_s/wait_for_enough_samples"] == 5.0  # 8 s without GPUs - 3 s switching
    assert row["timing_s/gen"] == 2.0 and row["dynamic_resource/mq_size"] == 3.0
    assert row["dynamic_resource/train_resource_utilization"] == pytest.approx(10 / 12)
    assert row["fully_async/trainer/idle_ratio"] == pytest.approx(2 / 20)
    # 2 groups in generation all along, capacity min(16 or 8 groups, budget 6)
    assert row["dynamic_resource/rollout_resource_utilization"] == pytest.approx(2 / 6)
    x = 5 / 20
    assert row["dynamic_resource/resource_utilization"] == pytest.approx(
        ((1 - x) * 16 * (10 / 12) + (x * 16 + 16) * (2 / 6)) / 32
    )
    assert row["fully_async/rollouter/idle_ratio"] == pytest.approx(5 / 40)
    assert row["fully_async/rollouter/step_generated_samples"] == 1.0
    assert row["version"] == 1.0
    # the step that synced counts in the next row: 20..40, allocated from 20, sync 10 s
    m.step_begin(40.0)
    m.step_done(50.0, wait_s=1.0, compute_s=8.0, alloc_s=10.0, final=True, mq_size=0)
    m.sync(2)
    row2 = m.sync_end(50.0, mq_size=0)
    assert row2["timing_s/step"] == 20.0
    assert row2["timing_s/timing_s/param_sync"] == 10.0
    assert row2["dynamic_resource/train_allocated_time_s"] == 20.0
    assert row2["dynamic_resource/mq_size"] == 4.0


def test_role_timeline():
    tl = RoleTimeline((Role.ROLLOUT, Role.ROLLOUT), 0.0)
    tl.change(0, Role.MOVING_TO_TRAINING, 10.0)
    tl.change(0, Role.TRAINING, 12.0)
    segs = tl.close(20.0)
    assert segs[0] == [
        (0.0, 10.0, Role.ROLLOUT),
        (10.0, 12.0, Role.MOVING_TO_TRAINING),
        (12.0, 20.0, Role.TRAINING),
    ]
    assert segs[1] == [(0.0, 20.0, Role.ROLLOUT)]
    assert tl.time_in(Role.TRAINING, 20.0) == [8.0, 0.0]
