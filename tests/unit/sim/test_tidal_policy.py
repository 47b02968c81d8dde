"""tidal's own policy: rate model, partial lending in prefix order, waterlevel safety."""

import dataclasses

import pytest

from tidal.control.policy import Action, CellView, Observation, make_policy, registered
from tidal.control.supply import SupplyView
from tidal.errors import ConfigError
from tidal.types import CellKind, Role


def obs(
    t=100.0,
    roles=("training", "rollout"),
    waterlevel=10,
    pending=0,
    ready=20,
    generated=0,
    step=0,
    running=None,
    supply_ok=True,
    in_flight=False,
    slots=128,
):
    cells = tuple(CellView(i, slots, 8, CellKind.HYBRID, Role(r)) for i, r in enumerate(roles))
    cap = sum(c.slots for c in cells if c.role is Role.ROLLOUT) + 256
    return Observation(
        now_s=t,
        trigger="Tick",
        cells=cells,
        standalone_slots=256,
        standalone_gpus=16,
        rollout_capacity=cap,
        waterlevel=waterlevel,
        queued=0,
        running=waterlevel if running is None else running,
        pending_dispatch=pending,
        supply=SupplyView(min(ready, 16), 16, 8.0, supply_ok, 0.0, supply_ok),
        ready_groups=ready,
        groups_generated=generated,
        batch_groups=16,
        updates_per_burst=4,
        trainer_waiting=True,
        trainer_step=step,
        steps_in_version=0,
        version=0,
        bursts_ended=0,
        in_flight=in_flight,
    )


def warmed(policy, **kw):
    """Feeds two observations so both rates are known (1 group/100 exec-s, 16 per GPU-h)."""
    policy.decide(obs(t=0.0, generated=0, step=0, running=100, ready=20))
    return policy.decide(
        obs(**{"t": 100.0, "generated": 100, "step": 1, "running": 100, "ready": 20, **kw})
    )


def test_registered_with_a_docstring_rule():
    assert "tidal" in registered()
    from tidal.control import tidal_policy

    assert "Rule" in tidal_policy.__doc__


@pytest.mark.parametrize(
    "args", [{"dwell_s": -1}, {"min_train_cells": 1.5}, {"tau_s": 0}, {"nope": 1}]
)
def test_bad_arguments_are_config_errors(args):
    with pytest.raises(ConfigError):
        make_policy("tidal", args)


def test_holds_until_rates_are_measured():
    p = make_policy("tidal")
    assert p.decide(obs(t=0.0)).reason == "measuring rates"


def test_lends_the_next_cell_when_rollout_has_spare_slots():
    p = make_policy("tidal")
    d = warmed(p, waterlevel=50, pending=0)
    assert d.action is Action.TO_TRAINING and d.cells == (1,)
    assert p.waterlevel_safe


def test_never_lends_when_capacity_after_the_move_is_below_the_waterlevel():
    p = make_policy("tidal")
    d = warmed(p, waterlevel=300, pending=0)  # capacity after move 256 < 300
    assert d.action is Action.HOLD and "waterlevel" in d.reason


def test_never_lends_without_held_supply():
    p = make_policy("tidal")
    d = warmed(p, waterlevel=10, supply_ok=False)
    assert d.action is Action.HOLD


def test_returns_the_last_cell_when_rollout_is_short_and_the_queue_runs_dry():
    # 1 group per 100 s of 100 running executions: over a 300 s horizon a batch is within
    # reach (the floor keeps the core), over the default 60 s it is not (the core returns too)
    p = make_policy("tidal", {"horizon_s": 300})
    d = warmed(p, roles=("training", "training"), waterlevel=256, pending=500, ready=2, generated=1)
    assert d.action is Action.TO_ROLLOUT and d.cells == (1,)
    d = warmed(
        make_policy("tidal"),
        roles=("training", "training"),
        waterlevel=256,
        pending=500,
        ready=2,
        generated=1,
    )
    assert d.action is Action.TO_ROLLOUT and d.cells == (0, 1) and "in 60s" in d.reason


def test_keeps_min_train_cells_and_waits_out_the_dwell():
    p = make_policy("tidal", {"min_train_cells": 2})
    d = warmed(p, roles=("training", "training"), waterlevel=256, pending=500, ready=0)
    assert d.action is Action.HOLD
    q = make_policy("tidal", {"dwell_s": 1000, "tau_s": 1})
    assert warmed(q, waterlevel=50).action is Action.TO_TRAINING
    d2 = q.decide(
        obs(
            t=200.0,
            roles=("training", "training"),
            waterlevel=256,
            pending=500,
            ready=0,
            generated=101,
            step=2,
        )
    )
    assert d2.action is Action.HOLD and "dwell" in d2.reason
    # Production healthy (a batch within the horizon): the floor keeps the core training.
    d3 = q.decide(
        obs(
            t=1200.0,
            roles=("training", "training"),
            waterlevel=256,
            pending=500,
            ready=0,
            generated=130,
            step=3,
        )
    )
    assert d3.action is Action.TO_ROLLOUT and d3.cells == (1,)


def test_a_starving_trainer_gives_up_its_floor():
    # 1 group in 1000 s of 100 running executions: not one batch within 300 s even with
    # every slot producing, so the core returns with the satellite.
    p = make_policy("tidal", {"tau_s": 1})
    p.decide(obs(t=0.0, generated=0, step=0, running=100, ready=0))
    d = p.decide(
        obs(
            t=1000.0,
            roles=("training", "training"),
            waterlevel=256,
            pending=500,
            ready=0,
            generated=1,
            step=1,
            running=100,
        )
    )
    assert d.action is Action.TO_ROLLOUT and d.cells == (0, 1)
    # The same with healthy production keeps the core (min_train_cells).
    q = make_policy("tidal", {"tau_s": 1})
    q.decide(obs(t=0.0, generated=0, step=0, running=100, ready=0))
    d = q.decide(
        obs(
            t=1000.0,
            roles=("training", "training"),
            waterlevel=256,
            pending=500,
            ready=0,
            generated=20,
            step=1,
            running=100,
        )
    )
    assert d.action is Action.TO_ROLLOUT and d.cells == (1,)


def test_nothing_training_with_a_ready_batch_holds_dispatch_then_lends():
    p = make_policy("tidal")
    warmed(p, roles=("rollout", "rollout"), waterlevel=10, ready=0)
    # capacity 512, after lending cell 0: 384 < waterlevel 450: hold dispatch at 384
    d = p.decide(
        obs(t=200.0, roles=("rollout", "rollout"), waterlevel=450, ready=20, generated=120, step=1)
    )
    assert d.action is Action.HOLD and d.dispatch_limit == 384
    d = p.decide(
        obs(t=210.0, roles=("rollout", "rollout"), waterlevel=384, ready=20, generated=121, step=1)
    )
    assert d.action is Action.TO_TRAINING and d.cells == (0,)
    assert d.dispatch_limit is None
    # Without a whole batch ready (or without held supply) nothing moves.
    q = make_policy("tidal")
    warmed(q, roles=("rollout", "rollout"), waterlevel=10, ready=0)
    d = q.decide(
        obs(
            t=200.0,
            roles=("rollout", "rollout"),
            waterlevel=450,
            ready=20,
            generated=120,
            step=1,
            supply_ok=False,
        )
    )
    assert d.action is Action.HOLD and d.dispatch_limit is None


def test_returns_a_block_large_enough_for_the_missing_slots():
    p = make_policy("tidal")
    d = warmed(
        p, roles=("training",) * 4, waterlevel=256, pending=300, ready=0, generated=1
    )  # 556 to run, 256 slots: 300 missing = 3 cells of 128
    assert d.action is Action.TO_ROLLOUT and d.cells == (1, 2, 3)


def test_initial_prefix_is_start_cells_not_the_floor():
    cells = tuple(CellView(i, 128, 8, CellKind.HYBRID, Role.ROLLOUT) for i in range(3))
    assert make_policy("tidal").initial_prefix(cells) == 0  # nothing to train yet
    assert make_policy("tidal", {"min_train_cells": 5}).initial_prefix(cells) == 0
    assert make_policy("tidal", {"start_cells": 5}).initial_prefix(cells) == 3


def test_holds_dispatch_so_the_next_cell_can_train_when_production_leads():
    p = make_policy("tidal")
    d = warmed(p, waterlevel=300, pending=0)  # production leads: drift after the move > 0
    assert d.action is Action.HOLD and d.dispatch_limit == 256  # capacity after the move
    d2 = p.decide(obs(t=110.0, waterlevel=250, generated=101, step=1, running=100))
    assert d2.action is Action.TO_TRAINING and d2.cells == (1,) and d2.dispatch_limit is None


def test_no_dispatch_hold_when_the_trainer_would_outpace_rollout():
    p = make_policy("tidal")
    p.decide(obs(t=0.0, generated=0, step=0, running=100, ready=0))
    d = p.decide(obs(t=100.0, generated=1, step=4, running=100, ready=0, waterlevel=300))
    assert d.action is Action.HOLD and d.dispatch_limit is None


class _Held:
    """A policy answering with a fixed dispatch hold (``Decision.dispatch_limit``)."""

    def __init__(self, inner, limit):
        self.inner, self.limit = inner, limit

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def decide(self, o):
        return dataclasses.replace(self.inner.decide(o), dispatch_limit=self.limit)


def test_the_simulated_dispatcher_honours_the_dispatch_limit():
    from tidal.sim import dispatch
    from tidal.sim.world import World
    from tidal.testing.sim_scenarios import tiny_scenario

    w = World(tiny_scenario(), "static:cells=1")  # a policy that never sets the limit itself
    w.controller.policy = _Held(w.controller.policy, 0)
    w._start()
    assert w.ledger.waterlevel == 0 and not w.queue  # nothing dispatched on demand
    w.controller.policy.limit = w.controller._dispatch_limit = 8  # as a decision now would
    dispatch.fill(w)
    assert w.ledger.waterlevel == 8
    w.controller.policy.limit = w.controller._dispatch_limit = None
    dispatch.fill(w)
    assert w.ledger.waterlevel > 8


def test_a_registered_policy_can_be_unregistered_once():
    from tidal.control.policy import register_policy, unregister_policy
    from tidal.errors import UnknownPolicyError

    register_policy("tmp-static", "test")(type(make_policy("static")))
    assert "tmp-static" in registered()
    unregister_policy("tmp-static")
    assert "tmp-static" not in registered()
    with pytest.raises(UnknownPolicyError):
        unregister_policy("tmp-static")


def test_an_over_subscribed_run_keeps_every_other_invariant_and_reports_the_waits():
    """On a generated agentic scenario with a backlog the rule fires: moves below the
    waterlevel (marked in the log), every DESIGN.md invariant checked after every event
    (nothing dropped: displaced executions wait for a slot), the waits measured; with
    ``max_queued=0`` (the default) the same run never over-subscribes."""
    from tidal.sim.generate import generate
    from tidal.sim.runner import run_policy

    sc = generate(2026, 6).model_copy(update={"mechanics": "tidal"}).scaled(0.5, bursts=1)
    res = run_policy(sc, "tidal:max_queued=256", check=True)
    slots = res.world.controller.cells.cells[0].slots
    over = [r for r in res.records if r.get("oversubscribe")]
    assert over and all(r["inputs"]["capacity"] - slots < r["inputs"]["waterlevel"] for r in over)
    s = res.summary
    assert s["queued_executions"] > 0
    assert 0 < s["queued_execution_p99_s"] <= s["queued_execution_max_s"] <= 900.0
    for spec in ("tidal:max_queued=0", "tidal"):
        off = run_policy(sc, spec, check=True)
        assert not [r for r in off.records if r.get("oversubscribe")]
