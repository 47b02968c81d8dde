"""The runtime's dispatcher honours the policy's dispatch hold (``Controller.dispatch_limit``)
as the simulator's does: a real ``Dispatcher`` and a real ``Controller`` (``tidal.control`` on
the wall clock), wired as ``runtime.wiring`` wires them (every handled event wakes the
dispatcher), and a pool with the harness pool's timing: it reports each execution dispatched
from its own task (a moment after the hand-off) and closes executions when the test says."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.agents.workload import Workload
from tidal.clock import ManualClock, WallClock
from tidal.config import load_yaml
from tidal.control.factory import build_controller
from tidal.errors import TimeoutExpired
from tidal.runtime.dispatcher import Dispatcher
from tidal.runtime.tasks import Parts
from tidal.testing.actuator import FakeActuator
from tidal.types import CloseReason, ExecutionClosed, ExecutionDispatched, ExecutionLaunched, Tick

TINY = load_yaml(Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml")
# a policy that never sets the limit itself (the test sets it, as the tidal policy would);
# groups handed off back to back, so hand-offs the ledger has not counted yet matter
CFG = TINY.model_copy(
    update={
        "policy": TINY.policy.model_copy(update={"name": "static", "args": {"cells": 1}}),
        "runtime": TINY.runtime.model_copy(update={"dispatch_interval_s": 0.0}),
    }
)
SIZE = CFG.control.group_size
ALL = [
    f"b{b}-g{g}-e{k}"
    for b in range(CFG.control.bursts)
    for g in range(CFG.control.quota_executions // SIZE)
    for k in range(SIZE)
]


class _Pool:
    """The harness pool's timing: dispatches are reported from the pool's own task, closes
    when the test finishes executions (oldest first)."""

    def __init__(self, bridge) -> None:
        self.bridge, self.running, self.ran = bridge, [], []

    async def run(self, tasks, ids):
        await asyncio.sleep(0)  # the real pool opens its HTTP client first
        done = asyncio.get_running_loop().create_future()
        for eid in ids:
            self.bridge.dispatched(eid, tasks[0][0])
        self.ran += ids
        self.running += [(eid, done) for eid in ids]
        for eid in ids:
            self.bridge.launched(eid)
        await done
        return [SimpleNamespace(execution_id=i) for i in ids]

    def finish(self, n: int) -> None:
        for eid, done in self.running[:n]:
            self.bridge.closed(eid)
            if not any(d is done for _, d in self.running[n:]) and not done.done():
                done.set_result(None)
        del self.running[:n]


class _Bridge:
    """The ``LedgerBridge`` events into the controller (no records: nothing trains here)."""

    def __init__(self, handle, clock) -> None:
        self.handle, self.clock, self.burst, self.n_dispatched = handle, clock, 0, 0

    async def lines_after(self, run):  # executions.jsonl: not this test's
        return await run

    def dispatched(self, eid, gid):
        self.n_dispatched += 1
        self.handle(ExecutionDispatched(self.clock.now(), eid, gid, SIZE, self.burst))

    def launched(self, eid):
        self.handle(ExecutionLaunched(self.clock.now(), eid))

    def closed(self, eid):
        self.handle(ExecutionClosed(self.clock.now(), eid, CloseReason.COMPLETED, 1.0))


class _Held:
    """The static policy, answering with the dispatch hold the test sets (as the tidal policy
    answers with its own) at its next decision."""

    def __init__(self, inner) -> None:
        self.inner, self.limit = inner, None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def decide(self, obs):
        return dataclasses.replace(self.inner.decide(obs), dispatch_limit=self.limit)


def _hold(ctl, handle, clock, limit) -> None:
    """The policy holds dispatch at ``limit`` from the next event on (a tick here)."""
    ctl.policy.limit = limit
    handle(Tick(clock.now()))


def _wired(clock, cfg=CFG):
    ctl = build_controller(cfg, clock, FakeActuator())
    ctl.policy = _Held(ctl.policy)
    listeners = []

    def handle(ev):  # runtime.wiring's handle: the controller, then whoever waits on it
        ctl.handle(ev)
        for wake in listeners:
            wake()

    bridge = _Bridge(handle, clock)
    pool = _Pool(bridge)
    d = Dispatcher(cfg, pool, bridge, handle, clock, Parts(), set(), {}, ctl, Workload(cfg))
    listeners.append(d.notify)
    return ctl, pool, d, handle


async def _settle() -> None:
    for _ in range(30):  # every task that can run without a close or a limit change runs
        await asyncio.sleep(0)


_STEP = st.one_of(
    st.tuples(st.just("limit"), st.none() | st.integers(0, 40)),
    st.tuples(st.just("finish"), st.integers(0, 10)),
)


@settings(max_examples=40, deadline=None)
@given(steps=st.lists(_STEP, max_size=30), first=st.none() | st.integers(0, 20))
def test_a_held_dispatch_never_passes_the_limit_and_resumes_when_it_lifts(steps, first):
    async def go():
        clock = WallClock()
        ctl, pool, d, handle = _wired(clock)
        _hold(ctl, handle, clock, first)

        async def published(b):
            await _settle()

        run = asyncio.get_running_loop().create_task(d.run(0, lambda: 0, published))
        await _settle()
        for kind, arg in steps:
            before = len(pool.ran)
            if kind == "limit":
                _hold(ctl, handle, clock, arg)  # the policy changes its limit while deciding
            else:
                pool.finish(arg)
            await _settle()
            lim, wl = ctl.dispatch_limit, ctl.ledger.waterlevel
            assert d.outstanding() == wl  # every hand-off has reached the ledger
            if lim is not None and len(pool.ran) > before:
                assert wl <= lim, (wl, lim)  # new work only up to the limit
            assert pool.ran == ALL[: len(pool.ran)]  # in plan order, none twice
        _hold(ctl, handle, clock, None)  # lifted: held groups go at the next event
        await _settle()
        quota = CFG.control.quota_executions
        assert pool.ran and len(pool.ran) % quota == 0  # the whole burst went, no close needed
        while not run.done() or pool.running:
            pool.finish(len(pool.running))
            await _settle()
        await run
        assert pool.ran == ALL and len(await d.results()) == len(ALL)

    asyncio.run(go())


def test_a_hold_released_at_once_when_executions_finish():
    """Limit 8 (two groups of 4): two groups go; each finished group lets the next go at the
    close event itself, without waiting for a tick."""

    async def go():
        clock = WallClock()
        ctl, pool, d, handle = _wired(clock)
        _hold(ctl, handle, clock, 8)
        task = asyncio.get_running_loop().create_task(d._dispatch(0, _plans()))
        await _settle()
        assert len(pool.ran) == 8 and ctl.ledger.waterlevel == 8
        pool.finish(4)
        await _settle()
        assert len(pool.ran) == 12 and ctl.ledger.waterlevel == 8
        _hold(ctl, handle, clock, None)
        await _settle()
        assert len(pool.ran) == CFG.control.quota_executions
        await task
        while pool.running:
            pool.finish(len(pool.running))
            await _settle()

    asyncio.run(go())


def test_a_hold_that_never_lifts_is_one_clear_error():
    async def go():
        clock = ManualClock()  # a wait moves virtual time: the bound passes at once
        ctl, pool, d, handle = _wired(clock)
        _hold(ctl, handle, clock, 0)
        await d._dispatch(0, _plans())

    with pytest.raises(
        TimeoutExpired,
        match=r"held by the policy at 0 executions.*"
        r"runtime.execution_timeout_s",
    ):
        asyncio.run(go())


def _plans():
    from tidal.runtime.dispatcher import plan_burst

    return plan_burst(CFG, 0, set(), {})[1]
