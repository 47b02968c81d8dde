"""An example scheduling policy, loaded from outside tidal (docs/custom-policy.md).

``capped-waterlevel``: QwenGyre's waterlevel rule with at most ``max_cells`` cells training.
The next cell of the order moves to training when the rollout capacity left after the move
still covers the executions in flight (the waterlevel) plus those about to be dispatched, and
the ready supply has held; at a burst end the satellites return to rollout, last first.
"""

from __future__ import annotations

from typing import Any

from tidal.control.mechanics import QWENGYRE
from tidal.control.policy import Action, Decision, Observation, default_prefix, register_policy
from tidal.control.waterlevel import capacity_after_move
from tidal.errors import ConfigError


@register_policy("capped-waterlevel", "example: waterlevel moves, at most max_cells training")
class CappedWaterlevel:
    name = "capped-waterlevel"
    mechanics = QWENGYRE  # what the simulator gives it: burst dispatch, streaming trainer...
    waterlevel_safe = True  # the controller checks each move to training against the waterlevel

    def __init__(self, max_cells: int = 2) -> None:
        if not isinstance(max_cells, int) or max_cells < 1:
            raise ConfigError("policy.args.max_cells", f"must be an integer >= 1: {max_cells!r}")
        self.max_cells = max_cells
        self.bursts_handled = 0

    def initial_prefix(self, cells: tuple[Any, ...]) -> int:
        return default_prefix(cells)  # hybrid cells start training, elastic ones roll out

    def state(self) -> dict[str, Any]:
        return {"bursts_handled": self.bursts_handled}

    def decide(self, obs: Observation) -> Decision:
        if obs.in_flight:
            return Decision.hold("transition in flight")
        last = obs.last_training()
        if obs.bursts_ended > self.bursts_handled:  # burst end: satellites return, last first
            if last is not None and last.index > 0:
                return Decision(Action.TO_ROLLOUT, (last.index,), "burst end: satellite returns")
            self.bursts_handled = obs.bursts_ended
        nxt = obs.next_to_train()
        if nxt is None or obs.prefix_len >= self.max_cells:
            return Decision.hold(f"{obs.prefix_len} cells training (cap {self.max_cells})")
        need = obs.waterlevel + obs.pending_dispatch
        if capacity_after_move(obs, nxt) < need or not obs.supply.ok:
            return Decision.hold(f"capacity after move < {need} or supply not held")
        return Decision(Action.TO_TRAINING, (nxt.index,), f"capacity covers {need}")
