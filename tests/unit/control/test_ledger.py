import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.control.ledger import Ledger
from tidal.errors import LedgerError
from tidal.types import CloseReason, ExecState


def _group(ledger, gid, n, burst=0):
    ids = [f"{gid}-{i}" for i in range(n)]
    for eid in ids:
        ledger.dispatch(eid, gid, n, burst)
    return ids


def test_waterlevel_counts_queued_plus_running():
    lg = Ledger()
    ids = _group(lg, "g", 4)
    assert lg.waterlevel == 4 and lg.total.queued == 4
    lg.launch(ids[0])
    lg.launch(ids[1])
    assert (lg.total.queued, lg.total.running, lg.waterlevel) == (2, 2, 4)
    lg.close(ids[0], CloseReason.COMPLETED, 1.0)
    assert (lg.total.dispatched, lg.total.launched, lg.total.finished) == (4, 2, 1)
    assert lg.waterlevel == 3
    lg.check()


def test_duplicate_close_is_ignored_and_counted():
    lg = Ledger()
    (eid,) = _group(lg, "g", 1)
    lg.launch(eid)
    assert lg.close(eid, CloseReason.COMPLETED, 0.5)
    assert not lg.close(eid, CloseReason.FAILED, 0.0)
    assert lg.duplicate_closes == 1
    assert lg.total.finished == 1
    assert lg.executions[eid].reason is CloseReason.COMPLETED
    assert lg.close_reasons[CloseReason.FAILED] == 0


def test_retries_move_no_counter():
    lg = Ledger()
    (eid,) = _group(lg, "g", 1)
    lg.launch(eid)
    before = (lg.total.dispatched, lg.total.launched, lg.total.finished)
    for _ in range(5):
        lg.retry(eid)
    assert (lg.total.dispatched, lg.total.launched, lg.total.finished) == before
    assert lg.retries == 5 and lg.executions[eid].retries == 5


def test_cancel_before_launch_keeps_identity():
    lg = Ledger()
    (eid,) = _group(lg, "g", 1)
    lg.close(eid, CloseReason.CANCELLED, 0.0)
    assert lg.waterlevel == 0
    assert lg.total.launched == lg.total.finished == 1
    lg.check()


def test_group_ready_needs_all_members_closed_and_scored():
    lg = Ledger()
    ids = _group(lg, "g", 3)
    for eid in ids:
        lg.launch(eid)
    lg.close(ids[0], CloseReason.COMPLETED, 1.0)
    lg.close(ids[1], CloseReason.TIMEOUT, 0.0)
    lg.close(ids[2], CloseReason.COMPLETED)  # closed, not scored yet
    assert lg.ready_unassigned == 0
    lg.score(ids[2], 0.25)
    assert lg.ready_unassigned == 1 and lg.groups_ready_total == 1
    lg.assign(["g"])
    assert lg.ready_unassigned == 0
    with pytest.raises(LedgerError, match="assigned twice"):
        lg.assign(["g"])


def test_bad_events_raise_clear_errors():
    lg = Ledger()
    _group(lg, "g", 2)
    with pytest.raises(LedgerError, match="unknown execution"):
        lg.close("nope", CloseReason.COMPLETED)
    with pytest.raises(LedgerError, match="dispatched twice"):
        lg.dispatch("g-0", "g", 2)
    with pytest.raises(LedgerError, match="already has its 2"):
        lg.dispatch("g-9", "g", 2)
    with pytest.raises(LedgerError, match="has size 2"):
        lg.dispatch("x", "g", 3)
    with pytest.raises(LedgerError, match="scored before it closed"):
        lg.score("g-0", 1.0)
    with pytest.raises(LedgerError, match="before it is ready"):
        lg.assign(["g"])


def test_per_burst_counters():
    lg = Ledger()
    a = _group(lg, "a", 2, burst=0)
    _group(lg, "b", 2, burst=1)
    lg.launch(a[0])
    lg.close(a[0], CloseReason.COMPLETED, 1.0)
    assert lg.bursts[0].waterlevel == 1 and lg.bursts[1].waterlevel == 2
    lg.check()


ops = st.lists(
    st.tuples(
        st.sampled_from(["dispatch", "launch", "close", "score", "retry", "assign"]),
        st.integers(0, 40),
        st.sampled_from(list(CloseReason)),
        st.one_of(st.none(), st.floats(-1, 1)),
    ),
    max_size=200,
)


@settings(max_examples=150, deadline=None)
@given(ops, st.integers(1, 4))
def test_invariant_1_under_random_events(seq, n):
    """Waterlevel identity and exactly-once close under any event order."""
    lg = Ledger()
    closes = {}
    for op, k, reason, reward in seq:
        gid = f"g{k // n}"
        eid = f"e{k}"
        known = eid in lg.executions
        if op == "dispatch" and not known:
            group = lg.groups.get(gid)
            if group is None or len(group.members) < group.size:
                lg.dispatch(eid, gid, n, burst=k % 3)
        elif op == "launch" and known:
            lg.launch(eid)
        elif op == "close" and known:
            if reason is CloseReason.REWARD_ERROR:  # a reward_error close carries no reward
                if reward is not None and lg.executions[eid].state is not ExecState.CLOSED:
                    with pytest.raises(LedgerError, match="reward_error with a reward"):
                        lg.close(eid, reason, reward)
                reward = None
            if lg.close(eid, reason, reward):
                closes[eid] = closes.get(eid, 0) + 1
        elif op == "score" and known and lg.executions[eid].state is ExecState.CLOSED:
            lg.score(eid, reward or 0.0)
        elif op == "retry" and known:
            lg.retry(eid)
        elif op == "assign" and gid in lg.groups and gid in lg.ready_group_ids():
            lg.assign([gid])
        lg.check()
    assert all(v == 1 for v in closes.values())
    assert lg.total.finished == len(closes)
    assert lg.waterlevel == lg.total.dispatched - lg.total.finished >= 0
