"""Ready supply: is there enough ready training data, for long enough, to justify a move?

In: the number of ready, unassigned groups, the groups already assigned to the current batch,
and the injected clock's time. Out: ``SupplyView`` (supply, threshold, held seconds, ok).

supply = min(ready unassigned groups, groups the current batch still needs); it passes when it
reaches ``fraction * batch_groups`` (or everything the batch still needs, if that is less; a
batch fully assigned but untrained passes) and passes "held" once it has passed continuously
for ``hold_s`` seconds on the injected clock (REFERENCE.md §1).
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.errors import ConfigError


@dataclass(frozen=True)
class SupplyView:
    supply: int
    needed: int
    threshold: float
    passing: bool
    held_s: float
    ok: bool


class SupplyTracker:
    def __init__(self, batch_groups: int, fraction: float, hold_s: float) -> None:
        if batch_groups < 1:
            raise ConfigError("supply.batch_groups", f"must be >= 1, got {batch_groups}")
        if not 0.0 <= fraction <= 1.0:
            raise ConfigError("supply.fraction", f"must be in [0, 1], got {fraction}")
        if hold_s < 0:
            raise ConfigError("supply.hold_s", f"must be >= 0, got {hold_s}")
        self.batch_groups = batch_groups
        self.fraction = fraction
        self.hold_s = hold_s
        self._since: float | None = None

    def view(self, now_s: float, ready_unassigned: int, assigned_in_batch: int) -> SupplyView:
        needed = max(0, self.batch_groups - assigned_in_batch)
        supply = min(ready_unassigned, needed)
        # A batch already partly assigned may need fewer groups than the threshold; then all it
        # still needs suffices (else no cell could ever move to finish it). A batch fully
        # assigned but not yet trained needs cells, not data: it passes.
        threshold = min(self.fraction * self.batch_groups, needed)
        passing = supply >= threshold and (supply > 0 or needed == 0)
        if not passing:
            self._since = None
        elif self._since is None:
            self._since = now_s
        held_s = 0.0 if self._since is None else now_s - self._since
        return SupplyView(
            supply, needed, threshold, passing, held_s, passing and held_s >= self.hold_s
        )
