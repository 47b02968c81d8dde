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
- A lend on spare slots (everything still to run fits without the cell) is made only while
  the trainer is the bottleneck: the groups the version still needs (this step's plus the
  version's remaining steps') take the current training cells longer, at ``c``, than the
  running executions take to produce the missing ones, at ``p``, plus the measured duration
  of the policy's last lend. Reason: at a version's tail the lent cell otherwise waits for
  data and returns as soon as the next version dispatches (two switches for nothing; seen on
  generated scenarios as 3-9 % behind the best static split).
- Return training cells to rollout (the last ones of the prefix, as one block: the smallest
  that makes the drift non-negative or covers the missing slots; never below
  ``min_train_cells`` unless no rollout capacity is left at all) iff rollout is short of
  slots (``w + pending_dispatch > C_R``) and the queue projected over ``H`` under the
  current split falls below ``low_batches`` batches; while a whole batch is ready, only if
  the return raises the split's throughput ``min(S, D)`` (else it buys back a lend: two
  switches for nothing; seen as 100 switches on a scenario the all-training split wins).
- The throughput knee (``Observation.decode_meter``: tokens the engines decoded and
  sequence-seconds in flight; the proxy's counts in ``tidal run``, the engines' in the
  simulator). Slots are not throughput: an engine past its knee shares a fixed token rate
  among more sequences, so moving a cell's executions onto the others slows them all. The
  policy measures a sequence's speed and the rollout GPUs' tokens per second (over
  ``KNEE_TAU_S``); while sequences run below ``KNEE_SLOWDOWN`` of their best speed and the
  GPUs make about their best, the engines are at their knee and their tokens per GPU-second
  is the capacity ``K``. Rollout then serves at full speed at most ``K g / d`` executions
  on ``g`` rollout GPUs (``d`` tokens per running-execution-second), and ``S`` above counts
  no more: a lend whose engines left would pass the knee counts the production they keep;
  with slots to spare but the engines past their knee, the return rule returns the block
  that raises ``min(S, D)`` most, by more than ``KNEE_GAIN``; and no cell is lent that at
  the recent peak of executions to run (over ``PEAK_WINDOW_S``: the load the next version
  brings back after a version's tail) would leave a split making less. Before the knee is
  seen (or without a meter) slots count as throughput, as before. Reason: on generated
  scenarios the policy lent every cell on spare slots and ran 7-69 % behind the best static
  split (engines past their knee); measured in ``benchmarks/README.md``.
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
- Over-subscription (decision 2; invariant 3 is this policy's default, not its law): when the
  next lend is blocked only by the waterlevel (capacity after the move ``A`` < ``w``, supply
  held), lend it anyway, marked ``Decision.oversubscribe``, iff the rate model predicts the
  queueing costs less than the training it buys. The ``w - A`` executions past the capacity
  wait for a slot (in the simulator a displaced execution waits for a free slot; in
  ``tidal run`` its calls wait in the proxy's admission queue); running executions finish at
  the measured ``q`` per running-execution-second, so the last waits ``T = (w - A) / (q A)``
  and the waiting adds up to ``(w - A) T / 2`` execution-seconds, costing
  ``p (w - A) T / 2`` groups of production. The cell trains ``T`` sooner than a dispatch hold
  would let it: ``c g T`` groups (``g`` its GPUs), no more than the queue plus production
  leave for it. Move iff the benefit exceeds the cost and the ready queue alone covers the
  new split's training over ``T`` (``queue >= c (G + g) T``, ``G`` the training GPUs): the
  groups the waiting executions delay are then not needed before they are done. Reason: while
  the trainer has a backlog, a drained waterlevel is paid in idle training GPUs and a short
  queue of executions costs less; without one the delayed stragglers are the trainer's next
  data and the wait is the makespan's. Bounded: only with ``w - A <= max_queued`` and
  ``T <= max_wait_s``; while executions it displaced wait (launched ones beyond the capacity)
  and within ``max_wait_s`` of the move, the return rule stands aside (the short slots were
  priced when it was decided); once they have waited past ``max_wait_s`` the last training
  cell returns (the wait cap, asked first). Nothing is dropped or aborted: waiting executions
  keep their harness and progress and are admitted in order. ``max_queued = 0`` turns the
  rule off (then the policy keeps invariant 3 as the ``waterlevel`` policy does; the
  controller refuses an unmarked unsafe move either way). Keep ``max_wait_s`` below the
  proxy's ``request_timeout_s`` in real runs: a call that waits past its timeout fails.
- The starving-trainer verdict is not taken before the first batch has completed (no step
  and fewer groups generated than a batch): until then ``p`` counts only the fastest groups
  over every execution's exposure and is biased low.
Start: ``start_cells`` (default 0) cells begin on the training side: the trainer has nothing
to train before the first batch, so every cell rolls out until a whole batch is ready and the
idle-trainer rule lends the core (``min_train_cells`` is the floor returns keep, not the start).
Before the rates are known the policy holds, unless one side is empty (no training cell, or no
rollout slot): then the unknown rate counts as zero, so a cluster of one cell alternates.
State: three rate estimates (production, consumption, execution finishes) and the meter's three
(sequence speed, GPU speed, tokens per execution) with their bests, their integration points, the
recent peak of executions to run (a monotone window), the time and direction of the last move, the
last lend's measured duration, the dispatch limit, the time of the over-subscribed move executions
still wait since (all bounded, logged with every decision where set).
"""

from __future__ import annotations

import math
from collections import deque
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

#: Over-subscription caps (defaults of ``max_queued`` and ``max_wait_s``). Off by default
#: (``max_queued`` 0): on, with the throughput knee, 50 generated scenarios per seed came
#: within 2 % of the best other on 47 / 46 / 45 / 41 (off: 45 / 45 / 41 / 43; seeds 7, 2026,
#: 4242, 90210) at 2-3x the queued execution-hours, and dapo-math-32gpu saved 17.3 % against
#: the best static split (off: 20.5 %): the executions it leaves waiting at a version's tail
#: are the trainer's next data. ``tidal:max_queued=256`` turns it on.
MAX_QUEUED = 0
MAX_WAIT_S = 900.0
#: The look-ahead ``H`` of the return rule and of the starving-trainer verdict. 60 s, not
#: 300 s: over 300 s the production of a version's first minutes hid that the trainer had
#: nothing to train now, so lent cells idled while rollout was short of slots (seed 7: 45/50
#: scenarios within 2 % of the best other with 60 s, 42/50 with 300 s; 30 s 44, 90 s 43,
#: 120 s 43; dapo-math-32gpu unchanged; the real quickstart's bursts 534 -> 490 s).
HORIZON_S = 60.0
#: The decode meter's knee (``Observation.decode_meter``): rates over ``KNEE_TAU_S``, read
#: once ``KNEE_MIN_SEQ_S`` sequence-seconds are in the window; the engines are past their
#: knee while a sequence gets less than ``KNEE_SLOWDOWN`` of its best speed and the rollout
#: GPUs make at least ``KNEE_AT_BEST`` of their best tokens per second. Measured on 4 x 50
#: generated scenarios: 0.7-0.8, 0.85-0.95 and a 300-600 s window change the count within 2 %
#: of the best other by at most one scenario per seed.
KNEE_TAU_S = 60.0
KNEE_MIN_SEQ_S = 30.0
KNEE_SLOWDOWN = 0.8
KNEE_AT_BEST = 0.85
#: The window of the recent peak of executions to run (``past_knee_at_peak``).
PEAK_WINDOW_S = 600.0


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


@register_policy(
    "tidal",
    "rate model of production vs consumption, decided on every event: "
    "partial lending in prefix order, waterlevel-safe by default, measured "
    "over-subscription, hysteresis; args horizon_s, dwell_s, low_batches, "
    "high_batches, min_train_cells, tau_s, max_queued, max_wait_s, start_cells",
)
class TidalPolicy:
    name = "tidal"
    mechanics = TIDAL
    waterlevel_safe = True
    #: the controller accepts a move marked ``Decision.oversubscribe`` (the rule above)
    may_oversubscribe = True

    def __init__(
        self,
        horizon_s: float = HORIZON_S,
        dwell_s: float = 20.0,
        low_batches: float = 2.0,
        high_batches: float = 0.0,
        min_train_cells: int = 1,
        tau_s: float = 600.0,
        max_queued: int = MAX_QUEUED,
        max_wait_s: float = MAX_WAIT_S,
        start_cells: int = 0,
    ) -> None:
        for key, val in (
            ("horizon_s", horizon_s),
            ("dwell_s", dwell_s),
            ("tau_s", tau_s),
            ("low_batches", low_batches),
            ("high_batches", high_batches),
            ("max_wait_s", max_wait_s),
        ):
            if isinstance(val, bool) or not isinstance(val, int | float) or val < 0:
                raise ConfigError(f"policy.args.{key}", f"must be a number >= 0, got {val!r}")
        for key, num in (
            ("min_train_cells", min_train_cells),
            ("max_queued", max_queued),
            ("start_cells", start_cells),
        ):
            if isinstance(num, bool) or not isinstance(num, int) or num < 0:
                raise ConfigError(
                    f"policy.args.{key}", f"must be a non-negative integer, got {num!r}"
                )
        if tau_s <= 0:
            raise ConfigError("policy.args.tau_s", "must be > 0")
        self.horizon_s = float(horizon_s)
        self.dwell_s = float(dwell_s)
        self.low_batches = float(low_batches)
        self.high_batches = float(high_batches)
        self.min_train_cells = min_train_cells
        self.start_cells = start_cells
        self.max_queued = max_queued
        self.max_wait_s = float(max_wait_s)
        self.finishes = RateEstimate(tau_s)  # executions finished per running-execution-second
        #: when the last over-subscribed move was decided, while executions may still wait
        self.waiting_since_s: float | None = None
        self.production = RateEstimate(tau_s)  # groups per running-execution-second
        self.consumption = RateEstimate(tau_s)  # groups per training-GPU-second
        self._last: tuple[float, int, int, int, int, int, int] | None = None
        # The decode meter (``Observation.decode_meter``): per-sequence speed over a short
        # window, its best (no contention), and the throughput per rollout GPU the engines
        # gave while past their knee (sequences slower than the best): their capacity.
        self.seq_speed = RateEstimate(KNEE_TAU_S)  # tokens per sequence-second
        self.gpu_speed = RateEstimate(KNEE_TAU_S)  # tokens per rollout-GPU-second
        self.demand = RateEstimate(tau_s)  # tokens per running-execution-second
        self.best_seq_speed = 0.0
        self.best_gpu_speed = 0.0
        self.gpu_capacity = 0.0  # tokens per rollout-GPU-second at the knee (0: not seen)
        self._meter: tuple[float, int, int, int, int] | None = None
        self._todo: deque[tuple[float, int]] = deque()  # (time, executions to run), a window
        self._last_move_s = -math.inf
        self._move_started_s: float | None = None
        self.move_s = 0.0  # the last move to training's duration, measured
        self._last_action = Action.HOLD
        #: the last decision's dispatch hold, logged with the state (the controller reads it
        #: from the ``Decision``)
        self.dispatch_limit: int | None = None

    # ---------------------------------------------------------------- protocol
    def initial_prefix(self, cells: tuple[CellView, ...]) -> int:
        return min(self.start_cells, len(cells))

    def state(self) -> dict[str, Any]:
        p, c = self.production.rate, self.consumption.rate
        held = {} if self.dispatch_limit is None else {"dispatch_limit": self.dispatch_limit}
        if self.waiting_since_s is not None:
            q = self.finishes.rate
            held["oversubscribed_since_s"] = round(self.waiting_since_s, 6)
            held["q_finished_per_exec_s"] = None if q is None else round(q, 9)
        return {
            **held,
            "p_groups_per_exec_s": None if p is None else round(p, 9),
            "c_groups_per_gpu_s": None if c is None else round(c, 9),
            "last_move_s": None if self._last_move_s == -math.inf else round(self._last_move_s, 6),
            **({"last_lend_took_s": round(self.move_s, 6)} if self.move_s else {}),
        }

    def decide(self, obs: Observation) -> Decision:
        self._observe(obs)
        if obs.in_flight:
            return Decision.hold("transition in flight")
        p, c = self.production.rate, self.consumption.rate
        q = self.finishes.rate
        situation = Situation(
            obs,
            0.0 if p is None else p,
            0.0 if c is None else c,
            p is not None and c is not None,
            _training_gpus(obs),
            self._last_action,
            self._last_move_s,
            0.0 if q is None else q,
            self.waiting_since_s,
            self.move_s,
            _rollout_gpus(obs),
            self.servable(1),
            self._todo_peak(obs),
        )
        d = rules.decide(situation, self)
        if d.action is Action.TO_TRAINING:
            self._move_started_s = obs.now_s
        self.dispatch_limit = d.dispatch_limit
        if d.oversubscribe:
            self.waiting_since_s = obs.now_s
        if d.action is not Action.HOLD:
            self._last_move_s = obs.now_s
            self._last_action = d.action
        return d

    # ---------------------------------------------------------------- internals
    def _observe(self, obs: Observation) -> None:
        self._observe_meter(obs)
        now = obs.now_s
        if self._move_started_s is not None and not obs.in_flight:
            self.move_s = now - self._move_started_s  # the lend finished (first event after)
            self._move_started_s = None
        # Groups taken by the trainer so far: whole steps plus this step's claimed groups (a
        # streaming trainer claims them as it processes them).
        taken = obs.trainer_step * obs.batch_groups + (obs.batch_groups - obs.supply.needed)
        if not obs.in_flight and obs.running <= obs.rollout_capacity:
            self.waiting_since_s = None  # every launched execution has a slot again
        cur = (
            now,
            obs.groups_generated,
            taken,
            obs.running,
            _training_gpus(obs),
            obs.ready_groups,
            obs.executions_finished,
        )
        if self._last is None:
            self._last = cur
            return
        t0, gen0, taken0, run0, gpus0, ready0, fin0 = self._last
        dt = now - t0
        if dt < 0:
            return
        self._last = cur
        self.production.add(obs.groups_generated - gen0, run0 * dt, dt)
        self.finishes.add(max(0, obs.executions_finished - fin0), run0 * dt, dt)
        consumed = max(0, taken - taken0)
        # Trainer exposure counts only while it had data (a starving trainer says nothing
        # about its speed).
        exposure = gpus0 * dt if ready0 > 0 or consumed > 0 else 0.0
        self.consumption.add(consumed, exposure, dt)

    def _observe_meter(self, obs: Observation) -> None:
        if obs.decode_meter is None:
            return
        tokens, seq_s = obs.decode_meter
        cur = (obs.now_s, tokens, seq_s, _rollout_gpus(obs), obs.running)
        last, self._meter = self._meter, cur
        if last is None or obs.in_flight:
            return
        t0, tok0, seq0, gpus0, run0 = last
        dt = obs.now_s - t0
        if dt <= 0 or gpus0 != cur[3]:
            return  # a move ended in between: the window's GPUs are not known
        d_tok, d_seq = tokens - tok0, seq_s - seq0
        self.seq_speed.add(d_tok, d_seq, dt)
        self.gpu_speed.add(d_tok, gpus0 * dt, dt)
        self.demand.add(d_tok, run0 * dt, dt)
        speed, per_gpu = self.seq_speed.rate, self.gpu_speed.rate
        if speed is None or per_gpu is None or self.seq_speed.exposure < KNEE_MIN_SEQ_S:
            return
        self.best_seq_speed = max(self.best_seq_speed, speed)
        self.best_gpu_speed = max(self.best_gpu_speed, per_gpu)
        # Past the knee: sequences slower than their best while the GPUs make about their
        # best (slower sequences on GPUs making less are longer contexts, not contention).
        if (
            speed < KNEE_SLOWDOWN * self.best_seq_speed
            and per_gpu >= KNEE_AT_BEST * self.best_gpu_speed
        ):
            self.gpu_capacity = max(self.gpu_capacity, per_gpu)

    def _todo_peak(self, obs: Observation) -> int:
        """The most executions to run over the last ``PEAK_WINDOW_S``: the load the next
        version brings back after a tail."""
        todo = obs.waterlevel + obs.pending_dispatch
        w = self._todo
        while w and w[-1][1] <= todo:
            w.pop()  # a monotone window: older values no larger than the new one never win
        w.append((obs.now_s, todo))
        while w[0][0] < obs.now_s - PEAK_WINDOW_S:
            w.popleft()
        return w[0][1]

    def servable(self, gpus: int) -> float:
        """Executions ``gpus`` rollout GPUs serve before their engines pass the knee, at the
        measured tokens per running execution (inf: the knee is not seen yet)."""
        d = self.demand.rate
        if self.gpu_capacity <= 0 or d is None:
            return math.inf
        return self.gpu_capacity * gpus / d


_GPUS_CACHE: dict[int, tuple[tuple[CellView, ...], int]] = {}


def _rollout_gpus(obs: Observation) -> int:
    return obs.standalone_gpus + sum(c.gpus for c in obs.cells if c.role is Role.ROLLOUT)


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
