"""Admission control: the concurrency target on a throughput curve, the fair queue's order,
the rule's parsing, and the proxy's queue using the same order."""

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.control.admission import (
    AdmissionRule,
    FairQueue,
    concurrency_target,
    curve_from_points,
)
from tidal.errors import ConfigError
from tidal.serving.admission import AdmissionQueue


def linear_then_flat(n: int) -> float:
    return min(100.0 * n, 3200.0)  # saturates at 32 sequences


def test_saturation_is_the_smallest_batch_at_ninety_percent():
    assert concurrency_target(linear_then_flat, 128, AdmissionRule("saturation")) == 29
    assert concurrency_target(linear_then_flat, 16, AdmissionRule("saturation")) == 15
    assert concurrency_target(linear_then_flat, 128, AdmissionRule("off")) == 128


def test_latency_target_is_the_largest_batch_within_the_step_time():
    # step time n / curve(n): 0.01 s up to 32 sequences, then n / 3200
    assert concurrency_target(linear_then_flat, 128, AdmissionRule("latency", 0.02)) == 64
    assert concurrency_target(linear_then_flat, 128, AdmissionRule("latency", 1e-6)) == 1


@pytest.mark.parametrize(
    "value,field",
    [("sat", "control.admission"), (-1, "control.admission"), (True, "control.admission")],
)
def test_bad_rules_name_the_field(value, field):
    with pytest.raises(ConfigError) as err:
        AdmissionRule.parse(value)
    assert err.value.field == field


def test_rule_parsing():
    assert AdmissionRule.parse("off").on is False
    assert AdmissionRule.parse("saturation").mode == "saturation"
    assert AdmissionRule.parse("0.05").target_latency_s == 0.05
    with pytest.raises(ConfigError, match="admission_order"):
        AdmissionRule.parse("saturation", order="random")


def test_curve_from_points_interpolates_and_rejects_bad_points():
    c = curve_from_points([(1, 100.0), (9, 900.0), (17, 1000.0)])
    assert c(1) == 100.0 and c(5) == 500.0 and c(13) == 950.0 and c(40) == 1000.0
    with pytest.raises(ConfigError, match="engine_curve"):
        curve_from_points([(0, 5.0)])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.floats(0, 100)), min_size=1, max_size=30))
def test_longest_waiting_group_first(entries):
    """Pops come in order of their group's first wait (ties: arrival); every item once."""
    q = FairQueue()
    first: dict[int, float] = {}
    now = 0.0
    for i, (group, dt) in enumerate(entries):
        now += dt
        q.push(i, group, now)
        first.setdefault(group, now)
    out = [q.pop()[0] for _ in range(len(entries))]
    assert sorted(out) == list(range(len(entries)))
    keys = [(first[entries[i][0]], i) for i in out]
    assert keys == sorted(keys)
    assert len(q) == 0 and q.peek() is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 1e4), min_size=1, max_size=30), st.data())
def test_shortest_remaining_first_with_discards(works, data):
    q = FairQueue("shortest_remaining")
    for i, w in enumerate(works):
        q.push(i, i, 0.0, w, payload=w)
    gone = data.draw(st.sets(st.sampled_from(range(len(works)))))
    for i in gone:
        assert q.discard(i) == works[i]
    left = [q.pop() for _ in range(len(works) - len(gone))]
    assert [w for _, w in left] == sorted(works[i] for i in range(len(works)) if i not in gone)
    with pytest.raises(IndexError):
        q.pop()


def test_requeued_item_keeps_only_its_new_place():
    q = FairQueue()
    q.push("a", "g1", 0.0)
    q.push("b", "g2", 1.0)
    q.discard("a")
    q.push("a", "g3", 2.0)  # a stale heap entry for "a" at 0.0 must not count
    assert [q.pop()[0], q.pop()[0]] == ["b", "a"]


def test_proxy_queue_serves_the_longest_waiting_group_first():
    async def scenario():
        free = {"n": 0}
        order: list[str] = []

        def pick():
            if free["n"] > 0:
                free["n"] -= 1
                return True
            return None

        q = AdmissionQueue()
        loop = asyncio.get_running_loop()

        async def call(name, group):
            await q.acquire(pick, loop.time() + 5.0, group=group)
            order.append(name)

        tasks = [asyncio.create_task(call("g1-a", "g1"))]
        await asyncio.sleep(0.01)
        tasks.append(asyncio.create_task(call("g2-a", "g2")))
        await asyncio.sleep(0.01)
        tasks.append(asyncio.create_task(call("g1-b", "g1")))  # joins its group's wait
        await asyncio.sleep(0.01)
        for _ in range(3):
            free["n"] += 1
            q.notify()
            await asyncio.sleep(0.01)
        await asyncio.wait_for(asyncio.gather(*tasks), 5.0)
        return order

    assert asyncio.run(scenario()) == ["g1-a", "g1-b", "g2-a"]
