"""The dispatcher: one quota of executions per burst, group by group, into the harness pool.

In: the run config, the groups already trained and the records held by a checkpoint (a resumed
run), and a ``wait_published(burst)`` that returns once the previous burst's weights are out.
Out: per burst a ``BurstStarted`` to the controller, then each group's executions handed to the
harness pool (``dispatch_interval_s`` apart), each a task owned by the run's ``Parts``. A group
trained before a resume is skipped; an execution closed before it has its record restored
through the bridge instead of running again. Invariant 7 (nothing lost or trained twice) across a
resume rests on this: ``plan`` is the one place that decides what runs.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from tidal.clock import Clock
from tidal.config import RunConfig
from tidal.runtime.tasks import Parts
from tidal.seeding import derive_seed
from tidal.training.records import ExecutionRecord
from tidal.types import BurstStarted, Event


@dataclass(frozen=True)
class GroupPlan:
    """One group of a burst: the executions to run and the records to restore."""

    group_id: str
    seed: int
    run: tuple[str, ...]
    restore: tuple[ExecutionRecord, ...]


def plan_burst(cfg: RunConfig, burst: int, trained: set[str],
               held: dict[str, ExecutionRecord]) -> tuple[int, list[GroupPlan]]:
    """The quota of ``burst`` (less the executions of groups trained before a resume) and its
    groups in order. Pure: what a fresh and a resumed run dispatch is decided here."""
    c = cfg.control
    quota_groups = c.quota_executions // c.group_size
    done = sum(f"b{burst}-g{g}" in trained for g in range(quota_groups))
    quota = c.quota_executions - done * c.group_size
    plans = []
    for g in range(quota_groups):
        gid = f"b{burst}-g{g}"
        if gid in trained:
            continue  # trained before the resume
        ids = [f"{gid}-e{k}" for k in range(c.group_size)]
        plans.append(GroupPlan(gid, derive_seed("group", cfg.seed, burst, g),
                               tuple(e for e in ids if e not in held),
                               tuple(held[e] for e in ids if e in held)))
    return quota, plans


def task_factory(cfg: RunConfig, seed: int) -> Callable[[], Any]:
    """The environment factory of one group (every execution of a group gets the same
    problem: GRPO compares answers to one prompt)."""
    from tidal.agents import ArithmeticTask, WorkspaceTask
    from tidal.agents.environments import ToolLatency

    rt = cfg.runtime
    if rt.task == "arithmetic":
        return partial(ArithmeticTask, seed)
    latency = partial(ToolLatency, median_s=rt.tool_latency_s)
    # its own stream, independent of the task drawn from the same group seed
    return lambda: WorkspaceTask(seed, latency=latency(random.Random(derive_seed("latency",
                                                                              seed))))


class Dispatcher:
    def __init__(self, cfg: RunConfig, pool: Any, bridge: Any, handle: Callable[[Event], None],
                 clock: Clock, parts: Parts, trained: set[str],
                 held: dict[str, ExecutionRecord]) -> None:
        self.cfg, self.pool, self.bridge, self.handle = cfg, pool, bridge, handle
        self.clock, self.parts = clock, parts
        self.trained, self.held = trained, dict(held)
        self.runs: list[asyncio.Task] = []

    async def run(self, first_burst: int, version: Callable[[], int],
                  wait_published: Callable[[int], Awaitable[None]]) -> None:
        """Every burst from ``first_burst``: wait for the previous one's weights, dispatch."""
        for b in range(first_burst, self.cfg.control.bursts or 0):
            await wait_published(b)
            self.bridge.burst = b
            quota, groups = plan_burst(self.cfg, b, self.trained, self.held)
            self.handle(BurstStarted(self.clock.now(), b, quota, version()))
            await self._dispatch(b, groups)

    async def _dispatch(self, burst: int, groups: list[GroupPlan]) -> None:
        interval_s, first = self.cfg.runtime.dispatch_interval_s, True
        for grp in groups:
            for rec in grp.restore:  # closed before the resume: its record goes back
                self.held.pop(rec.execution_id, None)
                self.bridge.restore(rec)
            if not grp.run:
                continue
            if not first and interval_s:
                await self.clock.asleep(interval_s)
            first = False
            make = task_factory(self.cfg, grp.seed)
            self.runs.append(self.parts.spawn(
                f"harness pool, group {grp.group_id}",
                self.pool.run([(grp.group_id, make)] * len(grp.run), list(grp.run))))

    async def results(self) -> list[Any]:
        """Every dispatched execution's result, in dispatch order."""
        return [r for batch in await asyncio.gather(*self.runs) for r in batch]
