"""Two baselines: ``static`` (a fixed split, plain fully-async disaggregation) and ``colocate``
(every cell alternates a rollout phase and a training phase: synchronous RL).

``static``: the first ``train`` GPUs (or ``cells`` cells) of the order train for the whole run;
the rest serve rollout. It never moves anything.
``colocate``: all cells serve rollout until every dispatched execution has finished (w = 0 and
nothing left to dispatch), then all cells switch to training together; at burst end they all
return together.
"""

from __future__ import annotations

from typing import Any

from tidal.control.mechanics import COLOCATE, VERL
from tidal.control.policy import Action, CellView, Decision, Observation, register_policy
from tidal.errors import ConfigError


@register_policy(
    "static",
    "fixed split: the first `train` GPUs (or `cells` cells) train, "
    "the rest serve rollout; nothing ever moves",
)
class StaticPolicy:
    name = "static"
    mechanics = VERL
    waterlevel_safe = False

    def __init__(self, train: int | None = None, cells: int | None = None) -> None:
        if train is not None and cells is not None:
            raise ConfigError("policy.args", "static: give `train` (GPUs) or `cells`, not both")
        for key, val in (("train", train), ("cells", cells)):
            if val is not None and (not isinstance(val, int) or isinstance(val, bool) or val < 0):
                raise ConfigError(
                    f"policy.args.{key}", f"must be a non-negative integer, got {val!r}"
                )
        self.train_gpus = train
        self.train_cells = cells

    def initial_prefix(self, cells: tuple[CellView, ...]) -> int:
        if self.train_cells is not None:
            if self.train_cells > len(cells):
                raise ConfigError(
                    "policy.args.cells", f"{self.train_cells} cells asked, cluster has {len(cells)}"
                )
            return self.train_cells
        if self.train_gpus is None:
            return 1 if cells else 0
        total = 0
        for n, c in enumerate(cells):
            if total == self.train_gpus:
                return n
            total += c.gpus
        if total == self.train_gpus:
            return len(cells)
        sizes = [c.gpus for c in cells]
        raise ConfigError(
            "policy.args.train",
            f"{self.train_gpus} GPUs is not a prefix of the cell order (cell sizes {sizes})",
        )

    def state(self) -> dict[str, Any]:
        return {}

    def decide(self, obs: Observation) -> Decision:
        return Decision.hold("static split")


@register_policy(
    "colocate",
    "synchronous: all cells roll out until the burst's executions "
    "finish, then all train; all return at burst end",
)
class ColocatePolicy:
    name = "colocate"
    mechanics = COLOCATE
    waterlevel_safe = False

    def __init__(self) -> None:
        self._bursts_handled = 0

    def initial_prefix(self, cells: tuple[CellView, ...]) -> int:
        return 0

    def state(self) -> dict[str, Any]:
        return {"bursts_handled": self._bursts_handled}

    def decide(self, obs: Observation) -> Decision:
        if obs.in_flight:
            return Decision.hold("transition in flight")
        if obs.bursts_ended > self._bursts_handled:
            # The burst end is handled once every cell is back: an aborted return is retried.
            if obs.prefix_len:
                return Decision(
                    Action.TO_ROLLOUT,
                    tuple(range(obs.prefix_len)),
                    "burst end: all cells return to rollout",
                )
            self._bursts_handled = obs.bursts_ended
        if (
            obs.prefix_len == 0
            and obs.waterlevel == 0
            and obs.pending_dispatch == 0
            and obs.supply.supply > 0
        ):
            return Decision(
                Action.TO_TRAINING,
                tuple(c.index for c in obs.cells),
                "rollout phase over: all cells switch to training",
            )
        return Decision.hold("rollout phase" if obs.prefix_len == 0 else "training phase")
