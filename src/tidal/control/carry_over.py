"""The staleness budget: how many groups a version dispatches, and how stale a carried group may be.

In: the control section's ``batch_groups``, ``updates_per_burst`` and ``staleness_threshold``
(``ControlConfig.staleness``: one key for the simulator and ``tidal run``), the groups carried
into a version (dispatched, neither trained nor dropped), and for the runtime the ledger's groups
and the trajectory buffer's stale drops. Out: the version's dispatch budget, its quota and the
policy lag a carried group's tokens may reach. One rule for both dispatchers (the simulator's,
``tidal.sim.dispatch.start_burst``; the runtime's, ``tidal.runtime.dispatcher``), so the same
config drives the same mechanic in both.

Rule (verl's ``max_required_samples``, REFERENCE.md §2): a version may have
``budget = int(batch_groups * (1 + staleness_threshold) * updates_per_burst)`` groups dispatched
and not consumed; at its start it dispatches ``budget - carried`` new groups. The trainer trains
the groups that are ready first; the rest (the stragglers) are carried into the next version,
where they count against its budget, and are trained there with tokens of an older version
(their staleness, recorded per token). With ``staleness_threshold`` 0 every version dispatches
exactly ``batch_groups * updates_per_burst`` groups and trains all of them (nothing is carried).
The lag bound: a group dispatched at a version start and carried once is trained at most
``2 * updates_per_burst - 1`` optimizer steps later, so ``max_policy_lag`` is
``updates_per_burst * (1 + ceil(staleness_threshold))``: every group carried once trains, a
group carried again beyond it is dropped at the trajectory buffer's take and counted there
(invariant 6), and no longer counts as carried. Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING

from tidal.control.verl_hooks import dispatch_budget

if TYPE_CHECKING:
    from tidal.control.ledger import Ledger


def budget_groups(batch_groups: int, updates_per_burst: int, staleness_threshold: float) -> int:
    """Groups a version may have dispatched and not consumed (verl's budget)."""
    return dispatch_budget(batch_groups, staleness_threshold, updates_per_burst)


def quota_groups(budget: int, carried: int) -> int:
    """New groups a version dispatches at its start, with ``carried`` groups carried into it."""
    return max(0, budget - carried)


def max_policy_lag(updates_per_burst: int, staleness_threshold: float) -> int:
    """Optimizer steps a trained token may lag the trainer (the trajectory buffer's bound)."""
    return updates_per_burst * (1 + math.ceil(staleness_threshold))


def carried_groups(
    dispatched: Iterable[str], ledger: Ledger, stale_dropped: Collection[str]
) -> int:
    """Of the ``dispatched`` group ids, those neither trained (assigned to a batch) nor
    dropped (by the ledger's rule, or as stale at the trajectory buffer): still running,
    closed and waiting to be trained, or dispatched but not yet counted by the ledger."""
    n = 0
    for gid in dispatched:
        group = ledger.groups.get(gid)
        if group is not None and (group.assigned or group.dropped):
            continue
        if gid in stale_dropped:
            continue
        n += 1
    return n
