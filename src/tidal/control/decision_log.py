"""The JSONL decision log: every scheduling decision with its inputs, plan lifecycle records.

The log never does I/O itself: it hands each record (a JSON-ready dict) to a sink the caller
supplies (a file writer in the CLI and runtime, a list in tests). Consecutive holds of one kind
(the reason with its numbers masked) under one dispatch limit (``Controller.dispatch_limit``,
the number a hold acts on; None: no hold on dispatch) are logged once, so the log stays
proportional to decisions, not events (a reason's other numbers, such as the waterlevel, change
with every event); a hold whose kind or limit changes is logged again, so the log shows every
limit the policy held dispatch at.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TextIO

Sink = Callable[[dict[str, Any]], None]
_DIGITS = re.compile(r"[-+]?\d+(\.\d+)?")


class DecisionLog:
    def __init__(self, sink: Sink | None = None, keep: bool = True) -> None:
        self._sink = sink
        self.keep = keep
        self.records: list[dict[str, Any]] = []
        self._last_hold_key: tuple[str, int | None] | None = None
        self.count = 0

    def write(self, record: dict[str, Any]) -> None:
        self.count += 1
        if self.keep:
            self.records.append(record)
        if self._sink is not None:
            self._sink(record)

    def wants(self, action: str, reason: str, limit: int | None = None) -> bool:
        """False for a hold that repeats the previous one (same kind: the reason up to its
        numbers, and the same dispatch ``limit``), so callers skip building the record; True
        otherwise. Updates the dedupe state."""
        if action != "hold":
            self._last_hold_key = None
            return True
        key = (_DIGITS.sub("#", reason), limit)
        if key == self._last_hold_key:
            return False
        self._last_hold_key = key
        return True

    def decision(self, record: dict[str, Any], limit: int | None = None) -> None:
        """Writes a decision record unless it repeats the previous hold (``wants``)."""
        if self.wants(str(record.get("action")), str(record.get("reason", "")), limit):
            self.write({"type": "decision", **record})


def jsonl_file_sink(fh: TextIO) -> Sink:
    """A sink writing one compact JSON object per line to an open text file."""
    import json

    def sink(record: dict[str, Any]) -> None:
        fh.write(json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n")

    return sink
