import json

import pytest

from tidal.clock import ManualClock
from tidal.config import RunConfig, validate_model
from tidal.control.cells import Cell, CellSet, Standalone
from tidal.control.controller import Controller, ControllerSettings
from tidal.control.decision_log import DecisionLog, jsonl_file_sink
from tidal.control.factory import build_controller
from tidal.control.plans import StepKind
from tidal.control.policy import make_policy
from tidal.errors import InvariantViolation
from tidal.testing import FakeActuator
from tidal.types import (
    BurstStarted,
    CellKind,
    CloseReason,
    ExecutionClosed,
    ExecutionDispatched,
    ExecutionLaunched,
    GroupsAssigned,
    Role,
    Tick,
    TrainerReady,
    TrainerStepDone,
    TransitionStepDone,
    WeightSyncDone,
)


def make(
    policy="waterlevel",
    args=None,
    cells=4,
    slots=4,
    standalone=0,
    auto=True,
    kind=CellKind.ELASTIC,
    **settings,
):
    clock = ManualClock()
    act = FakeActuator(clock, auto=auto)
    cs = CellSet(
        [Cell(i, slots, 8, kind) for i in range(cells)],
        [Standalone(f"sa{j}", slots, 8) for j in range(standalone)],
    )
    opts = dict(batch_groups=2, updates_per_burst=1, supply_fraction=0.5)
    opts.update(settings)
    ctl = Controller(cs, make_policy(policy, args), clock, act, ControllerSettings(**opts))
    act.bind(ctl)
    return ctl, act, clock


def dispatch(ctl, clock, groups, n=2, burst=0):
    ids = []
    for g in range(groups):
        for i in range(n):
            eid = f"b{burst}g{g}e{i}"
            ctl.handle(ExecutionDispatched(clock.now(), eid, f"b{burst}g{g}", n, burst))
            ids.append(eid)
    return ids


def finish(ctl, clock, eid, reward=1.0):
    ctl.handle(ExecutionLaunched(clock.now(), eid))
    ctl.handle(ExecutionClosed(clock.now(), eid, CloseReason.COMPLETED, reward))


def test_waterlevel_run_moves_core_then_satellites_and_returns_at_burst_end():
    ctl, act, clock = make(cells=4, slots=4)  # capacity 16
    ids = dispatch(ctl, clock, groups=6, n=2)  # w = 12
    for eid in ids[:4]:  # two groups ready -> supply 2 >= 1; w = 8
        finish(ctl, clock, eid)
    # capacity after moving the core = 12 >= 8: the core moved
    assert ctl.cells.roles()[0] is Role.TRAINING
    kinds = act.steps_of(1)
    assert kinds == [
        StepKind.STOP_ADMISSION,
        StepKind.RESERVE_AND_REROUTE,
        StepKind.CANCEL_AND_RETRY,
        StepKind.RELEASE_ROLLOUT_MEMORY,
        StepKind.RESTORE_TRAINING_STATE,
    ]
    # sat1 needs w <= 8; it already is and supply holds: it moved too (one plan at a time)
    assert [c.role for c in ctl.cells.cells][:2] == [Role.TRAINING, Role.TRAINING]
    assert ctl.cells.roles()[2] is Role.ROLLOUT  # 16 - 12 = 4 < 8
    for eid in ids[4:]:
        finish(ctl, clock, eid)
    assert ctl.ledger.waterlevel == 0
    assert all(c.role is Role.TRAINING for c in ctl.cells.cells)
    # once the batch is full, the capped supply is 0: nothing would move any more
    ctl.handle(GroupsAssigned(clock.now(), ("b0g0", "b0g1")))
    assert ctl.observation("t").supply.supply == 0
    ctl.handle(TrainerStepDone(clock.now(), 0, final_of_burst=True))
    # satellites return last first; with nothing dispatched and supply ready the core stays
    assert ctl.cells.roles() == (Role.TRAINING, Role.ROLLOUT, Role.ROLLOUT, Role.ROLLOUT)
    returns = [p for p, _ in ctl.plans_done if p.direction.value == "to_rollout"]
    assert [p.cells for p in returns] == [(3,), (2,), (1,)]
    assert act.steps_of(returns[0].plan_id) == [
        StepKind.OFFLOAD_TRAINING_STATE,
        StepKind.WAKE_ENGINE,
        StepKind.LOAD_WEIGHTS,
        StepKind.RESUME_ADMISSION,
    ]


def test_kv_handoff_step_only_when_enabled():
    ctl, act, clock = make(cells=2, slots=4, kv_handoff=True)
    ids = dispatch(ctl, clock, groups=1, n=2)
    for eid in ids:
        finish(ctl, clock, eid)
    assert StepKind.KV_HANDOFF in act.steps_of(1)
    steps = act.steps_of(1)
    assert (
        steps.index(StepKind.CANCEL_AND_RETRY)
        < steps.index(StepKind.KV_HANDOFF)
        < steps.index(StepKind.RELEASE_ROLLOUT_MEMORY)
    )


def test_destinations_prefer_standalone_then_descending_cells():
    ctl, act, clock = make(cells=4, slots=4, standalone=2, auto=False)
    ids = dispatch(ctl, clock, groups=1, n=2)
    for eid in ids:
        finish(ctl, clock, eid)
    plan, step = act.pending[0]
    act.ack_pending()
    plan, step = act.pending[0]
    assert step.kind is StepKind.RESERVE_AND_REROUTE
    assert step.args["destinations"] == ["sa0", "sa1", "sat3", "sat2", "sat1"]


def test_capacity_drops_at_plan_start_and_rises_at_plan_end():
    ctl, act, clock = make(cells=2, slots=4, auto=False)
    ids = dispatch(ctl, clock, groups=1, n=2)
    for eid in ids:
        finish(ctl, clock, eid)
    assert ctl.cells.roles() == (Role.MOVING_TO_TRAINING, Role.ROLLOUT)
    assert ctl.cells.rollout_capacity == 4
    # nothing else moves while the plan is in flight
    dispatch(ctl, clock, groups=0)
    assert len({pid for pid, _, _ in act.executed}) == 1
    while act.pending:
        act.ack_pending()
    assert ctl.cells.roles() == (Role.TRAINING, Role.TRAINING)


def test_failed_step_is_retried_then_plan_aborted_and_roles_restored():
    clock = ManualClock()
    act = FakeActuator(clock, fail={StepKind.RELEASE_ROLLOUT_MEMORY})
    cs = CellSet([Cell(i, 4, 8) for i in range(2)])
    ctl = Controller(
        cs,
        make_policy("waterlevel"),
        clock,
        act,
        ControllerSettings(batch_groups=2, updates_per_burst=1, max_step_retries=1),
    )
    act.bind(ctl)
    ids = dispatch(ctl, clock, groups=1, n=2)
    finish(ctl, clock, ids[0])
    ctl.handle(ExecutionLaunched(0.0, ids[1]))
    # the plan fails twice on release -> aborted, cells back in rollout; no new plan during
    # the back-off, then the policy may try again.
    ctl.handle(ExecutionClosed(0.0, ids[1], CloseReason.COMPLETED, 1.0))
    assert ctl.plans_aborted == 1
    assert ctl.cells.roles() == (Role.ROLLOUT, Role.ROLLOUT)
    ctl.handle(Tick(clock.now()))
    assert ctl.plans_aborted == 1 and ctl.inflight is None
    clock.advance(31.0)
    ctl.handle(Tick(clock.now()))
    assert ctl.plans_aborted == 2
    assert act.aborted[0][1] is StepKind.RELEASE_ROLLOUT_MEMORY
    assert [k for k in act.steps_of(1)].count(StepKind.RELEASE_ROLLOUT_MEMORY) == 2
    failed = [r for r in ctl.log.records if r["type"] == "plan_aborted"]
    assert failed and failed[0]["step"] == "release_rollout_memory"
    ctl.cells.check_prefix()


def test_step_timeout_on_tick():
    ctl, act, clock = make(cells=2, slots=4, auto=False, step_timeout_s=5.0, max_step_retries=0)
    ids = dispatch(ctl, clock, groups=1, n=2)
    for eid in ids:
        finish(ctl, clock, eid)
    assert ctl.inflight is not None
    clock.advance(6.0)
    ctl.handle(Tick(clock.now()))
    aborted = [r for r in ctl.log.records if r["type"] == "plan_aborted"]
    assert aborted and "timed out" in aborted[0]["error"]


def test_stale_ack_is_ignored():
    ctl, act, clock = make(cells=2, slots=4, auto=False)
    ids = dispatch(ctl, clock, groups=1, n=2)
    for eid in ids:
        finish(ctl, clock, eid)
    ctl.handle(TransitionStepDone(0.0, plan_id=99, step_index=0))
    ctl.handle(TransitionStepDone(0.0, plan_id=1, step_index=3))
    assert ctl.stale_acks == 2 and ctl.inflight.step == 0


def test_static_never_moves_and_starts_with_prefix():
    ctl, act, clock = make("static", {"train": 16}, cells=4)
    assert ctl.cells.roles() == (Role.TRAINING, Role.TRAINING, Role.ROLLOUT, Role.ROLLOUT)
    for eid in dispatch(ctl, clock, groups=3):
        finish(ctl, clock, eid)
    assert not act.executed


def test_colocate_alternates_all_cells():
    ctl, act, clock = make("colocate", cells=3)
    ids = dispatch(ctl, clock, groups=2)
    for eid in ids[:-1]:
        finish(ctl, clock, eid)
    assert ctl.cells.prefix_len == 0
    finish(ctl, clock, ids[-1])
    assert all(r is Role.TRAINING for r in ctl.cells.roles())
    ctl.handle(GroupsAssigned(clock.now(), ("b0g0", "b0g1")))
    ctl.handle(TrainerStepDone(clock.now(), 0, final_of_burst=True))
    assert all(r is Role.ROLLOUT for r in ctl.cells.roles())
    assert [len(p.cells) for p, _ in ctl.plans_done] == [3, 3]


def test_verl_cycle_through_controller():
    ctl, act, clock = make(
        "verl-default",
        {"deactivate_ratio": 0.5},
        cells=2,
        standalone=2,
        kind=CellKind.HYBRID,
        batch_groups=2,
        updates_per_burst=2,
    )
    # start-up: hybrid cells (home = training) activate after the initial sync
    ctl.handle(Tick(0.0))
    assert ctl.cells.roles() == (Role.ROLLOUT, Role.ROLLOUT)
    assert act.steps_of(1) == [
        StepKind.OFFLOAD_TRAINING_STATE,
        StepKind.WAKE_ENGINE,
        StepKind.SYNC_WEIGHTS,
        StepKind.ADD_TO_LOAD_BALANCER,
        StepKind.RESUME_GENERATION,
    ]
    ctl.handle(TrainerReady(clock.now(), 0))
    # SR = 4, ratio 0.5 -> wait for 2 groups in the queue
    ids = dispatch(ctl, clock, groups=2)
    for eid in ids[:2]:
        finish(ctl, clock, eid)
    assert ctl.cells.roles() == (Role.ROLLOUT, Role.ROLLOUT)
    for eid in ids[2:]:
        finish(ctl, clock, eid)
    assert ctl.cells.roles() == (Role.TRAINING, Role.TRAINING)
    assert act.steps_of(2) == [
        StepKind.REMOVE_FROM_LOAD_BALANCER,
        StepKind.ABORT_INFLIGHT,
        StepKind.SLEEP_ENGINE,
        StepKind.RESTORE_TRAINING_STATE,
    ]
    ctl.handle(TrainerStepDone(clock.now(), 0, queue_at_start=2))
    ctl.handle(TrainerStepDone(clock.now(), 1, queue_at_start=0, wait_s=5.0, final_of_burst=True))
    ctl.handle(WeightSyncDone(clock.now(), 1))
    assert ctl.policy.hooks.deactivate_ratio == pytest.approx(0.6)  # 2/4 -> +0.1 (clipped)


def test_unsafe_policy_decision_is_refused():
    class Reckless:
        name = "reckless"
        waterlevel_safe = True

        def initial_prefix(self, cells):
            return 0

        def state(self):
            return {}

        def decide(self, obs):
            from tidal.control.policy import Action, Decision

            nxt = obs.next_to_train()
            return (
                Decision(Action.TO_TRAINING, (nxt.index,), "yolo") if nxt else Decision.hold("done")
            )

    clock = ManualClock()
    act = FakeActuator(clock)
    ctl = Controller(
        CellSet([Cell(i, 4, 8) for i in range(2)]),
        Reckless(),
        clock,
        act,
        ControllerSettings(batch_groups=2, updates_per_burst=1),
    )
    act.bind(ctl)
    with pytest.raises(InvariantViolation, match="unsafe move"):
        dispatch(ctl, clock, groups=3)


def _marked(may: bool):
    class Oversubscriber:
        name = "oversubscriber"
        waterlevel_safe = True
        may_oversubscribe = may

        def initial_prefix(self, cells):
            return 0

        def state(self):
            return {}

        def decide(self, obs):
            from tidal.control.policy import Action, Decision

            nxt = obs.next_to_train()
            if nxt is None or obs.waterlevel == 0 or not obs.supply.ok:
                return Decision.hold("wait")
            return Decision(Action.TO_TRAINING, (nxt.index,), "over", oversubscribe=True)

    return Oversubscriber()


def test_an_oversubscribed_move_is_accepted_only_from_a_policy_that_may():
    """Invariant 3 binds every waterlevel-safe policy; only one that declares
    ``may_oversubscribe`` (tidal) may mark a move below the waterlevel; the waterlevel policy
    declares nothing of the kind."""
    from tidal.control.waterlevel import WaterlevelPolicy

    assert not getattr(WaterlevelPolicy, "may_oversubscribe", False)
    for may in (False, True):
        clock = ManualClock()
        act = FakeActuator(clock)
        ctl = Controller(
            CellSet([Cell(i, 4, 8) for i in range(2)]),
            _marked(may),
            clock,
            act,
            ControllerSettings(batch_groups=2, updates_per_burst=1),
        )
        act.bind(ctl)
        ids = dispatch(ctl, clock, groups=5)  # w = 10 > 8 slots
        finish(ctl, clock, ids[0])
        assert ctl.cells.roles()[0] is Role.ROLLOUT  # supply not held yet
        if not may:  # one group ready, w = 8 > 4 slots after the move
            with pytest.raises(InvariantViolation, match="unsafe move"):
                finish(ctl, clock, ids[1])
            continue
        finish(ctl, clock, ids[1])
        assert ctl.cells.roles()[0] is Role.TRAINING


def test_decision_log_jsonl_has_inputs(tmp_path):
    path = tmp_path / "decisions.jsonl"
    cfg = validate_model(
        RunConfig,
        {
            "cluster": {"cell_count": 2, "cell_slots": 4},
            "control": {"group_size": 2, "batch_groups": 2},
        },
    )
    clock = ManualClock()
    act = FakeActuator(clock)
    with path.open("w") as fh:
        ctl = build_controller(cfg, clock, act, DecisionLog(jsonl_file_sink(fh), keep=False))
        act.bind(ctl)
        ctl.handle(BurstStarted(0.0, 0, 4))
        for eid in dispatch(ctl, clock, groups=2):
            finish(ctl, clock, eid)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    moves = [r for r in lines if r["type"] == "decision" and r["action"] != "hold"]
    assert moves and {"waterlevel", "capacity", "supply", "roles"} <= set(moves[0]["inputs"])
    assert any(r["type"] == "plan_done" for r in lines)
    # consecutive holds that differ only in numbers are logged once
    holds = [r["reason"] for r in lines if r.get("action") == "hold"]
    assert len(holds) == len(set(holds))


def test_waterlevel_without_any_rollout_capacity_is_a_config_error():
    from tidal.errors import ConfigError

    with pytest.raises(ConfigError, match="no rollout capacity"):
        make("waterlevel", cells=2, kind=CellKind.HYBRID)


def test_a_verl_lending_plan_carries_clear_sticky_on_its_load_balancer_step_only():
    from tidal.control.plans import build_plan
    from tidal.control.policy import Action, Decision, PlanStyle

    def plan(options):
        d = Decision(Action.TO_ROLLOUT, (0, 1), "lend", PlanStyle.VERL, options)
        return build_plan(1, d, 0.0, destinations=[], version=3, kv_handoff=False)

    sticky = {s.kind: s.args for s in plan({"clear_sticky": True}).steps}
    assert sticky[StepKind.ADD_TO_LOAD_BALANCER] == {"clear_sticky": True}
    assert [k for k, a in sticky.items() if a.get("clear_sticky")] == [
        StepKind.ADD_TO_LOAD_BALANCER
    ]
    assert StepKind.REBALANCE not in sticky  # no abort of every replica's requests
    plain = plan({}).steps
    assert all("clear_sticky" not in s.args for s in plain)
