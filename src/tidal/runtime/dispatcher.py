"""The dispatcher: one quota of executions per burst, group by group, into the harness pool.

In: the run config, the groups already trained and the records held by a checkpoint (a resumed
run), and a ``wait_published(burst)`` that returns once the previous burst's weights are out.
Out: per burst a ``BurstStarted`` to the controller, then each group's executions (the
workload's job of the group: row, agent kind, reward) handed to the harness pool
(``dispatch_interval_s`` apart), each a task owned by the run's ``Parts``. A group
trained before a resume is skipped; an execution closed before it has its record restored
through the bridge instead of running again. Invariant 7 (nothing lost or trained twice) across a
resume rests on this: ``plan`` is the one place that decides what runs.
The policy's dispatch hold (``Controller.dispatch_limit``) decides when: a group goes only when
``tidal.control.dispatch_hold.may_dispatch`` admits it (the simulator's rule), counting the
ledger's waterlevel plus the executions handed to the pool that the ledger has not counted yet.
A held group waits in its place (woken by every event the controller handles, bounded by
``runtime.execution_timeout_s + control.step_timeout_s`` without progress) and goes once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tidal.clock import Clock
from tidal.config import RunConfig
from tidal.contracts.calls import ExecutionRecord
from tidal.contracts.executions import ExecutionOutcome
from tidal.control.carry_over import budget_groups, carried_groups, quota_groups
from tidal.control.dispatch_hold import may_dispatch
from tidal.errors import TimeoutExpired
from tidal.runtime.tasks import Parts
from tidal.seeding import derive_seed
from tidal.types import BurstStarted, Event

if TYPE_CHECKING:
    from tidal.agents.pool import HarnessPool
    from tidal.agents.workload import Workload
    from tidal.control.controller import Controller
    from tidal.runtime.bridge import LedgerBridge
    from tidal.runtime.deterministic import Boundaries

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupPlan:
    """One group of a burst: the executions to run and the records to restore."""

    group_id: str
    seed: int
    index: int  # the group's place in its burst (which task row it runs)
    run: tuple[str, ...]
    restore: tuple[ExecutionRecord, ...]


def plan_burst(
    cfg: RunConfig,
    burst: int,
    trained: set[str],
    held: dict[str, ExecutionRecord],
    groups: int | None = None,
) -> tuple[int, list[GroupPlan]]:
    """The quota of ``burst`` (less the executions of groups trained before a resume) and its
    groups in order: ``groups`` of them (the staleness budget's quota,
    ``tidal.control.carry_over``; default: ``batch_groups * updates_per_burst``). Pure: what a
    fresh and a resumed run dispatch is decided here."""
    c = cfg.control
    quota_groups = c.quota_executions // c.group_size if groups is None else groups
    done = sum(f"b{burst}-g{g}" in trained for g in range(quota_groups))
    quota = (quota_groups - done) * c.group_size
    plans = []
    for g in range(quota_groups):
        gid = f"b{burst}-g{g}"
        if gid in trained:
            continue  # trained before the resume
        ids = [f"{gid}-e{k}" for k in range(c.group_size)]
        plans.append(
            GroupPlan(
                gid,
                derive_seed("group", cfg.seed, burst, g),
                g,
                tuple(e for e in ids if e not in held),
                tuple(held[e] for e in ids if e in held),
            )
        )
    return quota, plans


class Dispatcher:
    def __init__(
        self,
        cfg: RunConfig,
        pool: HarnessPool,
        bridge: LedgerBridge,
        handle: Callable[[Event], None],
        clock: Clock,
        parts: Parts,
        trained: set[str],
        held: dict[str, ExecutionRecord],
        ctl: Controller,
        workload: Workload,
        gate: Boundaries | None = None,
    ) -> None:
        self.cfg, self.pool, self.bridge, self.handle = cfg, pool, bridge, handle
        # runtime.deterministic (``runtime.deterministic.Boundaries``): the burst's training
        # order and the hold until every routed engine serves the published version
        self.gate = gate
        self.workload = workload  # the task: section's (tidal.agents.workload.Workload)
        self.clock, self.parts, self.ctl = clock, parts, ctl
        self.trained, self.held = trained, dict(held)
        self.runs: list[asyncio.Task] = []
        # executions this dispatcher dispatched (handed to the pool, or restored through the
        # bridge); the bridge counts each one when its dispatch reaches the ledger
        self.issued = 0
        self.dispatched_bursts = 0  # bursts whose every group was handed off (or restored)
        # the staleness budget (tidal.control.carry_over): groups a version may have out
        c = cfg.control
        self.budget_groups = budget_groups(c.batch_groups, c.updates_per_burst, c.staleness)
        self.group_ids: list[str] = []  # every group dispatched, in dispatch order
        self.carried_by_burst: list[int] = []  # groups carried into each burst at its start
        self._changed = asyncio.Event()  # set after every event the controller handled

    async def run(
        self,
        first_burst: int,
        version: Callable[[], int],
        wait_published: Callable[[int], Awaitable[None]],
    ) -> None:
        """Every burst from ``first_burst``: wait for the previous one's weights, dispatch
        (deterministic: once every routed engine serves them)."""
        self.dispatched_bursts = first_burst
        for b in range(first_burst, self.cfg.control.bursts or 0):
            await wait_published(b)
            self.bridge.burst = b
            # with no staleness budget a version trains every group it dispatched; one it
            # could not (a record lost) is not carried, and each burst has its whole quota
            carried = self.carried() if self.cfg.control.staleness > 0 else 0
            self.carried_by_burst.append(carried)
            quota, groups = plan_burst(
                self.cfg, b, self.trained, self.held, quota_groups(self.budget_groups, carried)
            )
            if carried:
                log.info(
                    "burst %d: %d groups carried over, %d new (budget %d groups)",
                    b,
                    carried,
                    len(groups),
                    self.budget_groups,
                )
            if self.gate is not None:
                await self.gate.at(b, f"v{version()}", [g.group_id for g in groups])
            self.handle(BurstStarted(self.clock.now(), b, quota, version()))
            await self._dispatch(b, groups)
            self.dispatched_bursts = b + 1

    def carried(self) -> int:
        """Groups dispatched and neither trained nor dropped: what the staleness budget
        carries into the next version (``tidal.control.carry_over.carried_groups``)."""
        stale = set(self.bridge.buffer.stats.dropped_group_ids)
        return carried_groups(self.group_ids, self.ctl.ledger, stale)

    def end_open(self) -> int:
        """The run's end (its last version published): executions still open were carried
        past it and will never train; the pool stops them and closes them ``cancelled`` (reward
        0.0; their
        records are delivered, none is lost; one whose agent had already returned closes as it
        ended). Returns how many were open."""
        n = self.outstanding()
        if n:
            log.info(
                "run end: %d executions open, carried past the last version: stopped, "
                "closed as cancelled, never trained",
                n,
            )
            self.pool.end_open()
        return n

    def carry_report(self) -> dict[str, object]:
        """The staleness budget as this run used it (``summary.json``'s ``carry_over``)."""
        return {
            "staleness_threshold": self.cfg.control.staleness,
            "budget_groups": self.budget_groups,
            "carried_groups_by_burst": list(self.carried_by_burst),
            "open_executions_cancelled_at_end": self.pool.ended,
        }

    def notify(self) -> None:
        """The controller handled an event: the waterlevel or the dispatch hold may have
        changed (a held group looks again)."""
        self._changed.set()

    def outstanding(self) -> int:
        """Executions dispatched and not finished: the ledger's waterlevel plus those handed to
        the pool whose dispatch has not reached the ledger yet (the pool reports it from its
        own task), so a group handed off a moment ago counts as the simulator's would."""
        return self.ctl.ledger.waterlevel + self.issued - self.bridge.n_dispatched

    def settled(self, burst: int) -> bool:
        """No more training data can arrive before ``burst`` is published: its every group
        is dispatched, every execution closed, and every closed one's record delivered to the
        trajectory buffer (or failed); a group still short then never completes."""
        return (
            self.dispatched_bursts > burst and self.outstanding() == 0 and self.bridge.pending == 0
        )

    async def _dispatch(self, burst: int, groups: list[GroupPlan]) -> None:
        interval_s, first = self.cfg.runtime.dispatch_interval_s, True
        for grp in groups:
            for rec in grp.restore:  # closed before the resume: its record goes back
                self.held.pop(rec.execution_id, None)
                self.issued += 1
                self.bridge.restore(rec)
            if not grp.run:
                continue
            if not first and interval_s:
                await self.clock.asleep(interval_s)
            first = False
            await self._admitted(grp)
            # every execution of a group runs the same job (GRPO compares answers to one prompt)
            job = self.workload.job(burst, grp.index, grp.seed)
            self.issued += len(grp.run)
            self.group_ids.append(grp.group_id)
            self.runs.append(
                self.parts.spawn(
                    f"harness pool, group {grp.group_id}",
                    # their lines go into executions.jsonl as soon as the group has ended
                    self.bridge.lines_after(
                        self.pool.run([(grp.group_id, job)] * len(grp.run), list(grp.run))
                    ),
                )
            )

    async def _admitted(self, grp: GroupPlan) -> None:
        """Returns once the policy's dispatch hold admits ``grp`` (at once without a hold).
        Re-checked after every event the controller handles; ``TimeoutExpired`` when the
        outstanding work has not moved for ``execution_timeout_s + step_timeout_s``."""
        k = len(grp.run)
        if not may_dispatch(self.outstanding(), k, self.ctl.dispatch_limit):
            await self._held(grp, k)
        log.debug(
            "admitted group %s: %d executions, %d outstanding, limit %s",
            grp.group_id,
            k,
            self.outstanding(),
            self.ctl.dispatch_limit,
        )

    async def _held(self, grp: GroupPlan, k: int) -> None:
        timeout_s = self.cfg.runtime.execution_timeout_s + self.cfg.control.step_timeout_s
        seen, deadline = self.outstanding(), self.clock.now() + timeout_s
        log.info(
            "dispatch held: group %s (%d executions) waits, %d outstanding, limit %s",
            grp.group_id,
            k,
            seen,
            self.ctl.dispatch_limit,
        )
        while not may_dispatch(self.outstanding(), k, self.ctl.dispatch_limit):
            if self.outstanding() != seen:
                seen, deadline = self.outstanding(), self.clock.now() + timeout_s
            if self.clock.now() >= deadline:
                raise TimeoutExpired(
                    f"dispatch of group {grp.group_id}: held by the policy at "
                    f"{self.ctl.dispatch_limit} executions with {seen} outstanding, no "
                    f"execution closed within {timeout_s:g} s (runtime.execution_timeout_s "
                    "+ control.step_timeout_s)"
                )
            await self._changed_or(deadline - self.clock.now())
        log.info(
            "dispatch resumed: group %s, %d outstanding, limit %s",
            grp.group_id,
            self.outstanding(),
            self.ctl.dispatch_limit,
        )

    async def _changed_or(self, dt_s: float) -> None:
        """Waits until the next handled event or ``dt_s`` on the run's clock."""
        self._changed.clear()
        waits = [
            asyncio.ensure_future(self._changed.wait()),
            asyncio.ensure_future(self.clock.asleep(max(0.0, dt_s))),
        ]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def results(self) -> list[ExecutionOutcome]:
        """Every dispatched execution's result, in dispatch order."""
        return [r for batch in await asyncio.gather(*self.runs) for r in batch]
