"""Ledger events of the execution lifecycle: the proxy's registry of executions, the one owner
of their registration and close (the harness pool registers and closes its own here over HTTP,
as external harnesses do, and reports the close this registry kept to the run's ledger).

In: registrations, launches and closes of executions over HTTP. Out: ``dispatched`` /
``launched`` / ``closed`` callbacks that the control plane's execution ledger implements.
Invariant kept here: an execution closes exactly once; a duplicate close is ignored and counted.
Bounded: at most ``max_open`` open executions; a closed one keeps only its id and outcome
(metadata dropped), the newest ``max_closed`` of them (for duplicate closes and refusing a
closed id's calls); an open one idle (no registration, launch or call) for ``idle_s`` plus its
own ``timeout_s`` is closed as ``timeout``.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from tidal.clock import Clock, WallClock
from tidal.contracts.close import CLOSE_REASONS, CloseReason
from tidal.errors import LedgerError

log = logging.getLogger(__name__)


@runtime_checkable
class LedgerEvents(Protocol):
    def dispatched(self, execution_id: str, group_id: str) -> None: ...
    def launched(self, execution_id: str, group_id: str) -> None: ...
    def closed(
        self, execution_id: str, group_id: str, reason: str, reward: float | None
    ) -> None: ...


@dataclass
class EventLog:
    """A ``LedgerEvents`` that keeps every event in order (tests, and a local run's record);
    with ``max_events`` only the newest ones (the older half is dropped when it is reached)."""

    events: list[tuple] = field(default_factory=list)
    max_events: int | None = None

    def dispatched(self, execution_id: str, group_id: str) -> None:
        self._add(("dispatched", execution_id, group_id))

    def launched(self, execution_id: str, group_id: str) -> None:
        self._add(("launched", execution_id, group_id))

    def closed(self, execution_id: str, group_id: str, reason: str, reward: float | None) -> None:
        self._add(("closed", execution_id, group_id, reason, reward))

    def _add(self, event: tuple) -> None:
        self.events.append(event)
        if self.max_events is not None and len(self.events) > self.max_events:
            del self.events[: len(self.events) // 2]


@dataclass
class ExecutionState:
    execution_id: str
    group_id: str
    launched: bool = False
    closed_reason: str | None = None
    reward: float | None = None
    metadata: dict = field(default_factory=dict)
    seen_s: float = 0.0  # its last registration, launch or call (idle expiry)


class ExecutionRegistry:
    """Known executions and their lifecycle; forwards each transition to ``events`` once."""

    def __init__(
        self,
        events: LedgerEvents | None = None,
        max_open: int = 100_000,
        max_closed: int = 100_000,
        idle_s: float | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.events = events or EventLog()
        self.max_open, self.max_closed, self.idle_s = max_open, max_closed, idle_s
        self.clock = clock or WallClock()
        self._by_id: dict[str, ExecutionState] = {}
        self._closed: deque[str] = deque()  # closed ids, oldest first
        self._open = 0
        self._swept_s = self.clock.now()
        self._lock = threading.Lock()
        self.duplicate_closes = 0
        self.expired = 0

    def dispatch(
        self,
        group_id: str = "default",
        execution_id: str | None = None,
        metadata: dict | None = None,
    ) -> ExecutionState:
        self.expire_idle()
        with self._lock:
            eid = execution_id or f"ex-{uuid.uuid4().hex[:12]}"
            if eid in self._by_id:
                raise LedgerError(f"execution {eid!r} is already registered")
            if self._open >= self.max_open:
                raise LedgerError(f"{self.max_open} executions already open")
            state = ExecutionState(
                eid, group_id, metadata=dict(metadata or {}), seen_s=self.clock.now()
            )
            self._by_id[eid] = state
            self._open += 1
        self.events.dispatched(eid, group_id)
        return state

    def launch(self, execution_id: str) -> ExecutionState:
        state = self.get(execution_id)
        state.seen_s = self.clock.now()
        if not state.launched:
            state.launched = True
            self.events.launched(execution_id, state.group_id)
        return state

    def close(
        self, execution_id: str, reason: str = CloseReason.COMPLETED, reward: float | None = None
    ) -> bool:
        """Close once; returns False (and counts) for a duplicate close."""
        if reason not in CLOSE_REASONS:
            raise LedgerError(f"close reason must be one of {CLOSE_REASONS}, not {reason!r}")
        state = self.get(execution_id)
        with self._lock:
            if state.closed_reason is not None:
                self.duplicate_closes += 1
                return False
            state.closed_reason, state.reward = reason, reward
            state.metadata = {}
            self._open -= 1
            self._closed.append(execution_id)
            while len(self._closed) > self.max_closed:
                self._by_id.pop(self._closed.popleft(), None)
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
        return self._open

    def __len__(self) -> int:
        return len(self._by_id)

    def expire_idle(self) -> int:
        """Close as ``timeout`` every open execution idle past ``idle_s`` plus its own
        ``timeout_s`` (a call in flight is bounded by it); at most one sweep a second."""
        now = self.clock.now()
        if self.idle_s is None or now - self._swept_s < 1.0:
            return 0
        self._swept_s = now
        idle = [
            s
            for s in list(self._by_id.values())
            if s.closed_reason is None
            and now - s.seen_s > self.idle_s + float(s.metadata.get("timeout_s") or 0)
        ]
        for state in idle:
            log.info(
                "execution %s idle for %.0f s: closed (timeout)",
                state.execution_id,
                now - state.seen_s,
            )
            self.close(state.execution_id, CloseReason.TIMEOUT)
        self.expired += len(idle)
        return len(idle)
