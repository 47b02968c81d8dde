"""Liveness of the waterlevel-safe policies: a quiescent system always gets a cell to train.

Quiescent: no execution in flight, the dispatcher has nothing left to dispatch (the current
burst's quota is out; earlier bursts' leftovers were forfeited when the next burst started,
as on-demand dispatch does under a per-version budget), no transition in flight, the trainer
waiting with a batch's worth of ready groups, and no cell training. Nothing but the policy can
change that state, so a policy that holds there deadlocks the run (the stuck generated
scenarios of ``benchmarks/policy_robustness.py`` before the controller stopped counting a
superseded burst's remainder as pending dispatch).
"""

from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.clock import ManualClock
from tidal.control.cells import Cell, CellSet, Standalone
from tidal.control.controller import Controller, ControllerSettings
from tidal.control.policy import make_policy
from tidal.types import (
    BurstStarted,
    CellKind,
    CloseReason,
    ExecutionClosed,
    ExecutionDispatched,
    ExecutionLaunched,
    GroupsAssigned,
    Tick,
    TrainerReady,
    TrainerStepDone,
    TransitionStepDone,
    WeightSyncDone,
)

POLICIES = [("waterlevel", {}), ("waterlevel", {"core_may_stay": False}), ("tidal", {})]


class AutoAck:
    """Acknowledges every plan step at once (re-entrantly: the controller queues it)."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.ctl: Controller | None = None

    def execute(self, plan, step):
        assert self.ctl is not None
        self.ctl.handle(TransitionStepDone(self.clock.now(), plan.plan_id, step.index))

    def abort(self, plan, failed, error):
        raise AssertionError(f"plan {plan.plan_id} aborted: {error}")


def build(policy, ncells, slots, nstand, hybrid, batch, group, quota, bursts):
    clock = ManualClock()
    act = AutoAck(clock)
    kind = CellKind.HYBRID if hybrid else CellKind.ELASTIC
    cells = CellSet(
        [Cell(i, slots, 8, kind) for i in range(ncells)],
        [Standalone(f"sa{j}", slots, 8) for j in range(nstand)],
    )
    ctl = Controller(
        cells,
        make_policy(*policy),
        clock,
        act,
        ControllerSettings(
            batch_groups=batch,
            updates_per_burst=1,
            supply_fraction=0.5,
            supply_hold_s=0.0,
            next_burst_quota=quota * group,
            total_bursts=bursts,
        ),
    )
    act.ctl = ctl
    return clock, ctl


def run_group(ctl, clock, burst, gid, group):
    """One group dispatched, launched and closed with a reward (a ready group)."""
    eids = [f"{gid}e{j}" for j in range(group)]
    for eid in eids:
        ctl.handle(ExecutionDispatched(clock.now(), eid, gid, group, burst))
    for eid in eids:
        clock.advance(1.0)
        ctl.handle(ExecutionLaunched(clock.now(), eid))
    for eid in eids:
        clock.advance(1.0)
        ctl.handle(ExecutionClosed(clock.now(), eid, CloseReason.COMPLETED, 1.0))


def end_burst(ctl, clock, step, version):
    """The trainer takes what is ready (up to a batch), finishes the burst's final update and
    publishes the next weights."""
    ctl.handle(TrainerReady(clock.now(), step))
    take = tuple(ctl.ledger.ready_group_ids()[: ctl.settings.batch_groups])
    if take:
        ctl.handle(GroupsAssigned(clock.now(), take))
    clock.advance(5.0)
    ctl.handle(TrainerStepDone(clock.now(), step, final_of_burst=True))
    clock.advance(1.0)
    ctl.handle(WeightSyncDone(clock.now(), version))


@settings(max_examples=150, deadline=None)
@given(
    policy=st.sampled_from(POLICIES),
    ncells=st.integers(1, 4),
    slots=st.integers(2, 8),
    nstand=st.integers(1, 2),
    hybrid=st.booleans(),
    batch=st.integers(1, 4),
    group=st.integers(1, 3),
    extra=st.integers(0, 4),
    earlier=st.lists(st.floats(0.0, 1.0), max_size=3),
)
def test_quiescent_system_always_gets_a_cell_to_train(
    policy, ncells, slots, nstand, hybrid, batch, group, extra, earlier
):
    quota = batch + extra  # groups per burst: the last burst alone fills a batch
    clock, ctl = build(
        policy, ncells, slots, nstand, hybrid, batch, group, quota, bursts=len(earlier) + 2
    )
    dispatched = [round(f * quota) for f in earlier] + [quota]  # earlier: partly forfeited
    for b, k in enumerate(dispatched):
        if b:
            end_burst(ctl, clock, step=b - 1, version=b)
        ctl.handle(BurstStarted(clock.now(), b, quota * group, b))
        for g in range(k):
            run_group(ctl, clock, b, f"b{b}g{g}", group)
    ctl.handle(TrainerReady(clock.now(), len(dispatched) - 1))
    for _ in range(3):  # time passes; nothing else can happen
        clock.advance(10.0)
        ctl.handle(Tick(clock.now()))
    obs = ctl.observation("check")
    assert obs.waterlevel == 0 and not obs.in_flight
    assert obs.supply.ok
    assert ctl.cells.prefix_len > 0, (
        f"{policy[0]} holds with no cell training, nothing to dispatch and "
        f"{obs.ready_groups} ready groups: {ctl.log.records[-1].get('reason')}"
    )
    assert obs.pending_dispatch == 0, f"a forfeited quota counts as pending: {ctl._announced}"


def test_a_new_burst_supersedes_what_is_left_of_the_previous_one():
    clock, ctl = build(("waterlevel", {}), 2, 4, 1, False, 2, 2, 4, bursts=3)
    ctl.handle(BurstStarted(0.0, 0, 8))
    run_group(ctl, clock, 0, "b0g0", 2)
    assert ctl.pending_dispatch == 6  # 3 of burst 0's 4 groups still to dispatch
    end_burst(ctl, clock, step=0, version=1)
    ctl.handle(BurstStarted(clock.now(), 1, 8, 1))
    assert ctl.pending_dispatch == 8  # burst 1's quota only: burst 0's remainder is gone
    run_group(ctl, clock, 1, "b1g0", 2)
    assert ctl.pending_dispatch == 6
