import pytest

from tidal.control.metrics import (
    MetricsTracker,
    RoleTimeline,
    resource_utilization,
    rollout_resource_utilization,
    train_resource_utilization,
)
from tidal.types import Role


def test_train_utilization_is_ratio_of_sums_not_mean_of_ratios():
    # per-step ratios 0.5 and 0.9 (mean 0.7); sums 10 / 14
    assert train_resource_utilization([1.0, 9.0], [2.0, 10.0]) == pytest.approx(10 / 12)
    assert train_resource_utilization([], []) == 0.0


def test_rollout_utilization_weights_each_interval_by_its_capacity():
    # [0,10): cap 4, active 2 -> 20 of 40; [10,20): cap 8, active 10 -> min 8: 80 of 80;
    # [20,30): cap 0 skipped.
    points = [(0.0, 2, 4), (10.0, 10, 8), (20.0, 5, 0)]
    assert rollout_resource_utilization(points, 30.0) == pytest.approx(100 / 120)
    assert rollout_resource_utilization([(0.0, 3, 0)], 10.0) == 0.0
    assert rollout_resource_utilization([], 10.0) == 0.0


def test_cluster_utilization_formula():
    # a=16 hybrid, b=16 standalone, x = 30/100
    u = resource_utilization(0.8, 0.6, 16, 16, wait_s=30.0, step_s=100.0)
    assert u == pytest.approx(((0.7 * 16 * 0.8) + (0.3 * 16 + 16) * 0.6) / 32)
    assert resource_utilization(0.8, 0.6, 16, 16, wait_s=500.0, step_s=100.0) == \
        pytest.approx(((0 * 16 * 0.8) + (16 + 16) * 0.6) / 32)  # x clipped to 1


def test_tracker_cycle_rows_and_capacity_cap():
    m = MetricsTracker(hybrid_gpus=8, standalone_gpus=8, max_required=6)
    m.rollout_point(0.0, 3, 10)   # cap min(10, 6) = 6
    m.rollout_point(5.0, 6, 10)
    m.group_generated()
    m.trainer_step(compute_s=4.0, alloc_s=5.0, wait_s=1.0, wait_for_samples_s=0.0, mq_size=3)
    m.trainer_step(compute_s=2.0, alloc_s=5.0, wait_s=3.0, wait_for_samples_s=0.0, mq_size=1)
    row = m.close_cycle(10.0, version=1)
    assert row["dynamic_resource/train_resource_utilization"] == pytest.approx(0.6)
    assert row["dynamic_resource/rollout_resource_utilization"] == pytest.approx(
        (5 * 3 + 5 * 6) / (10 * 6))
    assert row["dynamic_resource/mq_size"] == 1  # last snapshot, not an average
    assert row["fully_async/rollouter/step_generated_samples"] == 1
    # the next cycle starts from the last known point
    row2 = m.close_cycle(20.0, version=2)
    assert row2["dynamic_resource/rollout_resource_utilization"] == pytest.approx(1.0)


def test_role_timeline():
    tl = RoleTimeline((Role.ROLLOUT, Role.ROLLOUT), 0.0)
    tl.change(0, Role.MOVING_TO_TRAINING, 10.0)
    tl.change(0, Role.TRAINING, 12.0)
    segs = tl.close(20.0)
    assert segs[0] == [(0.0, 10.0, Role.ROLLOUT), (10.0, 12.0, Role.MOVING_TO_TRAINING),
                       (12.0, 20.0, Role.TRAINING)]
    assert segs[1] == [(0.0, 20.0, Role.ROLLOUT)]
    assert tl.time_in(Role.TRAINING, 20.0) == [8.0, 0.0]
