"""Waits are injected like time: on a ``ManualClock`` every wait moves virtual time by its
length, so a loop bounded by a deadline on that clock ends in tests without wall time passing
(the satellite coordinator's waits once spun forever on one)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tidal.clock import ManualClock, WallClock, await_until, wait_until
from tidal.errors import TimeoutExpired
from tidal.training.coordinator import Coordinator, CoordinatorConfig, _Sat
from tidal.training.packing import PackingBuffer, PackingConfig


@given(st.lists(st.floats(0.0, 100.0), max_size=20))
def test_manual_waits_advance_virtual_time_by_their_length(waits):
    clock = ManualClock(5.0)
    for w in waits:
        clock.sleep(w)
    assert clock.now() == pytest.approx(5.0 + sum(waits))


def test_concurrent_async_sleeps_end_at_their_own_times():
    clock = ManualClock()

    async def go():
        ends = {}

        async def sleeper(name, dt):
            await clock.asleep(dt)
            ends[name] = clock.now()

        await asyncio.gather(sleeper("a", 1.0), sleeper("b", 2.0))
        return ends

    assert asyncio.run(go()) == {"a": 1.0, "b": 2.0}


def test_wait_until_on_a_manual_clock_times_out_in_virtual_time():
    clock, t0 = ManualClock(), time.monotonic()
    with pytest.raises(TimeoutExpired, match="the answer: not within 3600 s"):
        wait_until(clock, lambda: False, 3600.0, "the answer", every_s=1.0)
    assert clock.now() >= 3600.0 and time.monotonic() - t0 < 5.0
    with pytest.raises(TimeoutExpired, match="the async answer"):
        asyncio.run(await_until(clock, lambda: False, 60.0, "the async answer"))
    hits = iter([False, False, True])
    wait_until(clock, lambda: next(hits), 1.0, "third time")  # holds before the deadline


def test_wall_clock_waits_block_for_real():
    clock, cv = WallClock(), threading.Condition()
    t0 = time.monotonic()
    clock.sleep(0.05)
    with cv:
        clock.wait(cv, 0.05)
    assert time.monotonic() - t0 >= 0.09


def test_the_coordinators_join_wait_ends_on_a_manual_clock():
    clock = ManualClock()
    coord = Coordinator(
        CoordinatorConfig(join_timeout_s=600.0),
        PackingBuffer(PackingConfig(token_budget=64), clock),
        None,
        clock,
    )
    t0 = time.monotonic()
    with pytest.raises(TimeoutExpired, match="no join window within 600"):
        coord._op_join(_Sat(cell=1, incarnation="x"), {})
    assert clock.now() > 600.0 and time.monotonic() - t0 < 10.0
