"""The JSONL decision log: every scheduling decision with its inputs, plan lifecycle records.

The log never does I/O itself: it hands each record (a JSON-ready dict) to a sink the caller
supplies (a file writer in the CLI and runtime, a list in tests). Consecutive holds that differ
only in their numbers are logged once, so the log stays proportional to decisions, not events.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

Sink = Callable[[dict[str, Any]], None]
_DIGITS = re.compile(r"[-+]?\d+(\.\d+)?")


class DecisionLog:
    def __init__(self, sink: Sink | None = None, keep: bool = True) -> None:
        self._sink = sink
        self.keep = keep
        self.records: list[dict[str, Any]] = []
        self._last_hold_key: str | None = None
        self.count = 0

    def write(self, record: dict[str, Any]) -> None:
        self.count += 1
        if self.keep:
            self.records.append(record)
        if self._sink is not None:
            self._sink(record)

    def wants(self, action: str, reason: str) -> bool:
        """False for a hold that repeats the previous one up to its numbers (callers skip
        building the record); True otherwise. Updates the dedupe state."""
        if action != "hold":
            self._last_hold_key = None
            return True
        key = _DIGITS.sub("#", reason)
        if key == self._last_hold_key:
            return False
        self._last_hold_key = key
        return True

    def decision(self, record: dict[str, Any]) -> None:
        if self.wants(str(record.get("action")), str(record.get("reason", ""))):
            self.write({"type": "decision", **record})


def jsonl_file_sink(fh: Any) -> Sink:
    """A sink writing one compact JSON object per line to an open text file."""
    import json

    def sink(record: dict[str, Any]) -> None:
        fh.write(json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n")

    return sink
