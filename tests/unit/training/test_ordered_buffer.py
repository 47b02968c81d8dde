"""The ordered trajectory buffer of a deterministic run: a group's records in execution-id
order whatever order they closed in, groups handed out only in the expected (dispatch) order and
all requested at once, so every step trains the same groups, packed the same way."""

from __future__ import annotations

from tidal.clock import ManualClock
from tidal.training.records import single_call_record
from tidal.training.trajectory_buffer import TrajectoryBuffer, TrajectoryBufferConfig, member_key


def rec(eid: str, reward: float):
    gid = eid.rsplit("-e", 1)[0]
    return single_call_record(
        eid, gid, [1, 2, 3], [7, int(reward * 10) + 1], [-1.0, -2.0], 0, reward
    )


def buffer(ordered: bool = True) -> TrajectoryBuffer:
    return TrajectoryBuffer(TrajectoryBufferConfig(group_size=3, ordered=ordered), ManualClock())


def fill(buf: TrajectoryBuffer, order: list[str]) -> None:
    rewards = {"e0": 0.0, "e1": 1.0, "e2": 0.3}
    for eid in order:
        buf.add(rec(eid, rewards[eid.rsplit("-", 1)[1]]))


def test_member_key_is_natural_order():
    ids = ["b0-g1-e10", "b0-g1-e2", "b0-g10-e0", "b0-g2-e1"]
    assert sorted(ids, key=member_key) == ["b0-g1-e2", "b0-g1-e10", "b0-g2-e1", "b0-g10-e0"]


def test_records_and_advantages_do_not_depend_on_close_order():
    a, b = buffer(), buffer()
    for buf, order in ((a, ["e0", "e1", "e2"]), (b, ["e2", "e0", "e1"])):
        buf.expect(["b0-g0"])
        fill(buf, [f"b0-g0-{e}" for e in order])
    (ga,), (gb,) = a.take(1, 0), b.take(1, 0)
    assert (
        [r.execution_id for r in ga.records]
        == [r.execution_id for r in gb.records]
        == ["b0-g0-e0", "b0-g0-e1", "b0-g0-e2"]
    )
    assert ga.advantages == gb.advantages  # the same floats, bit for bit


def test_groups_go_in_expected_order_all_at_once():
    buf = buffer()
    buf.expect(["b0-g0", "b0-g1", "b0-g2"])
    fill(buf, [f"b0-g2-e{k}" for k in range(3)] + [f"b0-g1-e{k}" for k in range(3)])
    # two groups are ready, but not the first one in the order: nothing is takeable
    assert len(buf) == 2 and buf.takeable() == 0
    assert buf.take(2, 0) == []
    fill(buf, [f"b0-g0-e{k}" for k in (1, 0)])
    assert buf.take(1, 0) == []  # g0 is not complete yet
    fill(buf, ["b0-g0-e2"])
    assert buf.takeable() == 3
    assert [g.group_id for g in buf.take(2, 0)] == ["b0-g0", "b0-g1"]
    assert [g.group_id for g in buf.take(2, 0)] == []  # one left, two asked: all or nothing
    assert [g.group_id for g in buf.take(1, 0)] == ["b0-g2"]


def test_a_group_not_expected_waits_for_its_turn():
    buf = buffer()
    fill(buf, [f"b1-g0-e{k}" for k in range(3)])
    assert buf.takeable() == 0 and buf.take(1, 0) == []
    buf.expect(["b1-g0"])
    assert [g.group_id for g in buf.take(1, 0)] == ["b1-g0"]


def test_unordered_buffer_is_unchanged():
    buf = buffer(ordered=False)
    fill(buf, [f"b0-g1-e{k}" for k in range(3)] + [f"b0-g0-e{k}" for k in (2, 1, 0)])
    assert buf.takeable() == 2
    groups = buf.take(2, 0)
    assert [g.group_id for g in groups] == ["b0-g1", "b0-g0"]  # arrival order
    assert [r.execution_id for r in groups[1].records] == ["b0-g0-e2", "b0-g0-e1", "b0-g0-e0"]
