"""verl's policy formulas with worked numbers taken from verl 0.9.1's code
(``dynamic_schedule/default_policy.py``, ``fixed_ratio_policy.py``,
``static_fully_async_policy.py``), and the scheduler's hook order (``fully_async_trainer.py``).
The same classes are driven against the released wheel in ``test_verl_conformance.py``."""

import pytest

from tidal.control.policy import Action, make_policy
from tidal.control.verl import (
    DefaultHooks,
    FixedRatioHooks,
    StaticHooks,
    VerlContext,
    dispatch_budget,
)
from tidal.errors import ConfigError
from tidal.types import CellKind


def ctx(**kw):
    base = dict(
        required_samples=10,
        trigger_parameter_sync_step=4,
        total_generated_samples=110,
        expected_samples=100,
        buffer_samples=0,
    )
    base.update(kw)
    return VerlContext(**base)


def test_worked_example_ratio_and_wait_samples():
    h = DefaultHooks(deactivate_ratio=0.5)
    assert ctx().step_required_samples == 40
    assert h.deactivate_wait_samples(ctx()) == 20  # int(40 * 0.5)
    h.update_after_step(1, ctx(step_wait_samples=(2,)))  # 2/40 = 0.05 in [0.02, 0.1]
    assert h.deactivate_ratio == pytest.approx(0.55)
    h.update_after_step(2, ctx(step_wait_samples=(0,)))  # no real wait: -0.02
    assert h.deactivate_ratio == pytest.approx(0.53)


def test_update_at_step_zero_is_a_no_op():
    # verl: ``if global_steps <= 0 or self.only_hybrid: return`` (the sync before fit)
    h = DefaultHooks(deactivate_ratio=0.5)
    h.update_after_step(0, ctx(step_wait_samples=(40,), last_activate_duration_s=5.0))
    assert h.deactivate_ratio == 0.5 and h.switch_cost_s() == 10.0


def test_worked_example_activation_gate():
    h = DefaultHooks(deactivate_ratio=0.5)
    assert h.gap(ctx()) == pytest.approx(10)  # 0.5 * 40 - (110 - 100)
    # 1 s of waits over 10 samples: benefit 10 * 0.1 = 1 s < switch cost 10 s.
    assert not h.should_activate_after_step(
        1, False, ctx(step_wait_times=(1.0,), step_wait_samples=(10,))
    )
    # 20 s over 10 samples: benefit 10 * 2 = 20 s > 10 s.
    assert h.should_activate_after_step(
        2, False, ctx(step_wait_times=(20.0,), step_wait_samples=(10,))
    )


def test_per_sample_time_only_refreshes_on_cycles_with_a_positive_gap():
    h = DefaultHooks(deactivate_ratio=0.5)
    assert h.per_sample_time_s == 1000.0
    assert h.should_activate_after_step(0, False, ctx())  # 10 * 1000 > 10
    h.should_activate_after_step(1, False, ctx(step_wait_times=(4.0,), step_wait_samples=(8,)))
    assert h.per_sample_time_s == 0.5
    h.should_activate_after_step(2, False, ctx())  # no waits: previous estimate kept
    assert h.per_sample_time_s == 0.5
    # gap <= 0 (surplus 30 >= threshold 20): verl returns before estimating anything
    assert not h.should_activate_after_step(
        3, False, ctx(total_generated_samples=130, step_wait_times=(9.0,), step_wait_samples=(3,))
    )
    assert h.per_sample_time_s == 0.5


def test_ratio_step_is_clipped_and_capped():
    h = DefaultHooks(deactivate_ratio=0.95)
    h.update_after_step(1, ctx(step_wait_samples=(30,)))  # 30/40 -> clipped to 0.1, capped at 1
    assert h.deactivate_ratio == 1.0
    h = DefaultHooks(deactivate_ratio=0.5)
    h.update_after_step(1, ctx(required_samples=100, step_wait_samples=(1,)))  # 1/400
    assert h.deactivate_ratio == pytest.approx(0.52)  # clipped up to 0.02


def test_ratio_step_uses_the_sum_of_wait_samples():
    h = DefaultHooks(deactivate_ratio=0.5)
    h.update_after_step(1, ctx(step_wait_samples=(0, 1)))  # 1/40 = 0.025
    assert h.deactivate_ratio == pytest.approx(0.525)
    h.update_after_step(2, ctx(step_wait_samples=(0, 0, 0, 0)))
    assert h.deactivate_ratio == pytest.approx(0.505)


def test_no_lower_bound_like_verl_unless_clamped():
    h = DefaultHooks(deactivate_ratio=0.02)
    for step in range(1, 4):
        h.update_after_step(step, ctx())
    assert h.deactivate_ratio == pytest.approx(-0.04)  # verl's known defect, reproduced
    assert h.deactivate_wait_samples(ctx()) == -1  # int(40 * -0.04): deactivates at once
    c = DefaultHooks(deactivate_ratio=0.3, clamp=True)
    for step in range(1, 21):
        c.update_after_step(step, ctx())
    assert c.deactivate_ratio == pytest.approx(0.25)  # 1 / trigger


def test_switch_cost_is_recorded_after_the_step_whenever_the_sum_is_positive():
    h = DefaultHooks()
    assert h.switch_cost_s() == 10.0
    # a deactivation alone counts (verl: ``if switch_overhead > 0``)
    h.update_after_step(1, ctx(last_deactivate_duration_s=3.0))
    assert h.switch_cost_s() == 3.0
    h.update_after_step(2, ctx())  # nothing switched: nothing recorded
    assert h.switch_cost_s() == 3.0
    for step, (a, d) in enumerate([(2, 2), (3, 3), (4, 4)], start=3):
        h.update_after_step(step, ctx(last_activate_duration_s=a, last_deactivate_duration_s=d))
    assert h.switch_cost_s() == pytest.approx((4 + 6 + 8) / 3)  # mean of the last 3
    # the activation check reads it, never records it
    h.should_activate_after_step(7, False, ctx(last_activate_duration_s=50.0))
    assert h.switch_cost_s() == pytest.approx(6.0)


def test_only_hybrid_is_the_constructor_flag():
    h = DefaultHooks(deactivate_ratio=0.3, only_hybrid=True)
    assert h.deactivate_ratio == 1.0
    assert h.should_activate_after_step(1, False, ctx(total_generated_samples=10**6))
    h.update_after_step(1, ctx(step_wait_samples=(0,)))
    assert h.deactivate_ratio == 1.0  # no adaptation
    # verl reads its own flag, not the context's
    g = DefaultHooks(deactivate_ratio=0.3)
    assert not g.should_activate_after_step(
        1, False, ctx(only_hybrid=True, total_generated_samples=10**6)
    )


def test_fixed_ratio_is_pure_gap_check_and_never_adapts():
    h = FixedRatioHooks(deactivate_ratio=0.5)
    assert h.should_activate_after_step(1, False, ctx(total_generated_samples=119))  # 19 < 20
    assert not h.should_activate_after_step(1, False, ctx(total_generated_samples=120))
    h.update_after_step(1, ctx(step_wait_samples=(5,)))
    assert h.deactivate_ratio == 0.5


def test_static_never_activates_unless_the_colocated_fallback_is_asked_for():
    h = StaticHooks(only_hybrid=True)
    assert h.deactivate_wait_samples(ctx()) == 0
    assert not h.should_activate_after_step(1, False, ctx(total_generated_samples=0))
    f = StaticHooks(only_hybrid=True, colocated_fallback=True)
    assert f.should_activate_after_step(1, False, ctx())
    assert f.deactivate_wait_samples(ctx()) == 40
    assert not StaticHooks(colocated_fallback=True).should_activate_after_step(1, False, ctx())


def test_dispatch_budget():
    assert dispatch_budget(16, 0.5, 4) == 96
    assert dispatch_budget(10, 0.0, 4) == 40


def test_bad_arguments_are_config_errors():
    with pytest.raises(ConfigError, match="deactivate_ratio"):
        make_policy("verl-default", {"deactivate_ratio": -0.1})
    with pytest.raises(ConfigError, match="deactivate_ratio"):
        make_policy("verl-fixed-ratio", {"deactivate_ratio": 1.5})
    with pytest.raises(ConfigError, match="rebalance"):
        make_policy("verl-default", {"rebalance": "yes please"})
    with pytest.raises(ConfigError, match="colocated_fallback"):
        make_policy("verl-static", {"colocated_fallback": 1})


def test_scheduler_hook_order(obs):
    """sync before fit (version 0): should_activate_after_step with expected = SR x 1 ->
    activation -> update_after_step once it completed; every trainer step: should_deactivate
    -> wait for samples -> deactivate; after the sync: activation check, then the update with
    the cycle's switch durations."""
    p = make_policy("verl-default", {"deactivate_ratio": 0.5})
    hyb = dict(kind=CellKind.HYBRID, standalone_slots=10)
    d = p.decide(obs(roles="TT", **hyb))
    assert d.action is Action.TO_ROLLOUT and d.cells == (0, 1) and d.style.value == "verl"
    assert p._ctx.expected_samples == 32  # SR = 8 * 4, the rollouter's steps start at 1
    # the activation completed (3 s): update_after_step(0) is a no-op in verl
    p.decide(obs(roles="RR", last_activate_duration_s=3.0, **hyb))
    assert p.hooks.deactivate_ratio == 0.5 and p.hooks.switch_cost_s() == 10.0
    # Hybrid active; the trainer asks for its first step. SR = 32: wait for 16.
    d = p.decide(obs(roles="RR", trainer_waiting=True, supply=10, **hyb))
    assert d.action is Action.HOLD and "16" in d.reason
    d = p.decide(obs(roles="RR", trainer_waiting=True, supply=16, **hyb))
    assert d.action is Action.TO_TRAINING and d.cells == (0, 1)
    p.decide(obs(roles="TT", trainer_waiting=True, last_deactivate_duration_s=2.0, **hyb))
    # After the sync of version 1: 4 steps waited 0 samples; 40 groups generated.
    # gap = 0.5*32 - (40 - 32) = 8 > 0, per-sample time still 1000 s: activate.
    d = p.decide(
        obs(
            roles="TT",
            version=1,
            trainer_step=4,
            groups_generated=40,
            cycle_queue_at_start=(8, 8, 8, 8),
            cycle_wait_times_s=(0, 0, 0, 0),
            last_deactivate_duration_s=2.0,
            **hyb,
        )
    )
    assert d.action is Action.TO_ROLLOUT
    assert p.hooks.deactivate_ratio == 0.5  # the update waits for the activation
    p.decide(obs(roles="RR", version=1, trainer_step=4, last_activate_duration_s=4.0, **hyb))
    assert p.hooks.deactivate_ratio == pytest.approx(0.48)
    assert p.hooks.switch_cost_s() == pytest.approx(6.0)  # 2 s deactivate + 4 s activate
    # the rollouter's steps: the window before the first sync generated, so expected = 2 SR
    p.decide(obs(roles="TT", version=2, trainer_step=8, groups_generated=40, **hyb))
    assert p._ctx.expected_samples == 64


def test_static_without_standalone_is_refused_by_the_controller():
    from tidal.clock import ManualClock
    from tidal.control.cells import Cell, CellSet
    from tidal.control.controller import Controller, ControllerSettings

    cells = CellSet([Cell(i, 4, 8, CellKind.HYBRID) for i in range(2)])
    with pytest.raises(ConfigError, match="no rollout capacity"):
        Controller(
            cells,
            make_policy("verl-static"),
            ManualClock(),
            None,
            ControllerSettings(batch_groups=2, updates_per_burst=1),
        )
    cells = CellSet([Cell(i, 4, 8, CellKind.HYBRID) for i in range(2)])
    Controller(
        cells,
        make_policy("verl-static", {"colocated_fallback": True}),
        ManualClock(),
        None,
        ControllerSettings(batch_groups=2, updates_per_burst=1),
    )
