"""QwenGyre's waterlevel policy (REFERENCE.md §1).

Rule, evaluated after every event while no transition is in flight:
1. Move the next cell of the order (core first) to training iff the rollout capacity left after
   the move covers the waterlevel (``C_R - C_e >= w``; executions announced but not yet
   dispatched count too) and the ready supply has reached its threshold and held for the
   configured interval.
2. Burst end (the final update of a burst has happened): satellites return to rollout one at a
   time, last first, so the training set stays a prefix. The core stays in training for the
   next batch only if the ready supply passes and the rollout capacity without it covers the
   waterlevel plus the executions still to be dispatched; otherwise it returns too.
State: the number of burst ends already handled (bounded: one integer and one flag).
"""

from __future__ import annotations

from typing import Any

from tidal.control.mechanics import QWENGYRE
from tidal.control.policy import (
    Action,
    CellView,
    Decision,
    Observation,
    default_prefix,
    register_policy,
)
from tidal.errors import ConfigError
from tidal.types import Role


def capacity_after_move(obs: Observation, cell: CellView) -> int:
    return obs.rollout_capacity - (cell.slots if cell.role is Role.ROLLOUT else 0)


def move_is_safe(obs: Observation, cell: CellView) -> bool:
    """Invariant 3: capacity after the move still covers the waterlevel, supply held."""
    return capacity_after_move(obs, cell) >= obs.waterlevel and obs.supply.ok


@register_policy(
    "waterlevel",
    "QwenGyre: move the next cell when capacity after the move "
    "covers the waterlevel and ready supply held; satellites return at burst end",
)
class WaterlevelPolicy:
    name = "waterlevel"
    mechanics = QWENGYRE
    waterlevel_safe = True
    # Cells return to rollout only at a burst end: with no rollout capacity at the start (all
    # cells hybrid, no standalone engine) no burst could ever end. The controller refuses that.
    requires_rollout_at_start = True

    def __init__(self, core_may_stay: bool = True) -> None:
        if not isinstance(core_may_stay, bool):
            raise ConfigError("policy.args.core_may_stay", "must be true or false")
        self.core_may_stay = core_may_stay
        self._bursts_handled = 0
        self._returning = False

    def initial_prefix(self, cells: tuple[CellView, ...]) -> int:
        return default_prefix(cells)

    def state(self) -> dict[str, Any]:
        return {"bursts_handled": self._bursts_handled, "returning": self._returning}

    def decide(self, obs: Observation) -> Decision:
        if obs.in_flight:
            return Decision.hold("transition in flight")
        if obs.bursts_ended > self._bursts_handled:
            self._bursts_handled = obs.bursts_ended
            self._returning = True
        if self._returning:
            decision = self._burst_end(obs)
            if decision.action is Action.HOLD:
                self._returning = False
            return decision
        return self._advance(obs)

    def _burst_end(self, obs: Observation) -> Decision:
        last = obs.last_training()
        if last is None:
            return Decision.hold("burst end: nothing in training")
        if last.index > 0:
            return Decision(
                Action.TO_ROLLOUT,
                (last.index,),
                f"burst end: satellite {last.index} returns to rollout",
            )
        # Only the core is left on the training side.
        need = obs.waterlevel + obs.pending_dispatch
        if self.core_may_stay and obs.supply.ok and obs.rollout_capacity >= need:
            return Decision.hold(
                f"burst end: core stays (capacity {obs.rollout_capacity} "
                f">= {need}, supply {obs.supply.supply})"
            )
        return Decision(
            Action.TO_ROLLOUT,
            (0,),
            f"burst end: core returns (capacity {obs.rollout_capacity} vs need "
            f"{need}, supply ok={obs.supply.ok})",
        )

    def _advance(self, obs: Observation) -> Decision:
        nxt = obs.next_to_train()
        if nxt is None:
            return Decision.hold("every cell is training")
        after = capacity_after_move(obs, nxt)
        need = obs.waterlevel + obs.pending_dispatch
        if after < need:
            return Decision.hold(
                f"capacity after move {after} < waterlevel {obs.waterlevel} "
                f"+ pending {obs.pending_dispatch}"
            )
        if not obs.supply.passing:
            return Decision.hold(f"supply {obs.supply.supply} < {obs.supply.threshold:g}")
        if not obs.supply.ok:
            return Decision.hold("supply not held long enough")
        return Decision(
            Action.TO_TRAINING,
            (nxt.index,),
            f"capacity after move {after} >= waterlevel {obs.waterlevel}, "
            f"supply {obs.supply.supply} held {obs.supply.held_s:.1f}s",
        )
