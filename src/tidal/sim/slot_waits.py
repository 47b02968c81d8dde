"""What waiting for a slot cost, measured per execution in virtual time.

In: the moments an execution starts waiting for a slot (dispatched into the queue, or
displaced by a move with no free slot at any destination: over-subscription) and the moments
it gets one (launched, bound to an engine) or closes. Out: the run's ``queued_execution_*``
figures for ``summary.json`` (``tidal.control.queued_waits``). Measured, not estimated: every
interval is the virtual clock's and each execution's intervals are summed (an execution
displaced twice waited twice); one still waiting when the run ends counts up to the end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tidal.sim.dispatch import ExecRec
    from tidal.sim.world import World


def start(w: World, ex: ExecRec) -> None:
    if ex.wait_since is None:
        ex.wait_since = w.now


def stop(w: World, ex: ExecRec) -> None:
    if ex.wait_since is None:
        return
    w.slot_waits.add(ex.eid, w.now - ex.wait_since)
    ex.wait_since = None


def summary(w: World, end_s: float) -> dict[str, float | int]:
    """The figures, executions still waiting at ``end_s`` counted up to it."""
    ongoing = {
        ex.eid: end_s - ex.wait_since for ex in (*w.queue, *w.waiting) if ex.wait_since is not None
    }
    return w.slot_waits.figures(ongoing)
