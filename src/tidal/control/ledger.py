"""Execution ledger: the waterlevel and GRPO group readiness.

In: dispatched / launched / closed / scored / retried events and group assignments.
Out: per-burst and total counters, the waterlevel ``w = d - f = queued + running``, and the set
of ready, unassigned groups.

Invariant 1 (DESIGN.md): ``d >= p >= f`` and ``w = d - f = queued + running >= 0`` at all times;
an execution closes exactly once (a duplicate close is ignored and counted); request retries
change no counter. Closing a still-queued execution counts it as launched and finished at once,
so the identity holds for cancellations before launch too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tidal.contracts.close import CloseReason
from tidal.errors import InvariantViolation, LedgerError
from tidal.types import ExecState, ExecutionId, GroupId


@dataclass
class Counters:
    """Cumulative dispatched ``d``, launched ``p`` and finished ``f``."""

    dispatched: int = 0
    launched: int = 0
    finished: int = 0

    @property
    def queued(self) -> int:
        return self.dispatched - self.launched

    @property
    def running(self) -> int:
        return self.launched - self.finished

    @property
    def waterlevel(self) -> int:
        return self.dispatched - self.finished


@dataclass
class Execution:
    execution_id: ExecutionId
    group_id: GroupId
    burst: int
    state: ExecState = ExecState.QUEUED
    reason: CloseReason | None = None
    reward: float | None = None
    retries: int = 0


@dataclass
class Group:
    group_id: GroupId
    size: int
    burst: int
    members: list[ExecutionId] = field(default_factory=list)
    closed: int = 0
    scored: int = 0
    assigned: bool = False

    @property
    def ready(self) -> bool:
        return len(self.members) == self.size and self.scored == self.size


class Ledger:
    """Owns every execution's state; the only writer of the waterlevel counters."""

    def __init__(self) -> None:
        self.total = Counters()
        self.bursts: dict[int, Counters] = {}
        self.executions: dict[ExecutionId, Execution] = {}
        self.groups: dict[GroupId, Group] = {}
        self._ready_unassigned: dict[GroupId, None] = {}  # insertion-ordered set
        self.duplicate_closes = 0
        self.duplicate_launches = 0
        self.retries = 0
        self.close_reasons: dict[CloseReason, int] = {r: 0 for r in CloseReason}
        self.groups_ready_total = 0

    # ------------------------------------------------------------------ events
    def dispatch(self, execution_id: ExecutionId, group_id: GroupId, group_size: int,
                 burst: int = 0) -> None:
        if execution_id in self.executions:
            raise LedgerError(f"execution {execution_id!r} dispatched twice")
        if group_size < 1:
            raise LedgerError(f"group {group_id!r}: group_size must be >= 1, got {group_size}")
        group = self.groups.get(group_id)
        if group is None:
            group = self.groups[group_id] = Group(group_id, group_size, burst)
        elif group.size != group_size:
            raise LedgerError(
                f"group {group_id!r} has size {group.size}, execution {execution_id!r} says "
                f"{group_size}")
        if len(group.members) >= group.size:
            raise LedgerError(f"group {group_id!r} already has its {group.size} executions")
        group.members.append(execution_id)
        self.executions[execution_id] = Execution(execution_id, group_id, burst)
        self._counters(burst).dispatched += 1
        self.total.dispatched += 1

    def launch(self, execution_id: ExecutionId) -> bool:
        """Returns False (and counts) for a launch of an execution that is not queued."""
        ex = self._get(execution_id)
        if ex.state is not ExecState.QUEUED:
            self.duplicate_launches += 1
            return False
        ex.state = ExecState.RUNNING
        self._counters(ex.burst).launched += 1
        self.total.launched += 1
        return True

    def close(self, execution_id: ExecutionId, reason: CloseReason,
              reward: float | None = None) -> bool:
        """Closes exactly once; returns False for an ignored duplicate."""
        ex = self._get(execution_id)
        if ex.state is ExecState.CLOSED:
            self.duplicate_closes += 1
            return False
        counters = self._counters(ex.burst)
        if ex.state is ExecState.QUEUED:
            counters.launched += 1
            self.total.launched += 1
        ex.state = ExecState.CLOSED
        ex.reason = reason
        counters.finished += 1
        self.total.finished += 1
        self.close_reasons[reason] += 1
        group = self.groups[ex.group_id]
        group.closed += 1
        if reward is not None:
            self._score(ex, reward)
        return True

    def score(self, execution_id: ExecutionId, reward: float) -> bool:
        ex = self._get(execution_id)
        if ex.state is not ExecState.CLOSED:
            raise LedgerError(f"execution {execution_id!r} scored before it closed")
        if ex.reward is not None:
            return False
        self._score(ex, reward)
        return True

    def retry(self, execution_id: ExecutionId) -> None:
        ex = self._get(execution_id)
        ex.retries += 1
        self.retries += 1

    def assign(self, group_ids: tuple[GroupId, ...] | list[GroupId]) -> None:
        for gid in group_ids:
            group = self.groups.get(gid)
            if group is None or not group.ready:
                raise LedgerError(f"group {gid!r} assigned to a batch before it is ready")
            if group.assigned:
                raise LedgerError(f"group {gid!r} assigned twice")
            group.assigned = True
            self._ready_unassigned.pop(gid, None)

    # ----------------------------------------------------------------- queries
    @property
    def waterlevel(self) -> int:
        return self.total.waterlevel

    @property
    def ready_unassigned(self) -> int:
        return len(self._ready_unassigned)

    def ready_group_ids(self) -> list[GroupId]:
        return list(self._ready_unassigned)

    def state_counts(self) -> dict[ExecState, int]:
        counts = {s: 0 for s in ExecState}
        for ex in self.executions.values():
            counts[ex.state] += 1
        return counts

    def check(self) -> None:
        """Invariant 1, checked from scratch (tests call this after every event)."""
        counts = self.state_counts()
        t = self.total
        if not (t.dispatched >= t.launched >= t.finished >= 0):
            raise InvariantViolation(f"counters out of order: {t}")
        if t.queued != counts[ExecState.QUEUED] or t.running != counts[ExecState.RUNNING]:
            raise InvariantViolation(f"counters {t} disagree with execution states {counts}")
        if t.waterlevel != t.queued + t.running:
            raise InvariantViolation(f"waterlevel identity broken: {t}")
        if sum(c.waterlevel for c in self.bursts.values()) != t.waterlevel:
            raise InvariantViolation("per-burst waterlevels do not add up to the total")

    # ---------------------------------------------------------------- internal
    def _get(self, execution_id: ExecutionId) -> Execution:
        ex = self.executions.get(execution_id)
        if ex is None:
            raise LedgerError(f"unknown execution {execution_id!r}")
        return ex

    def _counters(self, burst: int) -> Counters:
        c = self.bursts.get(burst)
        if c is None:
            c = self.bursts[burst] = Counters()
        return c

    def _score(self, ex: Execution, reward: float) -> None:
        ex.reward = float(reward)
        group = self.groups[ex.group_id]
        group.scored += 1
        if group.ready and not group.assigned:
            self._ready_unassigned[group.group_id] = None
            self.groups_ready_total += 1
