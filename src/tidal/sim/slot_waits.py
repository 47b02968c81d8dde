"""What waiting for a slot cost: measured per execution in virtual time.

In: the moments an execution starts waiting for a slot (dispatched into the queue, or
displaced by a move with no free slot at any destination: over-subscription) and the moments
it gets one (launched, bound to an engine) or closes. Out: the run's ``queued_execution_s``
figures for ``summary.json``: executions that waited, their total, p99 and longest wait.
Measured, not estimated: every interval is the virtual clock's, each execution's intervals
are summed (an execution displaced twice waited twice). An execution still waiting when the
run ends counts up to the end.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tidal.sim.dispatch import ExecRec
    from tidal.sim.world import World

EPS_S = 1e-9  # a launch at the instant of dispatch is no wait


def start(w: World, ex: ExecRec) -> None:
    if ex.wait_since is None:
        ex.wait_since = w.now


def stop(w: World, ex: ExecRec) -> None:
    if ex.wait_since is None:
        return
    waited = w.now - ex.wait_since
    ex.wait_since = None
    if waited > EPS_S:
        w.slot_waits[ex.eid] = w.slot_waits.get(ex.eid, 0.0) + waited


def summary(w: World, end_s: float) -> dict[str, float | int]:
    """``queued_executions`` (executions that waited), ``queued_execution_s`` (their total
    wait), ``queued_execution_p99_s`` and ``queued_execution_max_s`` (over those executions)."""
    waits = dict(w.slot_waits)
    for ex in (*w.queue, *w.waiting):
        if ex.wait_since is not None and end_s - ex.wait_since > EPS_S:
            waits[ex.eid] = waits.get(ex.eid, 0.0) + end_s - ex.wait_since
    return wait_figures(list(waits.values()))


def wait_figures(waits: list[float]) -> dict[str, float | int]:
    """The figures over per-execution waits (seconds, each > 0)."""
    xs = sorted(waits)
    p99 = xs[min(len(xs) - 1, math.ceil(0.99 * len(xs)) - 1)] if xs else 0.0
    return {"queued_executions": len(xs), "queued_execution_s": round(sum(xs), 3),
            "queued_execution_p99_s": round(p99, 3),
            "queued_execution_max_s": round(xs[-1], 3) if xs else 0.0}
