"""The dispatch hold: whether a dispatcher may start the next group under the policy's limit.

In: the outstanding executions (the waterlevel ``w = dispatched - finished``, plus any the
dispatcher has handed off but the ledger has not yet counted), the executions the next group
adds, and the limit the policy holds (``Controller.dispatch_limit``; None: no hold). Out: yes or
no. One rule for every dispatcher (the simulator's on-demand dispatcher, the runtime's paced
one), so the same policy object holds dispatch the same way in both.

Rule: with no limit, a group may go; with a limit ``L``, a group of ``k`` executions may go iff
``outstanding + k <= L`` (a new dispatch never raises the waterlevel past the limit; the
waterlevel may already stand above it when the hold is set, and then drains to it). A refused
group is not dropped: the dispatcher keeps it, in its place in the dispatch order, and asks
again when the outstanding work or the limit changes, so once the hold is lifted every held
group is dispatched exactly once, in order (invariant 7: nothing lost or run twice).
Pure: no clock, no I/O.
"""

from __future__ import annotations


def may_dispatch(outstanding: int, executions: int, limit: int | None) -> bool:
    """True iff a group of ``executions`` may be dispatched now with ``outstanding``
    executions dispatched and not finished, under the policy's ``limit`` (None: no hold)."""
    return limit is None or outstanding + executions <= limit
