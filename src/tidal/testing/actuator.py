"""A fake actuator that records every plan step it is asked to run.

``auto=True`` acknowledges each step at once (advancing a ManualClock by the step's configured
duration first), which exercises the controller's re-entrant event handling; ``auto=False``
leaves acknowledgement to the test (``ack``). ``fail`` makes chosen step kinds fail.
"""

from __future__ import annotations

from tidal.clock import ManualClock
from tidal.control.plans import PlanStep, StepKind, TransitionPlan
from tidal.types import TransitionStepDone


class FakeActuator:
    def __init__(
        self,
        clock: ManualClock | None = None,
        auto: bool = True,
        step_s: dict[StepKind, float] | None = None,
        fail: set[StepKind] | None = None,
    ) -> None:
        self.clock = clock
        self.auto = auto
        self.step_s = step_s or {}
        self.fail = fail or set()
        self.controller = None  # set by bind()
        self.executed: list[tuple[int, StepKind, tuple[int, ...]]] = []
        self.plans: dict[int, TransitionPlan] = {}
        self.aborted: list[tuple[int, StepKind, str]] = []
        self.pending: list[tuple[TransitionPlan, PlanStep]] = []

    def bind(self, controller) -> FakeActuator:
        self.controller = controller
        return self

    def execute(self, plan: TransitionPlan, step: PlanStep) -> None:
        self.plans[plan.plan_id] = plan
        self.executed.append((plan.plan_id, step.kind, step.cells))
        if self.auto:
            self.ack(plan, step)
        else:
            self.pending.append((plan, step))

    def ack(self, plan: TransitionPlan, step: PlanStep, ok: bool | None = None) -> None:
        dt = self.step_s.get(step.kind, 0.0)
        if self.clock is not None and dt:
            self.clock.advance(dt)
        now = self.clock.now() if self.clock is not None else 0.0
        good = (step.kind not in self.fail) if ok is None else ok
        self.controller.handle(
            TransitionStepDone(
                now,
                plan.plan_id,
                step.index,
                ok=good,
                duration_s=dt,
                error="" if good else "injected failure",
            )
        )

    def ack_pending(self) -> int:
        """Acknowledge the steps waiting now (manual mode; steps those acks issue stay
        pending); returns how many."""
        batch, self.pending = self.pending, []
        for plan, step in batch:
            self.ack(plan, step)
        return len(batch)

    def abort(self, plan: TransitionPlan, failed: PlanStep, error: str) -> None:
        self.aborted.append((plan.plan_id, failed.kind, error))

    def steps_of(self, plan_id: int) -> list[StepKind]:
        return [k for pid, k, _ in self.executed if pid == plan_id]
