"""Ledger events of the execution lifecycle, as the harness side reports them.

In: registrations, launches and closes of executions (the harness pool's own, or external
harnesses over HTTP). Out: ``dispatched`` / ``launched`` / ``closed`` callbacks that the control
plane's execution ledger implements. Invariant kept here: an execution closes exactly once;
a duplicate close is ignored and counted.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from tidal.errors import LedgerError

log = logging.getLogger(__name__)
CLOSE_REASONS = ("completed", "failed", "timeout", "cancelled", "reward_error")


@runtime_checkable
class LedgerEvents(Protocol):
    def dispatched(self, execution_id: str, group_id: str) -> None: ...
    def launched(self, execution_id: str, group_id: str) -> None: ...
    def closed(self, execution_id: str, group_id: str, reason: str,
               reward: float | None) -> None: ...


@dataclass
class EventLog:
    """A ``LedgerEvents`` that keeps every event in order (tests, and a local run's record)."""

    events: list[tuple] = field(default_factory=list)

    def dispatched(self, execution_id: str, group_id: str) -> None:
        self.events.append(("dispatched", execution_id, group_id))

    def launched(self, execution_id: str, group_id: str) -> None:
        self.events.append(("launched", execution_id, group_id))

    def closed(self, execution_id: str, group_id: str, reason: str,
               reward: float | None) -> None:
        self.events.append(("closed", execution_id, group_id, reason, reward))


@dataclass
class ExecutionState:
    execution_id: str
    group_id: str
    launched: bool = False
    closed_reason: str | None = None
    reward: float | None = None
    metadata: dict = field(default_factory=dict)


class ExecutionRegistry:
    """Known executions and their lifecycle; forwards each transition to ``events`` once."""

    def __init__(self, events: LedgerEvents | None = None, max_open: int = 100_000) -> None:
        self.events = events or EventLog()
        self.max_open = max_open
        self._by_id: dict[str, ExecutionState] = {}
        self._lock = threading.Lock()
        self.duplicate_closes = 0

    def dispatch(self, group_id: str = "default", execution_id: str | None = None,
                 metadata: dict | None = None) -> ExecutionState:
        with self._lock:
            eid = execution_id or f"ex-{uuid.uuid4().hex[:12]}"
            if eid in self._by_id:
                raise LedgerError(f"execution {eid!r} is already registered")
            if self.open_count() >= self.max_open:
                raise LedgerError(f"{self.max_open} executions already open")
            state = ExecutionState(eid, group_id, metadata=dict(metadata or {}))
            self._by_id[eid] = state
        self.events.dispatched(eid, group_id)
        return state

    def launch(self, execution_id: str) -> ExecutionState:
        state = self.get(execution_id)
        if not state.launched:
            state.launched = True
            self.events.launched(execution_id, state.group_id)
        return state

    def close(self, execution_id: str, reason: str = "completed",
              reward: float | None = None) -> bool:
        """Close once; returns False (and counts) for a duplicate close."""
        if reason not in CLOSE_REASONS:
            raise LedgerError(f"close reason must be one of {CLOSE_REASONS}, not {reason!r}")
        state = self.get(execution_id)
        with self._lock:
            if state.closed_reason is not None:
                self.duplicate_closes += 1
                return False
            state.closed_reason, state.reward = reason, reward
        if not state.launched:
            self.launch(execution_id)
        self.events.closed(execution_id, state.group_id, reason, reward)
        log.info("execution %s closed: %s (reward %s)", execution_id, reason, reward)
        return True

    def get(self, execution_id: str) -> ExecutionState:
        state = self._by_id.get(execution_id)
        if state is None:
            raise LedgerError(f"unknown execution {execution_id!r}")
        return state

    def is_open(self, execution_id: str) -> bool:
        state = self._by_id.get(execution_id)
        return state is not None and state.closed_reason is None

    def open_count(self) -> int:
        return sum(1 for s in self._by_id.values() if s.closed_reason is None)
