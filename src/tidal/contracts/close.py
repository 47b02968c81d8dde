"""Why an execution closed: the one definition every package uses.

The harness side reports it (``tidal.serving.executions``), the ledger counts it
(``tidal.control.ledger``), the training record keeps it (``contracts.calls.ExecutionRecord``)
and the run directory writes it (``executions.jsonl``, ``summary.json``). One enum, no rename
maps: a value written by one package is read back unchanged by every other.
"""

from __future__ import annotations

import enum


class CloseReason(enum.StrEnum):
    COMPLETED = "completed"
    FAILED = "failed"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    REWARD_ERROR = "reward_error"  # the reward function raised or returned a non-number


CLOSE_REASONS: tuple[str, ...] = tuple(r.value for r in CloseReason)
