"""Execution ledger: the waterlevel and GRPO group readiness.

In: dispatched / launched / closed / scored / retried events and group assignments.
Out: per-burst and total counters, the waterlevel ``w = d - f = queued + running``, and the set
of ready, unassigned groups.

Invariant 1 (DESIGN.md): ``d >= p >= f`` and ``w = d - f = queued + running >= 0`` at all times;
an execution closes exactly once (a duplicate close is ignored and counted); request retries
change no counter. Closing a still-queued execution counts it as launched and finished at once,
so the identity holds for cancellations before launch too.

A ``reward_error`` member (its reward function raised, or gave a non-finite value; it carries no
reward, never a stand-in 0.0) is settled without a score. The rule (``min_scored``): a group is
settled once every member is scored or ``reward_error``; it is ready when at least
``min(2, size)`` members are scored, and trains on those (its advantages are over the scored
members only), else it is dropped and counted (``groups_dropped``). Why: one unscorable member
should not cost the group's other answers their signal, and the scored members' mean is still a
fair baseline for them; a single scored member has no one to be compared with (its advantage is
0 by definition), so such a group carries nothing to train. The trajectory buffer applies the
same rule to the records (``tidal.training.trajectory_buffer``).
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
    errors: int = 0  # members closed ``reward_error`` (settled, no score)
    assigned: bool = False
    dropped: bool = False

    @property
    def settled(self) -> bool:
        """Every member is in and either scored or ``reward_error``."""
        return len(self.members) == self.size and self.scored + self.errors == self.size

    @property
    def ready(self) -> bool:
        return self.settled and self.scored >= min_scored(self.size)


def min_scored(size: int) -> int:
    """Scored members a group needs to train (the module's rule): 2, or 1 for a group of 1."""
    return min(2, size)


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
        self.groups_dropped = 0  # settled with fewer than min_scored scored members

    # ------------------------------------------------------------------ events
    def dispatch(
        self, execution_id: ExecutionId, group_id: GroupId, group_size: int, burst: int = 0
    ) -> None:
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
                f"{group_size}"
            )
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

    def close(
        self, execution_id: ExecutionId, reason: CloseReason, reward: float | None = None
    ) -> bool:
        """Closes exactly once; returns False for an ignored duplicate. A ``reward_error``
        close carries no reward (``LedgerError`` otherwise) and settles the member unscored."""
        ex = self._get(execution_id)
        if ex.state is ExecState.CLOSED:
            self.duplicate_closes += 1
            return False
        if reason is CloseReason.REWARD_ERROR and reward is not None:
            raise LedgerError(f"execution {execution_id!r} closed reward_error with a reward")
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
        if reason is CloseReason.REWARD_ERROR:
            group.errors += 1
            self._settle(group)
        elif reward is not None:
            self._score(ex, reward)
        return True

    def score(self, execution_id: ExecutionId, reward: float) -> bool:
        ex = self._get(execution_id)
        if ex.state is not ExecState.CLOSED:
            raise LedgerError(f"execution {execution_id!r} scored before it closed")
        if ex.reward is not None or ex.reason is CloseReason.REWARD_ERROR:
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
                why = " (dropped: fewer than 2 scored members)" if group and group.dropped else ""
                raise LedgerError(f"group {gid!r} assigned to a batch before it is ready{why}")
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
        self._settle(group)

    def _settle(self, group: Group) -> None:
        """A settled group becomes ready (``min_scored`` scored members) or is dropped."""
        if (
            not group.settled
            or group.assigned
            or group.dropped
            or group.group_id in self._ready_unassigned
        ):
            return
        if group.ready:
            self._ready_unassigned[group.group_id] = None
            self.groups_ready_total += 1
        else:
            group.dropped = True
            self.groups_dropped += 1
