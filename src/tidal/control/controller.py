"""The controller: events in, transition plans out.

In: control-plane events (``tidal.types``) from the runtime or the simulator. Out: transition
plans, executed one step at a time by an ``Actuator`` that acknowledges each step back as a
``TransitionStepDone`` event; a decision log line for every decision with its inputs.

Keeps invariants 1-3 (DESIGN.md): the ledger owns the counters; at most one plan is in flight;
a plan moves a contiguous block at the edge of the training prefix; for a ``waterlevel_safe``
policy a move to training is a single cell with capacity after the move >= waterlevel and the
ready supply held — a policy asking for anything else raises ``InvariantViolation``. The one
exception is a move marked ``Decision.oversubscribe`` from a policy that declares
``may_oversubscribe`` (tidal's over-subscription rule): capacity after it may be below the
waterlevel (still one cell, supply held); the waterlevel policy declares no such thing.
Each decision is checked and recorded by ``decisions``; the settings are ``ControllerSettings``.
Events may be delivered re-entrantly (an actuator acknowledging inside ``execute``): they are
queued and processed in order.

Over 500 lines since the tree took ``ruff format``'s one-argument-per-line style (482 before):
the reconcile loop, its event queue and the plan executor share one state machine.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from tidal.clock import Clock
from tidal.control import decisions
from tidal.control.cells import CellSet
from tidal.control.controller_settings import ControllerSettings
from tidal.control.decision_log import DecisionLog
from tidal.control.ledger import Ledger
from tidal.control.metrics import RoleTimeline, VerlMetrics
from tidal.control.plans import PlanStep, TransitionPlan, build_plan
from tidal.control.policy import Action, CellView, Decision, Observation, PlanStyle, Policy
from tidal.control.supply import SupplyTracker
from tidal.errors import ConfigError
from tidal.types import (
    BatchShort,
    BurstStarted,
    Direction,
    EngineCapacityChanged,
    Event,
    ExecutionClosed,
    ExecutionDispatched,
    ExecutionLaunched,
    ExecutionScored,
    GroupsAssigned,
    RequestRetried,
    Role,
    Tick,
    TrainerReady,
    TrainerStepDone,
    TransitionStepDone,
    WeightSyncDone,
)

log = logging.getLogger(__name__)


class Actuator(Protocol):
    """Executes plan steps. Must eventually deliver ``TransitionStepDone`` for each step."""

    def execute(self, plan: TransitionPlan, step: PlanStep) -> None: ...

    def abort(self, plan: TransitionPlan, failed: PlanStep, error: str) -> None: ...


@dataclass
class _InFlight:
    plan: TransitionPlan
    step: int
    issued_s: float
    attempts: int = 1


class Controller:
    def __init__(
        self,
        cells: CellSet,
        policy: Policy,
        clock: Clock,
        actuator: Actuator,
        settings: ControllerSettings,
        log_: DecisionLog | None = None,
        initial_prefix: int | None = None,
    ) -> None:
        self.cells = cells
        self.policy = policy
        self.clock = clock
        self.actuator = actuator
        self.settings = settings
        self.log = log_ or DecisionLog()
        self.ledger = Ledger()
        #: the engines' cumulative (tokens decoded, sequence-seconds), for
        #: ``Observation.decode_meter``: the runtime sets it to the proxy's counts, the
        #: simulator to its engines'
        self.decode_meter: Callable[[], tuple[float, float]] | None = None
        self.supply = SupplyTracker(
            settings.batch_groups, settings.supply_fraction, settings.supply_hold_s
        )
        now = clock.now()
        self._views: tuple[CellView, ...] | None = None
        self._views_roles: tuple[Role, ...] = ()
        n = policy.initial_prefix(self._cell_views()) if initial_prefix is None else initial_prefix
        cells.reset_roles(n)
        if getattr(policy, "requires_rollout_at_start", False) and cells.rollout_capacity == 0:
            # Every cell starts training and nothing else serves: the waterlevel could never
            # fall and no burst would ever end. Refuse instead of deadlocking.
            raise ConfigError(
                "cluster",
                f"policy {policy.name!r} would start with no rollout "
                "capacity (every cell hybrid, no standalone engine); use elastic "
                "cells or add standalone engines",
            )
        self.timeline = RoleTimeline(cells.roles(), now)
        self.metrics = VerlMetrics(
            hybrid_gpus=sum(c.gpus for c in cells.cells),
            standalone_gpus=sum(s.gpus for s in cells.standalone.values()),
            budget_groups=settings.max_concurrency,
            start_s=now,
        )
        self._sync_end_pending = False
        self.version = 0
        self.trainer_step = 0
        self.steps_in_version = 0
        self.trainer_waiting = False
        self.assigned_in_batch = 0
        self.batch_missing = 0  # groups the current batch will not get (``BatchShort``)
        self.bursts_ended = 0
        self.bursts_started = 0
        self._announced: dict[int, int] = {}
        self._expect_next_burst = False
        self._cycle_waits: list[float] = []
        self._cycle_queue: list[int] = []
        self._cycle_stale = False
        self.last_activate_s = 0.0
        self.last_deactivate_s = 0.0
        self.switch_cycle = -1
        self.inflight: _InFlight | None = None
        self._next_plan_id = 1
        self.plans_done: list[tuple[TransitionPlan, float]] = []
        self.plans_aborted = 0
        self._backoff_until = float("-inf")
        self.stale_acks = 0
        self._queue: deque[Event] = deque()
        self._busy = False
        self.events_handled = 0
        self._dispatch_limit: int | None = None  # the last decision's (None: no limit)

    # ------------------------------------------------------------------ input
    def handle(self, event: Event) -> None:
        self._queue.append(event)
        if self._busy:
            return
        self._busy = True
        try:
            while self._queue:
                ev = self._queue.popleft()
                self._apply(ev)
                self.events_handled += 1
                self._record_rollout(ev.t_s)
                self._consult(ev)
                if self._sync_end_pending and not self._activating():
                    self._end_sync(ev.t_s)
        finally:
            self._busy = False

    def _apply(self, ev: Event) -> None:
        """The event's effect on the ledger, the counters and verl's metrics (one handler per
        event type; an event type without one changes nothing here)."""
        handler = _HANDLERS.get(type(ev))
        if handler is not None:
            getattr(self, handler)(ev)

    def _on_dispatched(self, ev: ExecutionDispatched) -> None:
        self.metrics.group_size = ev.group_size  # verl counts prompt groups
        self.ledger.dispatch(ev.execution_id, ev.group_id, ev.group_size, ev.burst)

    def _on_launched(self, ev: ExecutionLaunched) -> None:
        lg = self.ledger
        if lg.launch(ev.execution_id):
            group = lg.groups[lg.executions[ev.execution_id].group_id]
            self.metrics.launched(group.group_id, group.size)

    def _on_closed(self, ev: ExecutionClosed) -> None:
        lg = self.ledger
        before = lg.groups_ready_total
        if lg.close(ev.execution_id, ev.reason, ev.reward):
            group = lg.groups[lg.executions[ev.execution_id].group_id]
            self.metrics.closed(group.group_id, group.size)
        self._count_generated(before)

    def _on_scored(self, ev: ExecutionScored) -> None:
        before = self.ledger.groups_ready_total
        self.ledger.score(ev.execution_id, ev.reward)
        self._count_generated(before)

    def _on_retried(self, ev: RequestRetried) -> None:
        self.ledger.retry(ev.execution_id)

    def _on_assigned(self, ev: GroupsAssigned) -> None:
        self.ledger.assign(ev.group_ids)
        self.assigned_in_batch += len(ev.group_ids)

    def _on_burst_started(self, ev: BurstStarted) -> None:
        self._announce(ev.burst, ev.quota_executions)
        self.bursts_started += 1
        self._expect_next_burst = False

    def _on_trainer_ready(self, ev: TrainerReady) -> None:
        self.trainer_waiting = True
        self.metrics.step_begin(ev.t_s)

    def _on_batch_short(self, ev: BatchShort) -> None:
        self.batch_missing = max(0, self.supply.batch_groups - ev.groups)

    def _on_weights(self, ev: WeightSyncDone) -> None:
        self.version = max(self.version, ev.version)
        self.steps_in_version = 0
        self.metrics.sync(self.version)
        self._sync_end_pending = True  # after the activation the policy may start
        self._cycle_stale = True
        self.log.write(
            {
                "type": "weights_published",
                "t": round(ev.t_s, 6),
                "version": ev.version,
                "duration_s": round(ev.duration_s, 6),
                **({"transports": dict(ev.transports)} if ev.transports else {}),
                **(ev.detail or {}),
            }
        )

    def _on_capacity(self, ev: EngineCapacityChanged) -> None:
        self.cells.set_standalone(ev.engine_id, ev.slots)

    def _on_tick(self, ev: Tick) -> None:
        self._check_step_timeout(ev.t_s)

    def _announce(self, burst: int, quota: int) -> None:
        """A new burst's quota supersedes what is left of earlier ones: a dispatcher serves one
        burst at a time, and a version's unused budget is forfeited when the next one starts
        (the simulator's on-demand and paced dispatchers; the runtime tags every dispatch with
        the current burst). Counting the remainder as pending would hold every waterlevel-safe move
        forever: ``pending_dispatch`` counts only what will still be dispatched."""
        for b in [b for b in self._announced if b < burst]:
            del self._announced[b]
        self._announced[burst] = quota

    def _count_generated(self, before: int) -> None:
        for _ in range(self.ledger.groups_ready_total - before):
            self.metrics.generated()

    def _trainer_step_done(self, ev: TrainerStepDone) -> None:
        if self._cycle_stale:
            self._cycle_waits, self._cycle_queue, self._cycle_stale = [], [], False
        self.trainer_waiting = False
        self.trainer_step = max(self.trainer_step, ev.step + 1)
        self.steps_in_version += 1
        self.assigned_in_batch = self.batch_missing = 0
        self._cycle_waits.append(ev.wait_s)
        self._cycle_queue.append(ev.queue_at_start)
        self.metrics.step_done(
            ev.t_s,
            ev.wait_s,
            ev.compute_s,
            ev.alloc_s,
            ev.final_of_burst,
            self.ledger.ready_unassigned,
        )
        if ev.final_of_burst:
            self.bursts_ended += 1
            total = self.settings.total_bursts
            self._expect_next_burst = total is None or self.bursts_ended < total

    def _record_rollout(self, t_s: float) -> None:
        # verl's rollouter is idle once its budget is spent and nothing is in generation
        idle = self.ledger.waterlevel == 0 and self.pending_dispatch == (
            self.settings.next_burst_quota if self._expect_next_burst else 0
        )
        self.metrics.rollout(t_s, self.cells.rollout_capacity, idle)

    def _activating(self) -> bool:
        fl = self.inflight
        return (
            fl is not None
            and fl.plan.style is PlanStyle.VERL
            and fl.plan.direction is Direction.TO_ROLLOUT
        )

    def _end_sync(self, t_s: float) -> None:
        """verl's sync step ends after the activation that follows it (if any)."""
        self._sync_end_pending = False
        self.metrics.sync_end(t_s, self.ledger.ready_unassigned)

    # ---------------------------------------------------------- observation
    def _cell_views(self) -> tuple[CellView, ...]:
        roles = self.cells.roles()
        if self._views is None or self._views_roles != roles:
            self._views = tuple(
                CellView(c.index, c.slots, c.gpus, c.kind, c.role) for c in self.cells.cells
            )
            self._views_roles = roles
        return self._views

    @property
    def dispatch_limit(self) -> int | None:
        """Executions the waterlevel may reach through new dispatches, as the policy's last
        decision holds it (``Decision.dispatch_limit``; None: no limit). A dispatcher that
        honours it keeps invariant 3 reachable for a move the policy waits for."""
        return self._dispatch_limit

    @property
    def pending_dispatch(self) -> int:
        pending = 0
        for b, q in list(self._announced.items()):
            done = self.ledger.bursts[b].dispatched if b in self.ledger.bursts else 0
            if done >= q:
                del self._announced[b]  # fully dispatched: never pending again
            else:
                pending += q - done
        if self._expect_next_burst:
            pending += self.settings.next_burst_quota
        return pending

    def observation(self, trigger: str) -> Observation:
        lg, now = self.ledger, self.clock.now()
        return Observation(
            now_s=now,
            trigger=trigger,
            cells=self._cell_views(),
            standalone_slots=self.cells.standalone_slots,
            standalone_gpus=self.cells.standalone_gpus,
            rollout_capacity=self.cells.rollout_capacity,
            waterlevel=lg.waterlevel,
            queued=lg.total.queued,
            running=lg.total.running,
            pending_dispatch=self.pending_dispatch,
            supply=self.supply.view(
                now, lg.ready_unassigned, self.assigned_in_batch + self.batch_missing
            ),
            ready_groups=lg.ready_unassigned,
            groups_generated=lg.groups_ready_total,
            batch_groups=self.settings.batch_groups,
            updates_per_burst=self.settings.updates_per_burst,
            trainer_waiting=self.trainer_waiting,
            trainer_step=self.trainer_step,
            steps_in_version=self.steps_in_version,
            version=self.version,
            bursts_ended=self.bursts_ended,
            in_flight=self.inflight is not None,
            cycle_wait_times_s=tuple(self._cycle_waits),
            cycle_queue_at_start=tuple(self._cycle_queue),
            last_activate_duration_s=self.last_activate_s,
            last_deactivate_duration_s=self.last_deactivate_s,
            switch_cycle=self.switch_cycle,
            training_prefix=self.cells.prefix_len,
            executions_finished=lg.total.finished,
            decode_meter=None if self.decode_meter is None else self.decode_meter(),
        )

    # --------------------------------------------------------------- decide
    def _consult(self, ev: Event) -> None:
        obs = self.observation(ev.kind)
        if obs.in_flight:
            return
        if obs.now_s < self._backoff_until:
            # A plan just failed: don't let the policy re-issue it in a tight loop.
            return
        decision = self.policy.decide(obs)
        self._dispatch_limit = decision.dispatch_limit
        if self.log.wants(decision.action.value, decision.reason, self.dispatch_limit):
            self.log.write(
                {"type": "decision", **decisions.record(obs, decision, self.policy, self.cells)}
            )
        if decision.action is not Action.HOLD:
            decisions.check(obs, decision, self.policy, self.cells)
            self._start(decision, obs)

    # ---------------------------------------------------------------- plans
    def _start(self, d: Decision, obs: Observation) -> None:
        src = d.cells[0] if d.action is Action.TO_TRAINING else None
        plan = build_plan(
            self._next_plan_id,
            d,
            obs.now_s,
            destinations=self.cells.destination_order(src),
            version=self.version,
            kv_handoff=self.settings.kv_handoff,
        )
        self._next_plan_id += 1
        moving = (
            Role.MOVING_TO_TRAINING
            if plan.direction is Direction.TO_TRAINING
            else Role.MOVING_TO_ROLLOUT
        )
        for i in plan.cells:
            self.cells.set_role(i, moving)
            self.timeline.change(i, moving, obs.now_s)
        self.inflight = _InFlight(plan, 0, obs.now_s)
        self.log.write({"type": "plan_start", "t": round(obs.now_s, 6), **plan.to_json()})
        log.info(
            "plan %d: %s %s (%s)", plan.plan_id, plan.direction.value, list(plan.cells), plan.reason
        )
        self.actuator.execute(plan, plan.steps[0])

    def _step_done(self, ev: TransitionStepDone) -> None:
        fl = self.inflight
        if fl is None or ev.plan_id != fl.plan.plan_id or ev.step_index != fl.step:
            self.stale_acks += 1
            return
        plan = fl.plan
        if not ev.ok:
            self._step_failed(ev.t_s, ev.error or "step failed")
            return
        self.log.write(
            {
                "type": "step_done",
                "t": round(ev.t_s, 6),
                "plan_id": plan.plan_id,
                "step": plan.steps[fl.step].kind.value,
                "duration_s": round(ev.duration_s, 6),
                **({"detail": ev.detail} if ev.detail else {}),
            }
        )
        if fl.step + 1 < len(plan.steps):
            fl.step += 1
            fl.issued_s = ev.t_s
            fl.attempts = 1
            self.actuator.execute(plan, plan.steps[fl.step])
            return
        self._finish(ev.t_s)

    def _step_failed(self, t_s: float, error: str) -> None:
        fl = self.inflight
        assert fl is not None
        plan, step = fl.plan, fl.plan.steps[fl.step]
        self.log.write(
            {
                "type": "step_failed",
                "t": round(t_s, 6),
                "plan_id": plan.plan_id,
                "step": step.kind.value,
                "attempt": fl.attempts,
                "error": error,
            }
        )
        if fl.attempts <= self.settings.max_step_retries:
            fl.attempts += 1
            fl.issued_s = t_s
            self.actuator.execute(plan, step)
            return
        source = Role.ROLLOUT if plan.direction is Direction.TO_TRAINING else Role.TRAINING
        for i in reversed(plan.cells) if source is Role.ROLLOUT else plan.cells:
            self.cells.set_role(i, source)
            self.timeline.change(i, source, t_s)
        self.inflight = None
        self.plans_aborted += 1
        if self._sync_end_pending:
            self._end_sync(t_s)
        self._backoff_until = t_s + self.settings.abort_backoff_s
        self.log.write(
            {
                "type": "plan_aborted",
                "t": round(t_s, 6),
                "plan_id": plan.plan_id,
                "step": step.kind.value,
                "error": error,
            }
        )
        log.warning("plan %d aborted at %s: %s", plan.plan_id, step.kind.value, error)
        self.actuator.abort(plan, step, error)

    def _check_step_timeout(self, now_s: float) -> None:
        fl = self.inflight
        if fl is not None and now_s - fl.issued_s > self.settings.step_timeout_s:
            self._step_failed(now_s, f"timed out after {self.settings.step_timeout_s:g}s")

    def _finish(self, t_s: float) -> None:
        fl = self.inflight
        assert fl is not None
        plan = fl.plan
        target = Role.TRAINING if plan.direction is Direction.TO_TRAINING else Role.ROLLOUT
        order = plan.cells if target is Role.TRAINING else tuple(reversed(plan.cells))
        for i in order:
            self.cells.set_role(i, target)
            self.timeline.change(i, target, t_s)
        duration = t_s - plan.created_s
        if target is Role.TRAINING:
            self.metrics.moved_to_training(plan.created_s, t_s)
        if plan.style is PlanStyle.VERL:
            if target is Role.ROLLOUT:
                self.last_activate_s = duration
            else:
                self.last_deactivate_s = duration
                self.switch_cycle = self.version
        self.inflight = None
        self.plans_done.append((plan, duration))
        if self._sync_end_pending:
            self._end_sync(t_s)
        self.log.write(
            {
                "type": "plan_done",
                "t": round(t_s, 6),
                "plan_id": plan.plan_id,
                "duration_s": round(duration, 6),
                "roles": self.cells.describe(),
            }
        )

    # -------------------------------------------------------------- summary
    def summary(self) -> dict[str, Any]:
        lg = self.ledger
        to_t = sum(1 for p, _ in self.plans_done if p.direction is Direction.TO_TRAINING)
        return {
            "policy": self.policy.name,
            "switches": len(self.plans_done),
            "switches_to_training": to_t,
            "switches_to_rollout": len(self.plans_done) - to_t,
            "plans_aborted": self.plans_aborted,
            "dispatched": lg.total.dispatched,
            "finished": lg.total.finished,
            "waterlevel": lg.waterlevel,
            "duplicate_closes": lg.duplicate_closes,
            "request_retries": lg.retries,
            "close_reasons": {r.value: n for r, n in lg.close_reasons.items()},
            "groups_ready": lg.groups_ready_total,
            "groups_dropped": lg.groups_dropped,  # settled with < 2 scored members
            "trainer_steps": self.trainer_step,
            "version": self.version,
        }


_HANDLERS: dict[type[Event], str] = {  # event type: the Controller method that applies it
    ExecutionDispatched: "_on_dispatched",
    ExecutionLaunched: "_on_launched",
    ExecutionClosed: "_on_closed",
    ExecutionScored: "_on_scored",
    RequestRetried: "_on_retried",
    GroupsAssigned: "_on_assigned",
    BurstStarted: "_on_burst_started",
    TrainerReady: "_on_trainer_ready",
    BatchShort: "_on_batch_short",
    TrainerStepDone: "_trainer_step_done",
    WeightSyncDone: "_on_weights",
    TransitionStepDone: "_step_done",
    EngineCapacityChanged: "_on_capacity",
    Tick: "_on_tick",
}
