"""The staleness budget in the runtime (``tidal.control.carry_over``, ``runtime.dispatcher``):
a version dispatches its budget less the groups carried into it, the trainer trains the groups
ready first, stragglers are carried (and counted against the next budget), a group trained or
dropped is no longer carried, and at the run's end what is still open closes ``cancelled``
(nothing lost, nothing run twice). A real ``Dispatcher`` and ``Controller`` on a
``ManualClock``; the pool and the trainer are the test's hands (it closes groups and assigns
them to batches as the harness pool and the trainer loop would)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from tidal.agents.workload import Workload
from tidal.clock import ManualClock
from tidal.config import load_yaml
from tidal.control.carry_over import (
    budget_groups,
    carried_groups,
    max_policy_lag,
    quota_groups,
)
from tidal.control.factory import build_controller
from tidal.control.ledger import Ledger
from tidal.errors import ConfigError
from tidal.runtime.dispatcher import Dispatcher
from tidal.runtime.tasks import Parts
from tidal.testing.actuator import FakeActuator
from tidal.types import (
    CloseReason,
    ExecutionClosed,
    ExecutionDispatched,
    ExecutionLaunched,
    GroupsAssigned,
)

TINY = load_yaml(Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml")


def _cfg(staleness: float | None):
    return TINY.model_copy(
        update={
            "policy": TINY.policy.model_copy(update={"name": "static", "args": {"cells": 1}}),
            "runtime": TINY.runtime.model_copy(
                update={"dispatch_interval_s": 0.0, "checkpoint_every_steps": 0}
            ),
            "control": TINY.control.model_copy(update={"staleness_threshold": staleness}),
        }
    )


def test_the_rule():
    assert budget_groups(16, 4, 0.5) == 96 and budget_groups(16, 4, 0.0) == 64
    assert quota_groups(96, 32) == 64 and quota_groups(96, 100) == 0
    assert max_policy_lag(4, 0.0) == 4 and max_policy_lag(4, 0.5) == 8
    assert max_policy_lag(4, 1.5) == 12
    lg = Ledger()
    for g in "abcde":
        for k in range(2):
            lg.dispatch(f"{g}{k}", g, 2)
    for g in "abc":
        for k in range(2):
            lg.close(f"{g}{k}", CloseReason.COMPLETED, 1.0)
    lg.assign(["a"])  # trained
    lg.close("d0", CloseReason.REWARD_ERROR)
    lg.close("d1", CloseReason.COMPLETED, 1.0)  # settled with one score: dropped
    # b: ready, c: dropped stale at the buffer, e: running, f: not yet in the ledger
    assert carried_groups("abcdef", lg, {"c"}) == 3


class _Pool:
    """The harness pool's timing: dispatches reported from the pool's own task; the test
    closes whole groups; ``end_open`` closes the open ones ``cancelled``, reward 0.0."""

    def __init__(self, bridge) -> None:
        self.bridge, self.open, self.ran, self.cancelled = bridge, {}, [], []
        self.ended = 0

    async def run(self, tasks, ids):
        await asyncio.sleep(0)  # the real pool opens its HTTP client first
        gid, loop = tasks[0][0], asyncio.get_running_loop()
        for eid in ids:
            self.bridge.dispatched(eid, gid)
        futs = []
        for eid in ids:
            self.bridge.launched(eid)
            futs.append(loop.create_future())
            self.open[eid] = (gid, futs[-1])
        self.ran += ids
        return [await f for f in futs]

    def finish(self, gid: str) -> None:
        for eid, (g, fut) in list(self.open.items()):
            if g == gid:
                self._close(eid, fut, CloseReason.COMPLETED, 1.0)

    def end_open(self) -> int:
        n = len(self.open)
        for eid, (_, fut) in list(self.open.items()):
            self._close(eid, fut, CloseReason.CANCELLED, 0.0)
            self.cancelled.append(eid)
        self.ended += n
        return n

    def _close(self, eid, fut, reason, reward) -> None:
        del self.open[eid]
        self.bridge.closed(eid, reason, reward)
        fut.set_result(SimpleNamespace(execution_id=eid, reason=reason))

    def groups_open(self) -> list[str]:
        return sorted({g for g, _ in self.open.values()})


class _Bridge:
    """The ``LedgerBridge`` events into the controller, and the buffer's stale drops."""

    def __init__(self, handle, clock, size) -> None:
        self.handle, self.clock, self.size = handle, clock, size
        self.burst = self.n_dispatched = self.pending = 0
        self.buffer = SimpleNamespace(stats=SimpleNamespace(dropped_group_ids=[]))

    async def lines_after(self, run):
        return await run

    def dispatched(self, eid, gid):
        self.n_dispatched += 1
        self.handle(ExecutionDispatched(self.clock.now(), eid, gid, self.size, self.burst))

    def launched(self, eid):
        self.handle(ExecutionLaunched(self.clock.now(), eid))

    def closed(self, eid, reason, reward):
        self.handle(ExecutionClosed(self.clock.now(), eid, reason, reward))


class _Run:
    """A dispatcher running ``cfg``'s bursts; ``publish`` ends a burst as the trainer does."""

    def __init__(self, cfg) -> None:
        self.cfg, self.clock = cfg, ManualClock()
        self.ctl = build_controller(cfg, self.clock, FakeActuator())
        self.bridge = _Bridge(self.ctl.handle, self.clock, cfg.control.group_size)
        self.pool = _Pool(self.bridge)
        self.d = Dispatcher(
            cfg, self.pool, self.bridge, self.ctl.handle, self.clock, Parts(), set(), {},
            self.ctl, Workload(cfg),
        )  # fmt: skip
        self.published = [asyncio.Event() for _ in range((cfg.control.bursts or 0) + 1)]
        self.published[0].set()
        self.task = asyncio.get_running_loop().create_task(
            self.d.run(0, lambda: 0, lambda b: self.published[b].wait())
        )

    def train(self, gids) -> None:
        """The trainer takes these ready groups into its batches."""
        self.ctl.handle(GroupsAssigned(self.clock.now(), tuple(gids)))

    async def publish(self, b: int) -> None:
        self.published[b].set()
        await _settle()


async def _settle() -> None:
    for _ in range(30):
        await asyncio.sleep(0)


def test_stragglers_are_carried_into_the_next_version_and_closed_at_the_end():
    async def go():
        r = _Run(_cfg(0.5))  # tiny: 3 groups a step, 2 steps a version: budget 9 groups
        await _settle()
        assert r.d.budget_groups == 9
        burst0 = [f"b0-g{g}" for g in range(9)]
        assert r.pool.groups_open() == burst0  # 1.5 times the quota, all at once
        for gid in burst0[:2:-1]:  # g8 ... g3 finish first and train; g0-g2 straggle
            r.pool.finish(gid)
        r.train(burst0[:2:-1])
        await r.publish(1)
        assert r.d.carried_by_burst == [0, 3]
        new = [f"b1-g{g}" for g in range(6)]  # the budget less the 3 carried
        assert r.pool.groups_open() == sorted(burst0[:3] + new)
        r.pool.finish("b0-g0")  # a straggler closes and trains in version 1 (stale by one)
        for gid in new[:5]:
            r.pool.finish(gid)
        r.train(["b0-g0", *new[:5]])
        await r.publish(2)
        await r.task
        assert r.d.end_open() == 12  # b0-g1, b0-g2, b1-g5: carried past the last version
        results = await r.d.results()
        assert len(results) == len(r.pool.ran) == (9 + 6) * 4  # every execution once
        assert len({x.execution_id for x in results}) == len(results)
        assert sorted(r.pool.cancelled) == sorted(
            f"{g}-e{k}" for g in ("b0-g1", "b0-g2", "b1-g5") for k in range(4)
        )
        assert r.ctl.ledger.waterlevel == 0 and r.d.outstanding() == 0
        assert r.ctl.ledger.close_reasons[CloseReason.CANCELLED] == 12
        assert r.d.carry_report() == {
            "staleness_threshold": 0.5,
            "budget_groups": 9,
            "carried_groups_by_burst": [0, 3],
            "open_executions_cancelled_at_end": 12,
        }

    asyncio.run(go())


def test_a_group_dropped_stale_or_by_the_ledger_is_not_carried():
    async def go():
        r = _Run(_cfg(0.5))
        await _settle()
        burst0 = [f"b0-g{g}" for g in range(9)]
        for gid in burst0[3:]:
            r.pool.finish(gid)
        r.train(burst0[3:])
        r.bridge.buffer.stats.dropped_group_ids.append("b0-g0")  # too stale at the take
        for k in range(4):  # b0-g1: all members unscored, the ledger drops it
            eid = f"b0-g1-e{k}"
            _, fut = r.pool.open.pop(eid)
            r.bridge.closed(eid, CloseReason.REWARD_ERROR, None)
            fut.set_result(SimpleNamespace(execution_id=eid))
        await r.publish(1)
        assert r.d.carried_by_burst == [0, 1]  # b0-g2 only
        assert len([g for g in r.pool.groups_open() if g.startswith("b1-")]) == 8
        await r.publish(2)
        await r.task
        r.d.end_open()
        await r.d.results()
        assert r.ctl.ledger.waterlevel == 0

    asyncio.run(go())


@pytest.mark.parametrize("seed", range(6))
def test_every_version_dispatches_its_budget_less_what_it_carries(seed):
    """Random finishing orders over 3 versions: each burst's new groups are the budget less
    the groups carried (those neither trained nor dropped), the trainer trains 6 of the ready
    ones per version, and every dispatched execution closes exactly once."""
    rng = random.Random(seed)
    cfg = _cfg(0.5).model_copy(
        update={"control": _cfg(0.5).control.model_copy(update={"bursts": 3})}
    )

    async def go():
        r = _Run(cfg)
        trained: set[str] = set()
        finished: set[str] = set()
        for b in range(3):
            await _settle()
            opened = r.pool.groups_open()
            new = [g for g in opened if g.startswith(f"b{b}-")]
            carried = len(opened) - len(new) + len(finished - trained)
            assert r.d.carried_by_burst[b] == carried
            assert len(new) == 9 - carried  # carried + new == the budget, every version
            order = rng.sample(opened, len(opened))
            closing = order[: rng.randint(3, len(order))]
            for gid in closing:
                r.pool.finish(gid)
            finished.update(closing)
            ready = sorted(finished - trained)[:6]  # the trainer takes what is ready
            r.train(ready)
            trained.update(ready)
            await r.publish(b + 1)
        await r.task
        r.d.end_open()
        results = await r.d.results()
        ids = [x.execution_id for x in results]
        assert len(ids) == len(set(ids)) == len(r.pool.ran)
        assert r.ctl.ledger.waterlevel == 0
        assert r.ctl.ledger.close_reasons[CloseReason.CANCELLED] == 4 * len(
            {i.rsplit("-", 1)[0] for i in r.pool.cancelled}
        )

    asyncio.run(go())


def test_without_a_budget_every_burst_has_its_whole_quota():
    """staleness_threshold unset (a real run's default): 6 groups a burst, none carried, even
    with a group of the last burst untrained."""

    async def go():
        r = _Run(_cfg(None))
        await _settle()
        assert len(r.pool.groups_open()) == 6
        for g in range(6):
            r.pool.finish(f"b0-g{g}")
        r.train([f"b0-g{g}" for g in range(5)])
        await r.publish(1)
        assert r.d.carried_by_burst == [0, 0] and len(r.pool.groups_open()) == 6
        for g in range(6):
            r.pool.finish(f"b1-g{g}")
        await r.publish(2)
        await r.task
        assert r.d.end_open() == 0

    asyncio.run(go())


def test_a_budget_with_checkpoints_is_refused_in_one_line():
    from tidal.runtime.wiring import check_config

    cfg = _cfg(0.5)
    bad = cfg.model_copy(
        update={"runtime": cfg.runtime.model_copy(update={"checkpoint_every_steps": 1})}
    )
    with pytest.raises(ConfigError, match=r"control\.staleness_threshold"):
        check_config(bad)


def test_the_emulated_run_and_the_simulator_read_one_key():
    """``tidal run --emulate`` gets the staleness budget the simulator runs the policy with,
    in the run config's ``control.staleness_threshold``, which both dispatchers read."""
    from tidal.runtime.emulated_run import emulated_config
    from tidal.sim.scenario import load

    sc = load("dapo-math-32gpu")
    for policy in ("waterlevel", "tidal", "verl-default"):
        cfg, profile = sc.run_config(policy)
        emu = emulated_config("dapo-math-32gpu", 2.0, policy)
        assert emu["control"]["staleness_threshold"] == cfg.control.staleness
        assert cfg.control.staleness == sc.staleness_for(profile)
    assert sc.run_config("waterlevel")[0].control.staleness == 0.5


def test_a_streaming_policy_starts_a_step_with_one_group_where_the_core_streams():
    """The trainer loop starts a step before its batch is ready only for a policy whose
    mechanics stream (waterlevel, tidal: the simulator's streaming trainer) and a core that
    takes the rest within the step (the emulated core); the real core waits for a batch."""
    from tidal.runtime.trainer_loop import TrainerLoop
    from tidal.training.emulated import EmulatedCore

    def loop(policy, core):
        cfg = _cfg(0.5).model_copy(
            update={"policy": TINY.policy.model_copy(update={"name": policy})}
        )
        return TrainerLoop(cfg, core, None, None, None, None, None, None, None, None, None, None)

    emulated = object.__new__(EmulatedCore)
    assert loop("waterlevel", emulated).streaming and loop("tidal", emulated).streaming
    assert not loop("verl-default", emulated).streaming  # verl's trainer takes whole batches
    assert not loop("waterlevel", SimpleNamespace()).streaming  # a core without streaming steps
