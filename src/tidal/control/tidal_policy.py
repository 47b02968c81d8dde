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
  (drift after the move >= 0, supply held), the policy sets ``dispatch_limit`` to the capacity
  after the move: the dispatcher starts no new group past it, ``w`` drains to it and the move
  becomes waterlevel-safe (on-demand dispatch otherwise refills every freed slot, so ``w``
  never falls below capacity before the budget runs out). Every other decision clears it.
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

from tidal.control.mechanics import TIDAL
from tidal.control.policy import (
    Action,
    CellView,
    Decision,
    Observation,
    register_policy,
)
from tidal.control.waterlevel import capacity_after_move
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
        #: executions the waterlevel may reach by new dispatches (None: no limit); read by
        #: the dispatcher through ``Controller.dispatch_limit``
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
        self.dispatch_limit = None
        gpus = _training_gpus(obs)
        queue = obs.ready_groups
        todo = obs.waterlevel + obs.pending_dispatch
        batch = obs.batch_groups
        cap = obs.rollout_capacity
        p, c = self.production.rate, self.consumption.rate
        # A backlog of ready groups (two batches or more) shows production ahead of
        # consumption without waiting for the rates.
        backlog = queue >= 2 * batch
        if (p is None or c is None) and gpus > 0 and cap > 0 and not backlog:
            return Decision.hold("measuring rates")
        # With nothing training, or nothing to roll out on, a side is stuck: the unknown rate
        # counts as zero and the moves below follow from slots and supply alone.
        p = 0.0 if p is None else p
        c = 0.0 if c is None else c
        # Return training cells (the last ones, as a block) when rollout is short of slots and
        # the trainer would run dry within the horizon anyway.
        # With no rollout capacity at all the floor goes: someone must produce data. So does
        # it when the trainer is starving: not one batch ready within the horizon even with
        # every slot (the lent ones too) producing.
        floor = self.min_train_cells if cap > 0 else 0
        if gpus > 0 and queue < batch and queue + p * min(cap + _training_slots(obs), todo) \
                * self.horizon_s < batch:
            floor = 0
        movable = [v for v in obs.cells[floor:obs.prefix_len] if v.role is Role.TRAINING]
        if movable and len(movable) == obs.prefix_len - floor and todo > cap:
            drift = p * min(cap, todo) - c * gpus
            projected = queue + drift * self.horizon_s
            if projected < self.low_batches * batch or cap == 0:
                if self._dwelling(obs, Action.TO_ROLLOUT):
                    return Decision.hold("dwell before reversing the last move")
                block, slots, lent = [], 0, 0
                for v in reversed(movable):
                    # The smallest block that balances the rates or covers the missing slots.
                    block.append(v)
                    slots += v.slots
                    lent += v.gpus
                    drift_k = p * min(cap + slots, todo) - c * (gpus - lent)
                    if cap + slots >= todo or drift_k >= 0:
                        break
                cells = tuple(sorted(v.index for v in block))
                return self._move(obs, Action.TO_ROLLOUT, cells,
                                  f"rollout short: {todo} executions to run > {cap} slots; "
                                  f"queue {queue} -> {projected:.1f} groups in "
                                  f"{self.horizon_s:g}s < {self.low_batches * batch:g}")
        # Lend the next cell to training when rollout does not need its slots, the move is
        # waterlevel-safe and the trainer has data to keep it busy.
        nxt = obs.next_to_train()
        if nxt is None or nxt.role is not Role.ROLLOUT:
            return Decision.hold("balanced")
        after = capacity_after_move(obs, nxt)
        if gpus == 0 and queue >= batch and obs.supply.ok:
            # Nothing trains while a whole batch is ready: lend, holding dispatch while the
            # waterlevel is in the way (on-demand dispatch refills every freed slot).
            if after >= obs.waterlevel:
                return self._move(obs, Action.TO_TRAINING, (nxt.index,),
                                  f"nothing trains and {queue} groups are ready")
            if after > 0:
                self.dispatch_limit = after
                return Decision.hold(f"holding dispatch at {after} executions so cell "
                                     f"{nxt.index} can train a ready batch (waterlevel "
                                     f"{obs.waterlevel})")
        drift_after = p * min(after, todo) - c * (gpus + nxt.gpus)
        if after < obs.waterlevel:
            if drift_after >= 0 and p > 0 and obs.supply.ok and after > 0:
                # Production outpaces consumption even with one more training cell: stop
                # dispatching until the waterlevel fits the smaller rollout side.
                self.dispatch_limit = after
                return Decision.hold(f"holding dispatch at {after} executions so cell "
                                     f"{nxt.index} can train (waterlevel {obs.waterlevel})")
            return Decision.hold(f"capacity after move {after} < waterlevel {obs.waterlevel}")
        if todo > after and drift_after < 0 and not backlog:
            return Decision.hold(f"rollout needs the slots: {todo} executions to run > {after} "
                                 f"and the queue would drain ({drift_after:.4f} groups/s)")
        if not obs.supply.ok:
            return Decision.hold(f"supply {obs.supply.supply} not ok")
        projected = queue + drift_after * self.dwell_s
        if projected < self.high_batches * batch:
            return Decision.hold(f"projected queue {projected:.1f} < "
                                 f"{self.high_batches * batch:g} with one more cell")
        if self._dwelling(obs, Action.TO_TRAINING):
            return Decision.hold("dwell before reversing the last move")
        why = (f"rollout has spare slots ({todo} executions to run <= {after})"
               if todo <= after else
               f"the queue still grows with one more cell ({drift_after:.4f} groups/s)")
        return self._move(obs, Action.TO_TRAINING, (nxt.index,),
                          f"{why}; queue {queue} -> {projected:.1f} groups in "
                          f"{self.dwell_s:g}s")

    # ---------------------------------------------------------------- internals
    def _dwelling(self, obs: Observation, action: Action) -> bool:
        """Hysteresis: a move against the direction of the last one waits ``dwell_s``."""
        return action is not self._last_action and obs.now_s - self._last_move_s < self.dwell_s

    def _move(self, obs: Observation, action: Action, cells: tuple[int, ...],
              why: str) -> Decision:
        self._last_move_s = obs.now_s
        self._last_action = action
        return Decision(action, cells, why)

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


def _training_slots(obs: Observation) -> int:
    return sum(c.slots for c in obs.cells if c.role is Role.TRAINING)


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
