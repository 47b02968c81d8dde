"""verl's dynamic resource scheduling (REFERENCE.md §2): hook policies and their scheduler.

The hook classes reproduce verl's ``default``, ``fixed_ratio`` and ``static_fully_async``
policies formula for formula (including the missing lower bound on the ratio; ``clamp=True``
clamps it to [1/trigger, 1]). ``VerlScheduler`` adapts them to tidal's Policy protocol and calls
the hooks in verl's order once per cycle:
``should_deactivate`` (first trainer step of a cycle) -> ``deactivate_wait_samples`` (if
deactivating) -> ``should_activate_after_step`` (after the weight sync) -> ``request_rebalance``
(if activating) -> ``update_after_step``. All hybrid cells switch together (STANDALONE_ONLY <->
HYBRID_ACTIVE). Units: a "sample" is one prompt group.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from tidal.control.policy import (
    Action,
    CellView,
    Decision,
    Observation,
    PlanStyle,
    default_prefix,
    register_policy,
)
from tidal.errors import ConfigError
from tidal.types import CellKind, Role

DEFAULT_SWITCH_COST_S = 10.0
INITIAL_PER_SAMPLE_TIME_S = 1000.0


@dataclass(frozen=True)
class VerlContext:
    """verl's ``DynamicScheduleContext``, field for field."""

    required_samples: int
    trigger_parameter_sync_step: int
    total_generated_samples: int
    expected_samples: int
    buffer_samples: int
    step_wait_times: tuple[float, ...] = ()
    step_wait_samples: tuple[int, ...] = ()
    only_hybrid: bool = False
    last_activate_duration_s: float = 0.0
    last_deactivate_duration_s: float = 0.0
    switch_cycle: int = -1

    @property
    def step_required_samples(self) -> int:
        return self.required_samples * self.trigger_parameter_sync_step


def context_from(obs: Observation) -> VerlContext:
    required = obs.batch_groups
    trigger = obs.updates_per_burst
    return VerlContext(
        required_samples=required,
        trigger_parameter_sync_step=trigger,
        total_generated_samples=obs.groups_generated,
        expected_samples=required * trigger * obs.version,
        buffer_samples=obs.ready_groups,
        step_wait_times=obs.cycle_wait_times_s,
        step_wait_samples=tuple(max(0, required - q) for q in obs.cycle_queue_at_start),
        only_hybrid=obs.standalone_slots == 0,
        last_activate_duration_s=obs.last_activate_duration_s,
        last_deactivate_duration_s=obs.last_deactivate_duration_s,
        switch_cycle=obs.switch_cycle,
    )


def dispatch_budget(required: int, staleness_threshold: float, trigger: int) -> int:
    """verl's per-version dispatch budget (also the message-queue bound)."""
    return int(required * (1 + staleness_threshold) * trigger)


def _check_ratio(r: float) -> float:
    if isinstance(r, bool) or not isinstance(r, int | float) or not 0.0 <= r <= 1.0:
        raise ConfigError("policy.args.deactivate_ratio", f"must be in [0, 1], got {r!r}")
    return float(r)


class DefaultHooks:
    """verl ``default``: adaptive ratio with a cost/benefit activation gate."""

    def __init__(self, deactivate_ratio: float = 0.3, only_hybrid: bool = False,
                 clamp: bool = False) -> None:
        self.deactivate_ratio = _check_ratio(deactivate_ratio)
        self.only_hybrid = only_hybrid
        self.clamp = clamp
        self.per_sample_time_s = INITIAL_PER_SAMPLE_TIME_S
        self.switch_costs: deque[float] = deque(maxlen=3)
        self._recorded_cycle = -1

    def should_deactivate(self, global_steps: int, is_hybrid_active: bool,
                          ctx: VerlContext) -> bool:
        return is_hybrid_active

    def deactivate_wait_samples(self, ctx: VerlContext) -> int:
        # only_hybrid forces r = 1 from the first cycle on: with no standalone engine nothing
        # produces while the hybrids train, so the queue must hold the whole version first.
        ratio = 1.0 if (self.only_hybrid or ctx.only_hybrid) else self.deactivate_ratio
        return int(ctx.step_required_samples * ratio)

    def switch_cost_s(self) -> float:
        if not self.switch_costs:
            return DEFAULT_SWITCH_COST_S
        return sum(self.switch_costs) / len(self.switch_costs)

    def _observe(self, ctx: VerlContext) -> None:
        if ctx.switch_cycle > self._recorded_cycle and ctx.last_activate_duration_s > 0 \
                and ctx.last_deactivate_duration_s > 0:
            self.switch_costs.append(ctx.last_activate_duration_s + ctx.last_deactivate_duration_s)
            self._recorded_cycle = ctx.switch_cycle
        waits, samples = sum(ctx.step_wait_times), sum(ctx.step_wait_samples)
        if waits > 0 and samples > 0:
            self.per_sample_time_s = waits / samples

    def gap(self, ctx: VerlContext) -> float:
        return self.deactivate_ratio * ctx.step_required_samples - (
            ctx.total_generated_samples - ctx.expected_samples)

    def should_activate_after_step(self, global_steps: int, is_hybrid_active: bool,
                                   ctx: VerlContext) -> bool:
        self._observe(ctx)
        if self.only_hybrid or ctx.only_hybrid:
            return True
        gap = self.gap(ctx)
        return gap > 0 and gap * self.per_sample_time_s > self.switch_cost_s()

    def request_rebalance(self, global_steps: int, ctx: VerlContext) -> None:
        return None

    def update_after_step(self, global_steps: int, ctx: VerlContext) -> None:
        if self.only_hybrid or ctx.only_hybrid:
            self.deactivate_ratio = 1.0
            return
        wait = sum(ctx.step_wait_samples)
        sr = ctx.step_required_samples
        if wait > 0:
            self.deactivate_ratio = min(1.0, self.deactivate_ratio
                                        + min(0.1, max(0.02, wait / sr)))
        else:
            self.deactivate_ratio -= 0.02
        if self.clamp:
            lo = 1.0 / ctx.trigger_parameter_sync_step
            self.deactivate_ratio = min(1.0, max(lo, self.deactivate_ratio))

    def state(self) -> dict[str, Any]:
        return {"deactivate_ratio": round(self.deactivate_ratio, 6),
                "per_sample_time_s": round(self.per_sample_time_s, 6),
                "switch_cost_s": round(self.switch_cost_s(), 6)}


class FixedRatioHooks(DefaultHooks):
    """verl ``fixed_ratio``: the ratio never adapts; activation is the pure gap check."""

    def should_activate_after_step(self, global_steps: int, is_hybrid_active: bool,
                                   ctx: VerlContext) -> bool:
        if self.only_hybrid or ctx.only_hybrid:
            return True
        return (ctx.total_generated_samples - ctx.expected_samples) < (
            self.deactivate_ratio * ctx.step_required_samples)

    def update_after_step(self, global_steps: int, ctx: VerlContext) -> None:
        return None


class StaticHooks(DefaultHooks):
    """verl ``static_fully_async``: deactivate at once, never activate — unless there are no
    standalone replicas (only_hybrid), which is the colocated fallback."""

    def deactivate_wait_samples(self, ctx: VerlContext) -> int:
        # Colocated fallback (no standalone engine): roll out the whole version, then train.
        return ctx.step_required_samples if (self.only_hybrid or ctx.only_hybrid) else 0

    def should_activate_after_step(self, global_steps: int, is_hybrid_active: bool,
                                   ctx: VerlContext) -> bool:
        return self.only_hybrid or ctx.only_hybrid

    def update_after_step(self, global_steps: int, ctx: VerlContext) -> None:
        return None


class VerlScheduler:
    """verl's ``DynamicResourceController`` state machine as a tidal Policy."""

    waterlevel_safe = False

    def __init__(self, name: str, hooks: DefaultHooks, rebalance: bool = False) -> None:
        self.name = name
        self.hooks = hooks
        self.rebalance = rebalance
        self._hybrid: tuple[int, ...] = ()
        self._hybrid_of = -1
        self._started = False
        self._synced_version = 0
        self._cycle_checked_step = -1
        self._wait_target: int | None = None
        self._activating = False  # an activation was decided and has not completed yet
        self.last_hook = ""

    def initial_prefix(self, cells: tuple[CellView, ...]) -> int:
        n = default_prefix(cells)
        if any(c.kind is CellKind.HYBRID for c in cells[n:]):
            raise ConfigError("cluster.cells", "hybrid cells must lead the cell order")
        return n

    def state(self) -> dict[str, Any]:
        return {**self.hooks.state(), "wait_target": self._wait_target,
                "last_hook": self.last_hook}

    def _active(self, obs: Observation) -> bool:
        return any(obs.cells[i].role is Role.ROLLOUT for i in self._hybrid)

    def decide(self, obs: Observation) -> Decision:
        if self._hybrid_of != len(obs.cells):
            # Cell kinds never change: find the hybrid cells once per cluster layout.
            self._hybrid = tuple(c.index for c in obs.cells if c.kind is CellKind.HYBRID)
            self._hybrid_of = len(obs.cells)
        if obs.in_flight or not self._hybrid:
            return Decision.hold("transition in flight" if obs.in_flight else "no hybrid cells")
        active = self._active(obs)
        if active:
            self._activating = False
        if self._activating and obs.version <= self._synced_version:
            # The activation plan aborted (the controller restored the training role): issue it
            # again, as the deactivation target is kept until it completes. Without it, a
            # cluster of hybrid cells only would never roll out again.
            return Decision(Action.TO_ROLLOUT, self._hybrid, "activate again after an abort",
                            PlanStyle.VERL, {"rebalance": self.rebalance})
        if self._wait_target is not None and all(
                obs.cells[i].role is Role.TRAINING for i in self._hybrid):
            self._wait_target = None  # the deactivation completed
        ctx = context_from(obs)
        if not self._started or obs.version > self._synced_version:
            # After a weight sync (and once at start-up, after the initial sync).
            self._started = True
            self._synced_version = obs.version
            self._wait_target = None
            activate = (not active) and self.hooks.should_activate_after_step(
                obs.trainer_step, active, ctx)
            if obs.version > 0:
                self.hooks.update_after_step(obs.trainer_step, ctx)
            self.last_hook = "should_activate_after_step"
            if activate:
                self._activating = True
                return Decision(Action.TO_ROLLOUT, self._hybrid,
                                "activate hybrid replicas after weight sync",
                                PlanStyle.VERL, {"rebalance": self.rebalance})
            return Decision.hold("stay standalone-only after weight sync")
        # The first trainer step of a cycle checks deactivation (verl); so does any step that
        # finds no cell training (an activation that completed after the version's first
        # step, e.g. retried after an abort): the trainer could never run otherwise.
        starved = not any(c.role is Role.TRAINING for c in obs.cells)
        if active and obs.trainer_waiting and (obs.steps_in_version == 0 or starved) \
                and self._cycle_checked_step != obs.trainer_step:
            self._cycle_checked_step = obs.trainer_step
            self.last_hook = "should_deactivate"
            if self.hooks.should_deactivate(obs.trainer_step, active, ctx):
                self._wait_target = self.hooks.deactivate_wait_samples(ctx)
        if active and self._wait_target is not None:
            if obs.ready_groups >= self._wait_target:
                # The target stays until the hybrids are back in training: if the deactivation
                # plan aborts, they are active again and it is re-issued.
                return Decision(Action.TO_TRAINING, self._hybrid,
                                f"deactivate: queue {obs.ready_groups} >= {self._wait_target}",
                                PlanStyle.VERL)
            return Decision.hold(f"deactivate waits: queue {obs.ready_groups} < "
                                 f"{self._wait_target}")
        return Decision.hold("hybrid active" if active else "standalone only")


@register_policy("verl-default", "verl default: adaptive deactivate ratio (r0=0.3), "
                 "cost/benefit activation gate; args deactivate_ratio, clamp, rebalance")
def verl_default(deactivate_ratio: float = 0.3, clamp: bool = False, rebalance: bool = False,
                 only_hybrid: bool = False) -> VerlScheduler:
    return VerlScheduler("verl-default", DefaultHooks(deactivate_ratio, only_hybrid, clamp),
                         rebalance)


@register_policy("verl-fixed-ratio", "verl fixed_ratio: constant deactivate ratio, pure gap "
                 "activation check; args deactivate_ratio, rebalance")
def verl_fixed_ratio(deactivate_ratio: float = 0.3, rebalance: bool = False,
                     only_hybrid: bool = False) -> VerlScheduler:
    return VerlScheduler("verl-fixed-ratio", FixedRatioHooks(deactivate_ratio, only_hybrid),
                         rebalance)


@register_policy("verl-static", "verl static_fully_async: hybrid replicas never roll out "
                 "(colocated fallback without standalone engines)")
def verl_static(only_hybrid: bool = False) -> VerlScheduler:
    return VerlScheduler("verl-static", StaticHooks(0.0, only_hybrid))
