"""tidal's own policy: a rate model of production against consumption, decided on every event.

Rule (evaluated after every event and tick while no transition is in flight):
- Measure two rates with bounded state (exponentially weighted, one time constant ``tau_s``):
  production ``p`` = ready groups generated per running-execution-second, and consumption
  ``c`` = groups taken by the trainer per training-GPU-second (measured only while the
  trainer had data).
- For the current split, the ready-queue drift is ``S - D`` with supply
  ``S = p * min(C_R, w + pending_dispatch)`` (rollout can only run what is dispatched or still to
  be dispatched) and demand ``D = c * training_gpus``. The same formulas give the drift after a
  candidate move.
- Lend the next cell of the order to training (partial lending, one cell at a time, prefix
  order) iff rollout does not need its slots (``w + pending_dispatch <= C_R - C_cell``: all
  work dispatched or still to dispatch fits without it) or production still outpaces
  consumption with one more training cell (drift after the move >= 0), the move is waterlevel-safe
  (capacity after the move >= w and ready supply held — invariant 3, enforced again by the
  controller) and the queue projected over ``dwell_s`` under the new split stays at or above
  ``high_batches`` batches (the lent cell will have data).
- Return training cells to rollout (the last ones of the prefix, as one block: the smallest
  that makes the drift non-negative or covers the missing slots; never below
  ``min_train_cells`` unless no rollout capacity is left at all) iff rollout is short of
  slots (``w + pending_dispatch > C_R``) and the queue projected over ``H`` under the
  current split falls below ``low_batches`` batches.
- Starving trainer: the ``min_train_cells`` floor goes when not one batch would be ready
  within ``H`` even with every slot producing (the training cells' too), so the last training
  cells may return as above; and while nothing trains and a whole batch is ready (supply
  held), the next cell is lent, with a dispatch hold at the capacity after the move while the
  waterlevel is above it.
- Hysteresis: a move against the direction of the previous one waits ``dwell_s`` after it
  (a reversal costs a switch each way); moves in the same direction chain without delay.
- Dispatch hold: when the next lend is blocked only by the waterlevel (capacity after the move
  < ``w``) while production, measured, still outpaces consumption with one more training cell
  (drift after the move >= 0, supply held), the hold carries ``Decision.dispatch_limit`` = the
  capacity after the move: the dispatcher starts no new group past it, ``w`` drains to it and
  the move becomes waterlevel-safe (on-demand dispatch otherwise refills every freed slot, so ``w``
  never falls below capacity before the budget runs out). Every other decision has none.
- A backlog of ready groups (two batches or more) counts as production ahead of consumption:
  it lends without waiting for the rates (still waterlevel-safe, with held supply).
Before the rates are known the policy holds, unless one side is empty (no training cell, or no
rollout slot): then the unknown rate counts as zero, so a cluster of one cell alternates.
State: two rate estimates, their integration points, the time and direction of the last move,
the dispatch limit (all bounded, logged with every decision).
"""

from __future__ import annotations

import math
from typing import Any

from tidal.control import tidal_rules as rules
from tidal.control.mechanics import TIDAL
from tidal.control.policy import (
    Action,
    CellView,
    Decision,
    Observation,
    register_policy,
)
from tidal.control.tidal_rules import Situation
from tidal.errors import ConfigError
from tidal.types import Role


class RateEstimate:
    """An exponentially weighted rate of ``d(count) / d(exposure)`` with time constant tau."""

    def __init__(self, tau_s: float) -> None:
        self.tau_s = tau_s
        self.count = 0.0
        self.exposure = 0.0

    def add(self, count: float, exposure: float, dt_s: float) -> None:
        decay = math.exp(-dt_s / self.tau_s) if dt_s > 0 else 1.0
        self.count = self.count * decay + count
        self.exposure = self.exposure * decay + exposure

    @property
    def rate(self) -> float | None:
        return self.count / self.exposure if self.exposure > 1e-9 and self.count > 0 else None


@register_policy("tidal", "rate model of production vs consumption, decided on every event: "
                 "partial lending in prefix order, waterlevel-safe, hysteresis; args "
                 "horizon_s, dwell_s, low_batches, high_batches, min_train_cells, tau_s")
class TidalPolicy:
    name = "tidal"
    mechanics = TIDAL
    waterlevel_safe = True

    def __init__(self, horizon_s: float = 300.0, dwell_s: float = 20.0,
                 low_batches: float = 2.0, high_batches: float = 0.0,
                 min_train_cells: int = 1, tau_s: float = 600.0) -> None:
        for key, val in (("horizon_s", horizon_s), ("dwell_s", dwell_s),
                         ("tau_s", tau_s), ("low_batches", low_batches),
                         ("high_batches", high_batches)):
            if isinstance(val, bool) or not isinstance(val, int | float) or val < 0:
                raise ConfigError(f"policy.args.{key}", f"must be a number >= 0, got {val!r}")
        if isinstance(min_train_cells, bool) or not isinstance(min_train_cells, int) \
                or min_train_cells < 0:
            raise ConfigError("policy.args.min_train_cells",
                              f"must be a non-negative integer, got {min_train_cells!r}")
        if tau_s <= 0:
            raise ConfigError("policy.args.tau_s", "must be > 0")
        self.horizon_s = float(horizon_s)
        self.dwell_s = float(dwell_s)
        self.low_batches = float(low_batches)
        self.high_batches = float(high_batches)
        self.min_train_cells = min_train_cells
        self.production = RateEstimate(tau_s)  # groups per running-execution-second
        self.consumption = RateEstimate(tau_s)  # groups per training-GPU-second
        self._last: tuple[float, int, int, int, int, int] | None = None
        self._last_move_s = -math.inf
        self._last_action = Action.HOLD
        #: the last decision's dispatch hold, logged with the state (the controller reads it
        #: from the ``Decision``)
        self.dispatch_limit: int | None = None

    # ---------------------------------------------------------------- protocol
    def initial_prefix(self, cells: tuple[CellView, ...]) -> int:
        return min(self.min_train_cells, len(cells))

    def state(self) -> dict[str, Any]:
        p, c = self.production.rate, self.consumption.rate
        held = {} if self.dispatch_limit is None else {"dispatch_limit": self.dispatch_limit}
        return {**held, "p_groups_per_exec_s": None if p is None else round(p, 9),
                "c_groups_per_gpu_s": None if c is None else round(c, 9),
                "last_move_s": None if self._last_move_s == -math.inf
                else round(self._last_move_s, 6)}

    def decide(self, obs: Observation) -> Decision:
        self._observe(obs)
        if obs.in_flight:
            return Decision.hold("transition in flight")
        p, c = self.production.rate, self.consumption.rate
        situation = Situation(obs, 0.0 if p is None else p, 0.0 if c is None else c,
                              p is not None and c is not None, _training_gpus(obs),
                              self._last_action, self._last_move_s)
        d = rules.decide(situation, self)
        self.dispatch_limit = d.dispatch_limit
        if d.action is not Action.HOLD:
            self._last_move_s = obs.now_s
            self._last_action = d.action
        return d

    # ---------------------------------------------------------------- internals
    def _observe(self, obs: Observation) -> None:
        now = obs.now_s
        # Groups taken by the trainer so far: whole steps plus this step's claimed groups (a
        # streaming trainer claims them as it processes them).
        taken = obs.trainer_step * obs.batch_groups + (obs.batch_groups - obs.supply.needed)
        cur = (now, obs.groups_generated, taken, obs.running,
               _training_gpus(obs), obs.ready_groups)
        if self._last is None:
            self._last = cur
            return
        t0, gen0, taken0, run0, gpus0, ready0 = self._last
        dt = now - t0
        if dt < 0:
            return
        self._last = cur
        self.production.add(obs.groups_generated - gen0, run0 * dt, dt)
        consumed = max(0, taken - taken0)
        # Trainer exposure counts only while it had data (a starving trainer says nothing
        # about its speed).
        exposure = gpus0 * dt if ready0 > 0 or consumed > 0 else 0.0
        self.consumption.add(consumed, exposure, dt)


_GPUS_CACHE: dict[int, tuple[tuple[CellView, ...], int]] = {}


def _training_gpus(obs: Observation) -> int:
    # The controller hands out the same cells tuple until a role changes: count it once.
    hit = _GPUS_CACHE.get(id(obs.cells))
    if hit is not None and hit[0] is obs.cells:
        return hit[1]
    gpus = sum(c.gpus for c in obs.cells if c.role is Role.TRAINING)
    if len(_GPUS_CACHE) > 64:
        _GPUS_CACHE.clear()
    _GPUS_CACHE[id(obs.cells)] = (obs.cells, gpus)
    return gpus
