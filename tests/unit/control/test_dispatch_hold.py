"""The dispatch hold's one rule (``tidal.control.dispatch_hold``): a dispatcher that asks it
before every group, in order, never raises the outstanding work past the policy's limit, never
drops or repeats a group, and dispatches everything held once the hold is lifted."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.control.dispatch_hold import may_dispatch


@given(outstanding=st.integers(0, 500), k=st.integers(1, 64), limit=st.none() | st.integers(0, 600))
def test_a_group_goes_iff_it_keeps_the_outstanding_work_within_the_limit(outstanding, k, limit):
    assert may_dispatch(outstanding, k, limit) == (limit is None or outstanding + k <= limit)
    if limit is not None and may_dispatch(outstanding, k, limit):  # less work never refused
        assert may_dispatch(max(0, outstanding - 1), k, limit)


# One step of a run: the policy sets or lifts its limit, or executions finish.
_STEP = st.one_of(
    st.tuples(st.just("limit"), st.none() | st.integers(0, 40)),
    st.tuples(st.just("finish"), st.integers(0, 12)),
)


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 8), min_size=1, max_size=30),
    start=st.integers(0, 30),
    steps=st.lists(_STEP, max_size=40),
)
def test_held_groups_wait_in_order_and_all_go_once_the_hold_lifts(sizes, start, steps):
    pending = list(enumerate(sizes))  # (group, executions), in dispatch order
    sent: list[int] = []
    running = [("before", 1)] * start  # executions outstanding when the hold is first set
    limit: int | None = None

    def dispatch() -> None:  # what a dispatcher does whenever the work or the limit changes
        while pending and may_dispatch(len(running), pending[0][1], limit):
            g, k = pending.pop(0)
            sent.append(g)
            running.extend([(g, 1)] * k)
            assert limit is None or len(running) <= limit  # never past the hold

    for kind, arg in steps:
        if kind == "limit":
            limit = arg
        else:
            del running[:arg]
        before = len(running)
        dispatch()
        if limit is not None and before > limit:
            assert len(running) == before  # above the limit: only draining
        assert sent + [g for g, _ in pending] == list(range(len(sizes)))  # none lost, in order
    limit = None  # the hold is lifted: every held group goes at once
    dispatch()
    assert sent == list(range(len(sizes))) and not pending
