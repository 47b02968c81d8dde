"""The simulator's Actuator: models the cost and effect of each transition-plan step.

In: ``execute(plan, step)`` from the real controller. Out: the step's effect on the simulated
engines (admission, reroutes, aborts, KV handoff, rebalance) and a ``TransitionStepDone`` at the
virtual time the step completes. Steps start from the world's event loop (never inside the
controller's ``handle``), so no event is ever delivered re-entrantly.

Effects (REFERENCE.md §1, §2): cancel_and_retry moves every execution of the source cell to the
destinations in ``step.args["destinations"]`` order (standalone first, then rollout cells in
descending order), paying re-prefill of the context unless the plan has a kv_handoff step (then
the executions wait at the destination until the handoff completes); abort_inflight moves them
least-loaded with re-prefill (verl's partial rollout); rebalance aborts in-flight requests
everywhere once the activated replicas admit, and spreads executions least-loaded; an
add_to_load_balancer step with ``clear_sticky`` (verl V1) spreads the requests in flight over
every replica once the activated replicas admit, without aborting those that stay.
Admission itself follows the cell roles the controller sets (a cell admits only in ROLLOUT).
``sim.step_failure_rate`` injects step failures (seeded) to exercise retries and aborts.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from tidal.control.plans import PlanStep, StepKind, TransitionPlan
from tidal.sim.costs import kv_handoff_s, step_duration_s
from tidal.types import TransitionStepDone

if TYPE_CHECKING:
    from tidal.sim.dispatch import ExecRec
    from tidal.sim.world import World


class SimActuator:
    def __init__(self, world: World) -> None:
        self.w = world
        self._faults = random.Random(world.scenario.seed + 1)
        self.failures = 0
        self.executed: list[tuple[int, StepKind]] = []
        self.aborted: list[tuple[int, StepKind, str]] = []
        self._held: dict[int, list[ExecRec]] = {}  # plan id -> executions awaiting KV

    # ------------------------------------------------------ Actuator protocol
    def execute(self, plan: TransitionPlan, step: PlanStep) -> None:
        self.executed.append((plan.plan_id, step.kind))
        self.w.schedule_step(plan, step)

    def abort(self, plan: TransitionPlan, failed: PlanStep, error: str) -> None:
        self.aborted.append((plan.plan_id, failed.kind, error))
        for ex in self._held.pop(plan.plan_id, []):
            self.w.release_hold(ex, kv=False)

    # --------------------------------------------------------------- effects
    def start(self, plan: TransitionPlan, step: PlanStep) -> None:
        """Applies a step's immediate effect and schedules its acknowledgement."""
        w = self.w
        kind = step.kind
        dur = step_duration_s(kind, w.scenario.costs)
        if kind is StepKind.CANCEL_AND_RETRY:
            kv = any(s.kind is StepKind.KV_HANDOFF for s in plan.steps)
            moved = self._evacuate(step, ordered=True, kv=kv)
            if kv:
                self._held[plan.plan_id] = moved
        elif kind is StepKind.ABORT_INFLIGHT:
            self._evacuate(step, ordered=False, kv=False)
        elif kind is StepKind.KV_HANDOFF:
            held = self._held.get(plan.plan_id, [])
            dur = kv_handoff_s(sum(ex.context_now() for ex in held), w.scenario.costs)
        elif kind is StepKind.REBALANCE:
            w.pending_rebalance = True
        elif kind is StepKind.ADD_TO_LOAD_BALANCER and step.args.get("clear_sticky"):
            w.pending_redistribute = True
        w.schedule_ack(plan, step, dur)

    def finish(self, plan: TransitionPlan, step: PlanStep, dur: float) -> None:
        rate = self.w.scenario.sim.step_failure_rate
        if rate > 0.0 and self._faults.random() < rate:
            # Injected fault: the step had no lasting effect; the controller retries or aborts.
            self.failures += 1
            self.w.emit(
                TransitionStepDone(
                    self.w.now,
                    plan.plan_id,
                    step.index,
                    ok=False,
                    duration_s=dur,
                    error="injected failure",
                )
            )
            return
        if step.kind is StepKind.KV_HANDOFF:
            for ex in self._held.pop(plan.plan_id, []):
                self.w.release_hold(ex, kv=True)
        self.w.emit(
            TransitionStepDone(self.w.now, plan.plan_id, step.index, ok=True, duration_s=dur)
        )

    def _evacuate(self, step: PlanStep, ordered: bool, kv: bool) -> list[ExecRec]:
        """Moves every execution off the step's cells; returns those moved."""
        w = self.w
        names = step.args.get("destinations", [])
        dests = [w.engine_by_name[n] for n in names if n in w.engine_by_name]
        moved: list[ExecRec] = []
        for cell in step.cells:
            src = w.cell_engines[cell]
            for ex in sorted(src.members, key=lambda e: e.seq_no):
                w.move(ex, w.pick_destination(dests, ordered), kv=kv, hold=kv)
                moved.append(ex)
        return moved
