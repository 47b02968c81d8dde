"""verl's formulas, with REFERENCE.md §2's worked check."""

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
    base = dict(required_samples=10, trigger_parameter_sync_step=4, total_generated_samples=110,
                expected_samples=100, buffer_samples=0)
    base.update(kw)
    return VerlContext(**base)


def test_worked_example_ratio_and_wait_samples():
    h = DefaultHooks(deactivate_ratio=0.5)
    assert ctx().step_required_samples == 40
    assert h.deactivate_wait_samples(ctx()) == 20
    h.update_after_step(1, ctx(step_wait_samples=(2,)))
    assert h.deactivate_ratio == pytest.approx(0.55)
    h.update_after_step(2, ctx(step_wait_samples=(0,)))
    assert h.deactivate_ratio == pytest.approx(0.53)


def test_worked_example_activation_gate():
    h = DefaultHooks(deactivate_ratio=0.5)
    assert h.gap(ctx()) == pytest.approx(10)
    # 1 s of waits over 10 samples: benefit 10 * 0.1 = 1 s < switch cost 10 s.
    assert not h.should_activate_after_step(1, False, ctx(step_wait_times=(1.0,),
                                                          step_wait_samples=(10,)))
    # 20 s over 10 samples: benefit 10 * 2 = 20 s > 10 s.
    assert h.should_activate_after_step(2, False, ctx(step_wait_times=(20.0,),
                                                      step_wait_samples=(10,)))


def test_per_sample_time_defaults_pessimistic_and_is_kept():
    h = DefaultHooks(deactivate_ratio=0.5)
    assert h.per_sample_time_s == 1000.0
    assert h.should_activate_after_step(0, False, ctx())  # 10 * 1000 > 10
    h.should_activate_after_step(1, False, ctx(step_wait_times=(4.0,), step_wait_samples=(8,)))
    assert h.per_sample_time_s == 0.5
    h.should_activate_after_step(2, False, ctx())  # no waits: previous estimate kept
    assert h.per_sample_time_s == 0.5


def test_ratio_step_is_clipped_and_capped():
    h = DefaultHooks(deactivate_ratio=0.95)
    h.update_after_step(1, ctx(step_wait_samples=(30,)))  # 30/40 -> clipped to 0.1, capped at 1
    assert h.deactivate_ratio == 1.0
    h = DefaultHooks(deactivate_ratio=0.5)
    h.update_after_step(1, ctx(step_wait_samples=(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1)))
    assert h.deactivate_ratio == pytest.approx(0.525)  # 1/40 = 0.025 within [0.02, 0.1]


def test_no_lower_bound_like_verl_unless_clamped():
    h = DefaultHooks(deactivate_ratio=0.02)
    for _ in range(3):
        h.update_after_step(1, ctx())
    assert h.deactivate_ratio == pytest.approx(-0.04)  # verl's known defect, reproduced
    c = DefaultHooks(deactivate_ratio=0.3, clamp=True)
    for _ in range(20):
        c.update_after_step(1, ctx())
    assert c.deactivate_ratio == pytest.approx(0.25)  # 1 / trigger


def test_switch_cost_is_mean_of_last_three():
    h = DefaultHooks()
    assert h.switch_cost_s() == 10.0
    for cycle, (a, d) in enumerate([(1, 1), (2, 2), (3, 3), (4, 4)]):
        h.should_activate_after_step(cycle, False, ctx(last_activate_duration_s=a,
                                                       last_deactivate_duration_s=d,
                                                       switch_cycle=cycle))
    assert h.switch_cost_s() == pytest.approx((4 + 6 + 8) / 3)


def test_only_hybrid_forces_activation_and_ratio_one():
    h = DefaultHooks(deactivate_ratio=0.3)
    assert h.should_activate_after_step(1, False, ctx(only_hybrid=True,
                                                      total_generated_samples=10**6))
    h.update_after_step(1, ctx(only_hybrid=True))
    assert h.deactivate_ratio == 1.0


def test_fixed_ratio_is_pure_gap_check_and_never_adapts():
    h = FixedRatioHooks(deactivate_ratio=0.5)
    assert h.should_activate_after_step(1, False, ctx(total_generated_samples=119))  # 19 < 20
    assert not h.should_activate_after_step(1, False, ctx(total_generated_samples=120))
    h.update_after_step(1, ctx(step_wait_samples=(5,)))
    assert h.deactivate_ratio == 0.5


def test_static_never_activates_except_colocated_fallback():
    h = StaticHooks()
    assert h.deactivate_wait_samples(ctx()) == 0
    assert not h.should_activate_after_step(1, False, ctx(total_generated_samples=0))
    assert h.should_activate_after_step(1, False, ctx(only_hybrid=True))


def test_dispatch_budget():
    assert dispatch_budget(16, 0.5, 4) == 96
    assert dispatch_budget(10, 0.0, 4) == 40


def test_bad_ratio_is_a_config_error():
    with pytest.raises(ConfigError, match="deactivate_ratio"):
        make_policy("verl-default", {"deactivate_ratio": -0.1})
    with pytest.raises(ConfigError, match="deactivate_ratio"):
        make_policy("verl-fixed-ratio", {"deactivate_ratio": 1.5})


def test_scheduler_hook_order(obs):
    """start-up activation -> should_deactivate at cycle start -> wait for samples ->
    deactivate -> after the sync: activation check, then update_after_step."""
    p = make_policy("verl-default", {"deactivate_ratio": 0.5})
    hyb = dict(kind=CellKind.HYBRID, standalone_slots=10)
    d = p.decide(obs(roles="TT", **hyb))
    assert d.action is Action.TO_ROLLOUT and d.cells == (0, 1) and d.style.value == "verl"
    assert p.hooks.deactivate_ratio == 0.5  # no update_after_step before any step
    # Hybrid active; the trainer asks for its first step of the cycle. SR = 8*4 = 32: wait 16.
    d = p.decide(obs(roles="RR", trainer_waiting=True, supply=10, **hyb))
    assert d.action is Action.HOLD and "16" in d.reason
    d = p.decide(obs(roles="RR", trainer_waiting=True, supply=16, **hyb))
    assert d.action is Action.TO_TRAINING and d.cells == (0, 1)
    # After the weight sync of version 1: 4 steps waited 0 samples -> ratio 0.48.
    d = p.decide(obs(roles="TT", version=1, trainer_step=4, groups_generated=40,
                     cycle_queue_at_start=(8, 8, 8, 8), cycle_wait_times_s=(0, 0, 0, 0), **hyb))
    assert p.hooks.deactivate_ratio == pytest.approx(0.48)
    # gap = 0.5*32 - (40 - 32) = 8 > 0, per-sample time still 1000 s: activate.
    assert d.action is Action.TO_ROLLOUT
