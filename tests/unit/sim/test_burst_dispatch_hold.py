"""The simulator's burst dispatcher honours the policy's dispatch hold as the runtime's does
(``tidal.runtime.dispatcher``: every group, whatever the mechanics, goes only when
``tidal.control.dispatch_hold.may_dispatch`` admits it): a held group waits in its place and
goes as soon as the hold admits it; nothing is lost and the run finishes.

The holding policy is registered for this module only (the oracle tests iterate every
registered policy): the static split, with a dispatch limit that follows a schedule in time.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tidal.control.dispatch_hold import may_dispatch
from tidal.control.policies_simple import StaticPolicy
from tidal.control.policy import Decision, Observation, register_policy, unregister_policy
from tidal.sim import dispatch
from tidal.sim.world import World
from tidal.testing.sim_scenarios import tiny_scenario
from tidal.types import BurstStarted, ExecutionDispatched

NAME = "test-burst-hold"


class _ScheduledHold(StaticPolicy):
    """One training cell, never a move; ``dispatch_limit`` = ``limits[i]`` during the i-th
    ``period_s`` of the run (an entry of None: no hold), lifted after the last one."""

    name = NAME

    def __init__(self, limits: list[int | None], period_s: float) -> None:
        super().__init__(cells=1)
        self.limits, self.period_s = list(limits), float(period_s)
        self.dispatch_limit: int | None = self.limits[0] if self.limits else None

    def decide(self, obs: Observation) -> Decision:
        i = int(obs.now_s // self.period_s)
        self.dispatch_limit = self.limits[i] if i < len(self.limits) else None
        return Decision.hold(
            f"holding dispatch at {self.dispatch_limit} executions",
            dispatch_limit=self.dispatch_limit,
        )


@pytest.fixture(scope="module", autouse=True)
def _registered():
    register_policy(NAME, "test: static split with a scheduled dispatch hold")(_ScheduledHold)
    yield
    unregister_policy(NAME)


def _scenario(limits: list[int | None], period_s: float, interval_s: float = 0.0):
    """Burst mechanics (the runtime's: the whole quota group by group, every dispatched group
    trained), 4 executions a group, 8 groups a burst."""
    return tiny_scenario(
        control={"group_size": 4, "batch_groups": 4, "updates_per_burst": 2, "bursts": 3},
        sim={"dispatch_interval_s": interval_s, "max_virtual_s": 86400.0},
        profiles={
            NAME: {
                "dispatch": "burst",
                "trainer": "batch",
                "sync": "keep",
                "staleness_threshold": 0.0,
            }
        },
        policy_args={NAME: {"limits": limits, "period_s": period_s}},
    )


def _run(sc, monkeypatch):
    """Runs the world with every invariant checked after every event (and: a burst group is
    held only while the rule refuses it, so it goes as soon as the hold admits it). Returns
    the world, each dispatch as (time, burst, waterlevel before, limit), every event the
    controller handled and the waterlevel after each."""
    sent: list[tuple[float, int, int, int | None]] = []
    events: list[object] = []
    levels: list[int] = []
    orig = dispatch.dispatch_group

    def record(w) -> None:
        sent.append((w.now, w.burst, w.ledger.waterlevel, w.controller.dispatch_limit))
        orig(w)

    monkeypatch.setattr(dispatch, "dispatch_group", record)
    w = World(sc, NAME, check=True)
    handle = w.controller.handle

    def seen(ev) -> None:
        events.append(ev)
        handle(ev)
        levels.append(w.ledger.waterlevel)

    check = w.check_invariants

    def checked() -> None:  # after every simulated event: a held group is one the rule refuses
        check()
        assert not (
            w.burst_held and may_dispatch(w.ledger.waterlevel, 4, w.controller.dispatch_limit)
        )

    monkeypatch.setattr(w.controller, "handle", seen)
    monkeypatch.setattr(w, "check_invariants", checked)
    return w.run(), sent, events, levels


def _no_loss(w, sc, events) -> None:
    """Finished; every execution announced by a burst dispatched exactly once."""
    assert w.trainer.step == sc.total_steps
    quota = sum(ev.quota_executions for ev in events if isinstance(ev, BurstStarted))
    eids = [ev.execution_id for ev in events if isinstance(ev, ExecutionDispatched)]
    assert len(eids) == len(set(eids)) == quota
    assert w.ledger.duplicate_closes == 0


@pytest.mark.parametrize("interval_s", [0.0, 5.0])
def test_a_held_burst_never_dispatches_past_the_limit(interval_s, monkeypatch):
    sc = _scenario([8], period_s=1e9, interval_s=interval_s)  # held at two groups throughout
    w, sent, events, levels = _run(sc, monkeypatch)
    _no_loss(w, sc, events)
    for _, _, level, limit in sent:
        assert limit == 8 and level + 4 <= 8
    assert max(levels) == 8  # reached, never passed


@pytest.mark.parametrize("interval_s", [0.0, 5.0])
def test_held_groups_go_as_soon_as_the_hold_lifts(interval_s, monkeypatch):
    # limit 0 for the first 25 s: nothing goes; the first event after it (the tick at 30 s)
    # lifts the hold and the whole quota goes from there (paced: interval_s apart)
    sc = _scenario([0], period_s=25.0, interval_s=interval_s)
    w, sent, events, _ = _run(sc, monkeypatch)
    _no_loss(w, sc, events)
    first = [t for t, b, _, _ in sent if b == 0]
    assert first[0] == pytest.approx(30.0)
    assert [b - a for a, b in itertools.pairwise(first)] == pytest.approx(
        [interval_s] * (len(first) - 1)
    )


_LIMITS = st.lists(st.none() | st.integers(0, 40), min_size=1, max_size=6)


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    limits=_LIMITS,
    period_s=st.sampled_from([7.0, 30.0, 90.0]),
    interval_s=st.sampled_from([0.0, 3.0]),
)
def test_a_changing_hold_admits_only_what_the_rule_admits(
    limits, period_s, interval_s, monkeypatch
):
    sc = _scenario(limits, period_s, interval_s)
    w, sent, events, _ = _run(sc, monkeypatch)
    _no_loss(w, sc, events)
    for _, _, level, limit in sent:
        assert may_dispatch(level, 4, limit)
    gids = [ev.group_id for ev in events if isinstance(ev, ExecutionDispatched)]
    assert len(set(gids)) * 4 == len(gids)  # whole groups
