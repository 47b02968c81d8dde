"""Warnings counted by class for the line that ends a run.

In: the log records of this process while ``counting_warnings()`` is open. Out: a
``WarningCount`` whose ``line()`` lists every warning class (logger and message template, the
numbers left out) with its count, e.g. ``warnings: 2 × tidal.runtime.actuator "plan %d step %s
on %s failed: %s"``, or ``warnings: none``. WARNING means something a user should act on; a
normal event (a planned satellite departure, a reroute) logs at INFO and is not counted.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Iterator


class WarningCount(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.counts: Counter[tuple[str, str]] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        self.counts[(record.name, str(record.msg))] += 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def line(self) -> str:
        """Every class with its count, most frequent first; ``warnings: none`` without any."""
        if not self.counts:
            return "warnings: none"
        parts = [f'{n} × {name} "{msg}"' for (name, msg), n in self.counts.most_common()]
        return f"warnings: {self.total} ({'; '.join(parts)})"


@contextlib.contextmanager
def counting_warnings() -> Iterator[WarningCount]:
    """Counts WARNING and above of every logger (the root logger's handler) while open."""
    counter = WarningCount()
    root = logging.getLogger()
    root.addHandler(counter)
    try:
        yield counter
    finally:
        root.removeHandler(counter)
