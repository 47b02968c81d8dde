"""What waiting for a slot cost a run: per-execution waits in, the ``queued_execution_*``
figures out.

In: measured waits (seconds), each charged to the execution whose work waited: in the
simulator an execution waiting for a free slot (dispatched but not launched, or displaced by a
move with no room at any destination: over-subscription), in ``tidal run`` a model call of the
execution waiting in the proxy's admission queue. Out: the figures ``summary.json`` reports
(``figures``): ``queued_executions`` (executions that waited at all), ``queued_execution_s``
(their waits summed), ``queued_execution_p99_s`` and ``queued_execution_max_s`` (over those
executions, each execution's waits summed). Measured, never estimated: callers pass clock
intervals. Pure: no clock, no I/O. Bounded: at most ``max_open`` executions are kept by id
(the oldest is then folded into the finished list, one float per execution that waited).
"""

from __future__ import annotations

import math

KEYS = (
    "queued_executions",
    "queued_execution_s",
    "queued_execution_p99_s",
    "queued_execution_max_s",
)
EPS_S = 1e-9  # a slot taken at the instant it was asked for is no wait


def figures(waits: list[float]) -> dict[str, float | int]:
    """The figures over per-execution waits (those <= ``EPS_S`` are no wait)."""
    xs = sorted(x for x in waits if x > EPS_S)
    p99 = xs[min(len(xs) - 1, math.ceil(0.99 * len(xs)) - 1)] if xs else 0.0
    return {
        "queued_executions": len(xs),
        "queued_execution_s": round(sum(xs), 3),
        "queued_execution_p99_s": round(p99, 3),
        "queued_execution_max_s": round(xs[-1], 3) if xs else 0.0,
    }


class QueuedWaits:
    """Waits summed per execution (``add``), their ``figures``."""

    def __init__(self, max_open: int = 100_000) -> None:
        self.max_open = max_open
        self._open: dict[str, float] = {}
        self._done: list[float] = []

    def add(self, execution_id: str, waited_s: float) -> None:
        if waited_s <= EPS_S:
            return
        self._open[execution_id] = self._open.get(execution_id, 0.0) + waited_s
        if len(self._open) > self.max_open:
            oldest = next(iter(self._open))
            self._done.append(self._open.pop(oldest))

    def figures(self, ongoing: dict[str, float] | None = None) -> dict[str, float | int]:
        """The figures, with ``ongoing`` waits (execution -> seconds so far) added to each
        execution's total without being recorded."""
        per = dict(self._open)
        for eid, s in (ongoing or {}).items():
            per[eid] = per.get(eid, 0.0) + s
        return figures([*self._done, *per.values()])
