"""The tidal policy's rules, one function each, in the order ``TidalPolicy.decide`` asks them.

In: a ``Situation`` (the observation plus the numbers every rule reads: measured rates,
training GPUs, queue, executions still to run, capacity, the last move) and the policy's
knobs (``Knobs``: horizon, dwell, low/high batches, the training floor, the
over-subscription caps). Out: a ``Decision``
when the rule settles the event, None when it leaves it to the next rule. Rules are pure:
the policy records a move (for hysteresis) after a rule returns one. The rule text is the
module docstring of ``tidal.control.tidal_policy``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from tidal.control.policy import Action, CellView, Decision, Observation
from tidal.control.waterlevel import capacity_after_move
from tidal.types import Role

#: a return past the knee must raise the split's throughput by this fraction (hysteresis;
#: 0.05 and 0.10 measured alike)
KNEE_GAIN = 0.05


class Knobs(Protocol):
    """The policy arguments the rules read (``TidalPolicy`` has them)."""

    horizon_s: float
    dwell_s: float
    low_batches: float
    high_batches: float
    min_train_cells: int
    max_queued: int
    max_wait_s: float


@dataclass(frozen=True)
class Situation:
    """One event as the rules see it. Rates are groups per running-execution-second (``p``)
    and per training-GPU-second (``c``); an unknown rate is 0 with ``rates_known`` False."""

    obs: Observation
    p: float
    c: float
    rates_known: bool
    gpus: int  # training GPUs
    last_action: Action = Action.HOLD
    last_move_s: float = -math.inf
    q: float = 0.0  # executions finished per running-execution-second (0: unknown)
    #: when the over-subscribed move executions still wait since was decided (None: none)
    oversubscribed_since_s: float | None = None
    move_s: float = 0.0  # how long the policy's last move to training took (0: none yet)
    rollout_gpus: int = 0
    #: executions one rollout GPU serves before its engine passes the throughput knee, at the
    #: measured tokens per execution (inf: no knee seen, or no decode meter)
    per_gpu: float = math.inf
    todo_peak: int = 0  # the most executions to run over the last window

    def served(self, slots: int, gpus: int) -> float:
        """Executions ``slots`` slots on ``gpus`` rollout GPUs run at full speed."""
        if self.per_gpu == math.inf:
            return float(slots)
        return min(float(slots), self.per_gpu * max(0, gpus))

    @property
    def displaced(self) -> int:
        """Launched executions without a slot: what an over-subscribed move left waiting."""
        return max(0, self.obs.running - self.obs.rollout_capacity)

    def oversubscribed(self, k: Knobs) -> bool:
        """An over-subscription is under way and within its wait cap."""
        since = self.oversubscribed_since_s
        return since is not None and self.obs.now_s - since <= k.max_wait_s

    @property
    def queue(self) -> int:
        return self.obs.ready_groups

    @property
    def todo(self) -> int:
        """Executions to run: the waterlevel plus what is still to be dispatched."""
        return self.obs.waterlevel + self.obs.pending_dispatch

    @property
    def batch(self) -> int:
        return self.obs.batch_groups

    @property
    def cap(self) -> int:
        return self.obs.rollout_capacity

    @property
    def backlog(self) -> bool:
        """Two batches or more ready: production is ahead without waiting for the rates."""
        return self.queue >= 2 * self.batch

    def dwelling(self, action: Action, dwell_s: float) -> bool:
        """Hysteresis: a move against the direction of the last one waits ``dwell_s``."""
        return action is not self.last_action and self.obs.now_s - self.last_move_s < dwell_s


def training_slots(obs: Observation) -> int:
    return sum(c.slots for c in obs.cells if c.role is Role.TRAINING)


def measuring(s: Situation) -> Decision | None:
    """Hold until both rates are known, unless one side is empty or a backlog shows the way."""
    if not s.rates_known and s.gpus > 0 and s.cap > 0 and not s.backlog:
        return Decision.hold("measuring rates")
    return None


def train_floor(s: Situation, k: Knobs) -> int:
    """Training cells that never return: ``min_train_cells``, none when no rollout capacity is
    left or the trainer starves (not one batch ready within the horizon with every slot)."""
    if s.cap <= 0:
        return 0
    if s.obs.trainer_step == 0 and s.obs.groups_generated < s.batch:
        # Before the first batch has completed, the production rate counts only the fastest
        # groups over every execution's exposure (biased low): no starvation verdict from it.
        return k.min_train_cells
    reach = s.queue + s.p * min(s.cap + training_slots(s.obs), s.todo) * k.horizon_s
    if s.gpus > 0 and s.queue < s.batch and reach < s.batch:
        return 0
    return k.min_train_cells


def return_block(s: Situation, movable: list[CellView]) -> tuple[int, ...]:
    """The last training cells, the smallest block that balances the rates or covers the
    missing slots (at most all of ``movable``)."""
    slots = lent = 0
    block: list[CellView] = []
    for v in reversed(movable):
        block.append(v)
        slots += v.slots
        lent += v.gpus
        drift = s.p * min(s.cap + slots, s.todo) - s.c * (s.gpus - lent)
        if s.cap + slots >= s.todo or drift >= 0:
            break
    return tuple(sorted(v.index for v in block))


def throughput(s: Situation, lent: int, slots: int, todo: int | None = None) -> float:
    """Groups per second the split makes with ``lent`` GPUs (and ``slots`` slots) moved from
    training to rollout (negative: to training) and ``todo`` executions to run (default: the
    current ones): the smaller of production (executions the rollout engines run at full
    speed) and consumption."""
    served = s.served(s.cap + slots, s.rollout_gpus + lent)
    return min(s.p * min(served, s.todo if todo is None else todo), s.c * (s.gpus - lent))


def gains(s: Situation, block: tuple[int, ...]) -> bool:
    """Returning ``block`` raises the split's throughput (a return that makes less only
    buys a lend back: two switches for nothing)."""
    cells = [c for c in s.obs.cells if c.index in block]
    return throughput(s, sum(c.gpus for c in cells), sum(c.slots for c in cells)) > throughput(
        s, 0, 0
    )


def knee_block(s: Situation, movable: list[CellView]) -> tuple[int, ...]:
    """The last training cells whose return raises the split's throughput the most, by more
    than ``KNEE_GAIN`` (none: no block does)."""
    best, best_block = throughput(s, 0, 0) * (1.0 + KNEE_GAIN), ()
    slots = lent = 0
    block: list[int] = []
    for v in reversed(movable):
        block.append(v.index)
        slots += v.slots
        lent += v.gpus
        t = throughput(s, lent, slots)
        if t > best:
            best, best_block = t, tuple(sorted(block))
    return best_block


def return_cells(s: Situation, k: Knobs) -> Decision | None:
    """Return training cells when rollout is short of slots and the queue projected over the
    horizon falls below ``low_batches`` batches (or nothing rolls out at all); not while an
    over-subscription is under way within its wait cap (``wait_capped`` ends it). With slots
    to spare but the engines past their knee, return the block that raises the split's
    throughput most (``knee_block``), on the same queue condition."""
    floor = train_floor(s, k)
    obs = s.obs
    movable = [v for v in obs.cells[floor : obs.prefix_len] if v.role is Role.TRAINING]
    served = s.served(s.cap, s.rollout_gpus)
    if not movable or len(movable) != obs.prefix_len - floor or s.todo <= served:
        return None
    if s.oversubscribed(k):
        return None  # the short slots are the over-subscription's, priced when it was decided
    drift = s.p * min(served, s.todo) - s.c * s.gpus
    projected = s.queue + drift * k.horizon_s
    if projected >= k.low_batches * s.batch and s.cap != 0:
        return None
    knee = s.todo <= s.cap  # slots enough: the engines' throughput is what is short
    block = knee_block(s, movable) if knee else return_block(s, movable)
    if not block or (not knee and s.cap != 0 and s.queue >= s.batch and not gains(s, block)):
        return None
    if s.dwelling(Action.TO_ROLLOUT, k.dwell_s):
        return Decision.hold("dwell before reversing the last move")
    why = (
        f"engines at their knee ({s.todo} executions to run, {served:.0f} at full speed)"
        if knee
        else f"rollout short: {s.todo} executions to run > {s.cap} slots"
    )
    return Decision(
        Action.TO_ROLLOUT,
        block,
        f"{why}; queue {s.queue} -> {projected:.1f} groups in "
        f"{k.horizon_s:g}s < {k.low_batches * s.batch:g}",
    )


def idle_trainer(s: Situation, k: Knobs, nxt: CellView, after: int) -> Decision | None:
    """Nothing trains while a whole batch is ready (supply held): lend the next cell
    (over-subscribed if the rate model says so), else hold dispatch at the capacity after the
    move while the waterlevel is in the way."""
    obs = s.obs
    if s.gpus != 0 or s.queue < s.batch or not obs.supply.ok:
        return None
    if after >= obs.waterlevel:
        return Decision(
            Action.TO_TRAINING, (nxt.index,), f"nothing trains and {s.queue} groups are ready"
        )
    over = oversubscribe(s, k, nxt, after)
    if over is not None:
        return over
    if after > 0:
        return Decision.hold(
            f"holding dispatch at {after} executions so cell {nxt.index} "
            f"can train a ready batch (waterlevel {obs.waterlevel})",
            dispatch_limit=after,
        )
    return None


@dataclass(frozen=True)
class Oversubscription:
    """The rate model's forecast for one over-subscribed move: ``excess`` executions wait for
    a slot; the last is admitted after ``wait_s``; the waiting costs ``cost_groups`` of
    production and the cell buys ``benefit_groups`` of training in that time."""

    excess: int
    wait_s: float
    cost_groups: float
    benefit_groups: float


def forecast(s: Situation, nxt: CellView, after: int) -> Oversubscription | None:
    """Executions past the capacity after the move wait; running ones finish at ``q`` per
    running-execution-second, so the ``after`` slots free at ``q * after`` per second and the
    last waits ``T = excess / (q * after)``. Waiting falls linearly: ``excess * T / 2``
    execution-seconds, which would have produced ``p`` groups each. The cell trains ``T``
    earlier: ``c * gpus * T`` groups, no more than the queue and production leave for it."""
    excess = s.obs.waterlevel - after
    if excess <= 0 or after <= 0 or s.q <= 0 or not s.rates_known:
        return None
    wait_s = excess / (s.q * after)
    cost = s.p * excess * wait_s / 2
    spare = s.queue + (s.p * after - s.c * s.gpus) * wait_s
    benefit = min(s.c * nxt.gpus * wait_s, max(0.0, spare))
    return Oversubscription(excess, wait_s, cost, benefit)


def oversubscribe(s: Situation, k: Knobs, nxt: CellView, after: int) -> Decision | None:
    """Over-subscription (decision 2): lend the next cell although the capacity after the move
    is below the waterlevel, when the forecast's queueing costs less than the training it buys,
    within the caps (``max_queued`` executions waiting, ``max_wait_s`` for the last), with held
    supply and not against the last move within ``dwell_s``."""
    f = forecast(s, nxt, after)
    if f is None or not s.obs.supply.ok or f.excess > k.max_queued or f.wait_s > k.max_wait_s:
        return None
    if f.benefit_groups <= f.cost_groups:
        return None
    if s.queue < s.c * (s.gpus + nxt.gpus) * f.wait_s:
        return None  # the trainer would need the groups the waiting executions delay
    if s.dwelling(Action.TO_TRAINING, k.dwell_s):
        return None
    return Decision(
        Action.TO_TRAINING,
        (nxt.index,),
        f"over-subscribe: {f.excess} executions wait for a slot (capacity after {after} < "
        f"waterlevel {s.obs.waterlevel}), last admitted in {f.wait_s:.0f}s; queueing costs "
        f"{f.cost_groups:.2f} groups < {f.benefit_groups:.2f} groups of training",
        oversubscribe=True,
    )


def wait_capped(s: Situation, k: Knobs) -> Decision | None:
    """Executions displaced by an over-subscribed move have waited longer than ``max_wait_s``
    (since the move): the last training cell returns, so the oldest waiting are admitted."""
    obs, since = s.obs, s.oversubscribed_since_s
    if since is None or obs.now_s - since <= k.max_wait_s or s.displaced == 0:
        return None
    last = obs.last_training()
    if last is None or last.role is not Role.TRAINING:
        return None
    return Decision(
        Action.TO_ROLLOUT,
        (last.index,),
        f"over-subscription cap: executions have waited {obs.now_s - since:.0f}s > "
        f"{k.max_wait_s:g}s for a slot ({s.displaced} without one)",
    )


def waterlevel_blocked(
    s: Situation, k: Knobs, nxt: CellView, after: int, drift_after: float
) -> Decision | None:
    """The move is not waterlevel-safe: over-subscribe if the rate model says so; else hold,
    with a dispatch hold at the capacity after the move when production still outpaces
    consumption with one more training cell."""
    obs = s.obs
    if after >= obs.waterlevel:
        return None
    over = oversubscribe(s, k, nxt, after)
    if over is not None:
        return over
    if drift_after >= 0 and s.p > 0 and obs.supply.ok and after > 0:
        return Decision.hold(
            f"holding dispatch at {after} executions so cell {nxt.index} "
            f"can train (waterlevel {obs.waterlevel})",
            dispatch_limit=after,
        )
    return Decision.hold(f"capacity after move {after} < waterlevel {obs.waterlevel}")


def past_knee_at_peak(s: Situation, nxt: CellView, after: int) -> Decision | None:
    """At the recent peak load the engines left would pass their knee and the split make
    less than now: the lend would come back when the next version dispatches."""
    if s.per_gpu == math.inf or not s.rates_known or s.backlog:
        return None
    now = throughput(s, 0, 0, s.todo_peak)
    then = throughput(s, -nxt.gpus, after - s.cap, s.todo_peak)
    if then >= now:
        return None
    return Decision.hold(
        f"at the recent peak ({s.todo_peak} executions) the engines left pass their knee "
        f"({s.per_gpu * (s.rollout_gpus - nxt.gpus):.0f}): {then:.3f} < {now:.3f} groups/s"
    )


def rollout_needs_slots(
    s: Situation, after: int, drift_after: float, served: float | None = None
) -> Decision | None:
    """Rollout needs the lent cell (its slots, or its throughput: ``served``, fewer, where the
    engines left would pass their knee) and the queue would drain (no backlog)."""
    served = after if served is None else served
    if s.todo > served and drift_after < 0 and not s.backlog:
        what = "slots" if served >= after else f"throughput (knee at {served:.0f})"
        return Decision.hold(
            f"rollout needs the {what}: {s.todo} executions to run > {after} "
            f"and the queue would drain ({drift_after:.4f} groups/s)"
        )
    return None


def supply_not_held(s: Situation) -> Decision | None:
    if not s.obs.supply.ok:
        return Decision.hold(f"supply {s.obs.supply.supply} not ok")
    return None


def queue_too_low(s: Situation, k: Knobs, projected: float) -> Decision | None:
    """The lent cell would have no data: the queue projected over ``dwell_s`` under the new
    split stays below ``high_batches`` batches."""
    if projected < k.high_batches * s.batch:
        return Decision.hold(
            f"projected queue {projected:.1f} < {k.high_batches * s.batch:g} with one more cell"
        )
    return None


def tail_lend_idle(s: Situation, after: float) -> Decision | None:
    """A lend on spare slots (everything still to run fits without the cell) helps only while
    the trainer is the bottleneck: the groups the version still needs take the current
    training cells longer than the remaining executions take to produce them, by more than the
    move costs. Else the lent cell would wait for data and return when the next version
    starts dispatching (two switches for nothing)."""
    obs = s.obs
    if s.todo > after or s.backlog or s.gpus == 0 or not s.rates_known or s.c <= 0:
        return None
    left_steps = max(0, obs.updates_per_burst - obs.steps_in_version - 1)
    need = obs.supply.needed + left_steps * s.batch  # groups the version still trains
    train_s = need / (s.c * s.gpus)
    missing = max(0, need - s.queue)
    produce = s.p * obs.running
    prod_s = 0.0 if missing == 0 else (math.inf if produce <= 0 else missing / produce)
    if train_s > prod_s + s.move_s:
        return None
    return Decision.hold(
        f"spare slots but the trainer waits for data: {need} groups take {train_s:.0f}s to "
        f"train, {prod_s:.0f}s to produce (+{s.move_s:.0f}s move)"
    )


def lend_next(s: Situation, k: Knobs) -> Decision:
    """Lend the next cell of the order to training when rollout does not need its slots, the
    move is waterlevel-safe and the trainer has data; else hold, saying why."""
    nxt = s.obs.next_to_train()
    if nxt is None or nxt.role is not Role.ROLLOUT:
        return Decision.hold("balanced")
    after = capacity_after_move(s.obs, nxt)
    served = s.served(after, s.rollout_gpus - nxt.gpus)
    drift_after = s.p * min(served, s.todo) - s.c * (s.gpus + nxt.gpus)
    projected = s.queue + drift_after * k.dwell_s
    checks: tuple[Callable[[], Decision | None], ...] = (
        lambda: idle_trainer(s, k, nxt, after),
        lambda: waterlevel_blocked(s, k, nxt, after, drift_after),
        lambda: rollout_needs_slots(s, after, drift_after, served),
        lambda: past_knee_at_peak(s, nxt, after),
        lambda: tail_lend_idle(s, served),
        lambda: supply_not_held(s),
        lambda: queue_too_low(s, k, projected),
    )
    for check in checks:
        d = check()
        if d is not None:
            return d
    if s.dwelling(Action.TO_TRAINING, k.dwell_s):
        return Decision.hold("dwell before reversing the last move")
    why = (
        f"rollout has spare slots ({s.todo} executions to run <= {served:.0f})"
        if s.todo <= served
        else f"the queue still grows with one more cell ({drift_after:.4f} groups/s)"
    )
    return Decision(
        Action.TO_TRAINING,
        (nxt.index,),
        f"{why}; queue {s.queue} -> {projected:.1f} groups in {k.dwell_s:g}s",
    )


def decide(s: Situation, k: Knobs) -> Decision:
    """The rules in order: the wait cap, measuring, returning cells, lending the next one."""
    return wait_capped(s, k) or measuring(s) or return_cells(s, k) or lend_next(s, k)
