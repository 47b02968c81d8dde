"""The decision log stays proportional to decisions: a hold repeated with the same kind (its
reason up to the numbers) and the same dispatch limit is logged once, whatever its other
numbers (a waterlevel that moves with every event); a hold whose limit or kind changes is
logged again, so the log shows every limit the policy held dispatch at."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tidal.clock import ManualClock
from tidal.control.cells import Cell, CellSet
from tidal.control.controller import Controller, ControllerSettings
from tidal.control.decision_log import DecisionLog
from tidal.control.policy import Decision
from tidal.testing import FakeActuator
from tidal.types import ExecutionDispatched

KINDS = (
    "holding dispatch so cell {n} can train (waterlevel {n})",
    "capacity after move {n} < waterlevel {n}",
    "measuring rates",
)

# a step: a hold (kind, limit, the reason's other number) or a move
_HOLD = st.tuples(
    st.just("hold"), st.integers(0, 2), st.none() | st.integers(0, 3), st.integers(0, 10_000)
)
_STEP = _HOLD | st.tuples(st.just("to_training"), st.just(0), st.none(), st.just(0))


def _logged(steps) -> list[int]:
    """Indices of the steps the log writes."""
    log = DecisionLog()
    for i, (action, kind, limit, n) in enumerate(steps):
        log.decision({"i": i, "action": action, "reason": KINDS[kind].format(n=n)}, limit)
    return [r["i"] for r in log.records]


@given(
    steps=st.lists(_STEP, max_size=40),
    noise=st.lists(st.integers(0, 10_000), min_size=40, max_size=40),
)
def test_a_hold_is_logged_once_per_kind_and_limit(steps, noise):
    got = _logged(steps)
    want = [
        i
        for i, s in enumerate(steps)
        if s[0] != "hold" or i == 0 or steps[i - 1][0] != "hold" or steps[i - 1][1:3] != s[1:3]
    ]
    assert got == want
    # the reason's other numbers never make a line: the same decisions with other numbers
    # log the same steps
    other = [(a, k, lim, m) for (a, k, lim, _), m in zip(steps, noise[: len(steps)], strict=True)]
    assert _logged(other) == got


@given(limits=st.lists(st.integers(0, 5), min_size=1, max_size=30))
def test_every_change_of_limit_in_a_run_of_holds_is_logged_once(limits):
    got = _logged([("hold", 0, lim, i) for i, lim in enumerate(limits)])
    changes = [i for i, lim in enumerate(limits) if i == 0 or limits[i - 1] != lim]
    assert got == changes


class _Holding:
    """Holds dispatch at the limits it is given, one per decision; the reason names only the
    waterlevel (the limit is data: ``dispatch_limit``, logged with ``state``)."""

    name, waterlevel_safe = "holding", True

    def __init__(self, limits: list[int]) -> None:
        self.limits, self.dispatch_limit = iter(limits), None

    def initial_prefix(self, cells) -> int:
        return 0

    def state(self) -> dict:
        return {"dispatch_limit": self.dispatch_limit}

    def decide(self, obs) -> Decision:
        self.dispatch_limit = next(self.limits)
        return Decision.hold(
            f"holding dispatch so a cell can train (waterlevel {obs.waterlevel})",
            dispatch_limit=self.dispatch_limit,
        )


def test_the_controller_logs_each_limit_the_policy_holds_at():
    limits = [10, 10, 10, 6, 6, 4, 4, 4, 4, 6]
    clock, log = ManualClock(), DecisionLog()
    act = FakeActuator(clock)
    ctl = Controller(
        CellSet([Cell(i, 4, 8) for i in range(2)]),
        _Holding(limits),
        clock,
        act,
        ControllerSettings(batch_groups=2, updates_per_burst=1),
        log,
    )
    act.bind(ctl)
    for i in range(len(limits)):  # the waterlevel (in the reason) moves with every event
        ctl.handle(ExecutionDispatched(clock.now(), f"e{i}", f"g{i}", 1, 0))
    logged = [r["state"]["dispatch_limit"] for r in log.records if r["type"] == "decision"]
    assert logged == [10, 6, 4, 6]
