"""The control-plane changes made on the simulator branch (each listed in the report)."""

from tidal.clock import ManualClock
from tidal.config import RunConfig
from tidal.control.cells import Cell, CellSet, Standalone
from tidal.control.factory import build_controller
from tidal.control.supply import SupplyTracker
from tidal.testing import FakeActuator
from tidal.types import (
    BurstStarted,
    ExecutionDispatched,
    Role,
    TrainerReady,
    TrainerStepDone,
    WeightSyncDone,
)


def test_supply_passes_with_everything_a_partly_assigned_batch_still_needs():
    s = SupplyTracker(batch_groups=16, fraction=0.5, hold_s=0.0)
    v = s.view(0.0, ready_unassigned=100, assigned_in_batch=12)  # needs 4 < threshold 8
    assert v.supply == 4 and v.ok
    assert not s.view(0.0, ready_unassigned=3, assigned_in_batch=12).ok
    assert s.view(0.0, ready_unassigned=0, assigned_in_batch=16).ok  # needs cells, not data
    assert not s.view(0.0, ready_unassigned=7, assigned_in_batch=0).ok


def verl_controller(ratio=0.5):
    cfg = RunConfig.model_validate(
        {
            "cluster": {
                "cells": [{"gpus": 8, "slots": 128, "kind": "hybrid"}] * 2,
                "standalone_count": 2,
                "standalone_slots": 128,
            },
            "control": {"batch_groups": 10, "updates_per_burst": 4},
            "policy": {"name": "verl-default", "args": {"deactivate_ratio": ratio}},
        }
    )
    clock = ManualClock()
    act = FakeActuator(clock)
    ctl = build_controller(cfg, clock, act)
    act.bind(ctl)
    return ctl


def test_verl_sees_the_closed_cycle_after_the_weight_sync():
    ctl = verl_controller(ratio=0.0)  # gap 0: hybrids stay standalone-only, hooks still run
    hooks = ctl.policy.hooks
    ctl.handle(TrainerReady(0.0, 0))
    for step in range(4):  # 20 s waited over 10 missing samples in the cycle
        ctl.handle(
            TrainerStepDone(
                1.0 + step,
                step,
                wait_s=5.0 if step < 2 else 0.0,
                queue_at_start=5 if step < 2 else 10,
                final_of_burst=step == 3,
            )
        )
    ctl.handle(WeightSyncDone(10.0, 1))
    assert hooks.per_sample_time_s == 1.0  # 10 s / 10 samples, not the 1000 s prior
    assert hooks.deactivate_ratio == 0.1  # waited: the ratio grows by clip(10/40, .02, .1)


def test_pending_dispatch_forgets_fully_dispatched_bursts():
    ctl = verl_controller()
    ctl.handle(BurstStarted(0.0, 0, 2, 0))
    assert ctl.pending_dispatch == 2
    for i in range(2):
        ctl.handle(ExecutionDispatched(0.0, f"e{i}", "g", 2, 0))
    assert ctl.pending_dispatch == 0 and 0 not in ctl._announced


def test_rollout_capacity_and_views_follow_role_changes():
    cells = CellSet([Cell(0, 10, 8), Cell(1, 20, 8)], [Standalone("s", 5)])
    assert cells.rollout_capacity == 35
    cells.set_role(0, Role.TRAINING)
    assert cells.rollout_capacity == 25
    cells.set_standalone("s", 0)
    assert cells.rollout_capacity == 20
