"""verl's dynamic resource scheduling as tidal policies: ``verl-default``, ``verl-fixed-ratio``,
``verl-static`` (and ``verl-switch``, ``verl_switch``).

In: observations from the controller. Out: verl-style plans that switch every hybrid cell
together (STANDALONE_ONLY <-> HYBRID_ACTIVE). The hooks themselves (``verl_hooks``) are verl's
policy classes formula for formula; ``VerlScheduler`` calls them as verl 0.9.1's
``FullyAsyncTrainer`` does, with the context verl builds:
- at the parameter sync before training (version 0) and after every weight sync: the context
  is refreshed (``expected_samples = SR x`` the rollouter's completed steps, which start at 1
  and count the windows that generated anything; the cycle's wait times and wait samples),
  then ``should_activate_after_step``; on True the hybrids activate (plus verl's rebalance with
  ``rebalance=true``); once the activation has completed (its duration is part of the
  context), ``update_after_step``, and the cycle's switch durations start again at 0;
- at every trainer step (``TrainerReady``): ``should_deactivate`` (version, hybrids active);
  on True ``deactivate_wait_samples``, and the hybrids deactivate once the ready queue holds
  that many groups (verl's ``wait_for_enough_samples``); the deactivation's duration adds to
  the cycle's.
A "sample" is one prompt group. The wait times and queue sizes in the context are the
trainer's own, taken when it has its GPUs back (see ``TrainerStepDone``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tidal.control.mechanics import VERL
from tidal.control.policy import (
    Action,
    CellView,
    Decision,
    Observation,
    PlanStyle,
    default_prefix,
    register_policy,
)
from tidal.control.verl_hooks import (
    DEFAULT_SWITCH_COST_S,
    INITIAL_PER_SAMPLE_TIME_S,
    DefaultHooks,
    FixedRatioHooks,
    StaticHooks,
    VerlContext,
    dispatch_budget,
)
from tidal.errors import ConfigError
from tidal.types import CellKind, Role

__all__ = [
    "DEFAULT_SWITCH_COST_S",
    "INITIAL_PER_SAMPLE_TIME_S",
    "DefaultHooks",
    "FixedRatioHooks",
    "StaticHooks",
    "VerlContext",
    "VerlScheduler",
    "dispatch_budget",
]


class VerlScheduler:
    """verl's ``DynamicResourceController`` driven as ``FullyAsyncTrainer`` drives it."""

    mechanics = VERL
    waterlevel_safe = False

    def __init__(
        self,
        name: str,
        hooks: DefaultHooks,
        rebalance: bool = False,
        staleness_threshold: float = 1.0,
    ) -> None:
        if not isinstance(rebalance, bool):
            raise ConfigError("policy.args.rebalance", "must be true or false")
        self.name = name
        self.hooks = hooks
        self.rebalance = rebalance
        self.staleness_threshold = float(staleness_threshold)
        # verl's static_fully_async never activates: with no standalone engine nothing rolls
        # out, so the controller refuses to start (unless the colocated fallback is on).
        self.requires_rollout_at_start = (
            isinstance(hooks, StaticHooks) and not hooks.colocated_fallback
        )
        self._hybrid: tuple[int, ...] | None = None
        self._synced_version = -1  # the parameter sync before training is version 0
        self._checked_step = -1
        self._wait_target: int | None = None
        self._moving: Role | None = None  # the target role of our plan in flight
        self._update: tuple[int, VerlContext] | None = None  # update_after_step to run
        self._ctx: VerlContext | None = None  # verl's persistent context, as of the last sync
        self._activate_s = 0.0  # this cycle's switch durations (verl: += per switch)
        self._deactivate_s = 0.0
        self._completed_steps = 1  # the rollouter's counter (starts at 1)
        self._generated_at_sync = 0
        self.last_hook = ""

    def initial_prefix(self, cells: tuple[CellView, ...]) -> int:
        n = default_prefix(cells)
        if any(c.kind is CellKind.HYBRID for c in cells[n:]):
            raise ConfigError("cluster.cells", "hybrid cells must lead the cell order")
        return n  # verl: the hybrid replicas sleep until the first activation

    def state(self) -> dict[str, Any]:
        return {**self.hooks.state(), "wait_target": self._wait_target, "last_hook": self.last_hook}

    # ------------------------------------------------------------------ context
    def _context(self, obs: Observation, expected: int) -> VerlContext:
        r, t = obs.batch_groups, obs.updates_per_burst
        return VerlContext(
            required_samples=r,
            trigger_parameter_sync_step=t,
            total_generated_samples=obs.groups_generated,
            expected_samples=expected,
            buffer_samples=r * t * self.staleness_threshold,
            step_wait_times=obs.cycle_wait_times_s,
            step_wait_samples=tuple(max(0, r - q) for q in obs.cycle_queue_at_start),
            only_hybrid=self.hooks.only_hybrid,
            last_activate_duration_s=self._activate_s,
            last_deactivate_duration_s=self._deactivate_s,
        )

    def _live_ctx(self) -> VerlContext:
        assert self._ctx is not None
        return dataclasses.replace(
            self._ctx,
            last_activate_duration_s=self._activate_s,
            last_deactivate_duration_s=self._deactivate_s,
        )

    def _all(self, obs: Observation, role: Role) -> bool:
        assert self._hybrid is not None
        return all(obs.cells[i].role is role for i in self._hybrid)

    def _plan(self, action: Action, reason: str) -> Decision:
        self._moving = Role.TRAINING if action is Action.TO_TRAINING else Role.ROLLOUT
        opts = {"rebalance": self.rebalance} if action is Action.TO_ROLLOUT else {}
        assert self._hybrid is not None
        return Decision(action, self._hybrid, reason, PlanStyle.VERL, opts)

    # ------------------------------------------------------------------- decide
    def decide(self, obs: Observation) -> Decision:
        if self._hybrid is None:
            self._hybrid = tuple(c.index for c in obs.cells if c.kind is CellKind.HYBRID)
            self.hooks.set_only_hybrid(obs.standalone_gpus == 0 or self.hooks.only_hybrid)
        if obs.in_flight:
            return Decision.hold("transition in flight")
        if not self._hybrid:
            return Decision.hold("no hybrid cells")
        if self._moving is not None:
            if self._all(obs, self._moving):  # our plan completed
                if self._moving is Role.TRAINING:
                    self._deactivate_s += obs.last_deactivate_duration_s
                    self._wait_target = None
                else:
                    self._activate_s += obs.last_activate_duration_s
                self._moving = None
            elif self._moving is Role.ROLLOUT:
                # The activation aborted (the controller restored training): issue it again;
                # a cluster of hybrid cells only would never roll out otherwise.
                return self._plan(Action.TO_ROLLOUT, "activate again after an abort")
            else:
                self._moving = None  # a deactivation aborted: the wait target stays
        if self._update is not None:
            version, ctx = self._update
            self._update = None
            self.hooks.update_after_step(
                version,
                dataclasses.replace(
                    ctx,
                    last_activate_duration_s=self._activate_s,
                    last_deactivate_duration_s=self._deactivate_s,
                ),
            )
            self._activate_s = self._deactivate_s = 0.0
            self.last_hook = "update_after_step"
        active = self._all(obs, Role.ROLLOUT)
        if obs.version > self._synced_version:
            return self._after_sync(obs, active)
        if obs.trainer_waiting and (
            self._checked_step != obs.trainer_step
            or (
                active
                and self._wait_target is None
                and not any(c.role is Role.TRAINING for c in obs.cells)
            )
        ):
            # A trainer step begins (verl: every fit step asks). Asked again when the step
            # finds the hybrids active with no target and nothing training (an activation
            # retried after an abort completed mid-step): the trainer would never run.
            self._checked_step = obs.trainer_step
            self.last_hook = "should_deactivate"
            ctx = self._live_ctx()
            if self.hooks.should_deactivate(obs.version, active, ctx) and active:
                self._wait_target = self.hooks.deactivate_wait_samples(ctx)
        if active and self._wait_target is not None:
            if obs.ready_groups >= self._wait_target:
                return self._plan(
                    Action.TO_TRAINING,
                    f"deactivate: queue {obs.ready_groups} >= {self._wait_target}",
                )
            return Decision.hold(
                f"deactivate waits: queue {obs.ready_groups} < {self._wait_target}"
            )
        return Decision.hold("hybrid active" if active else "standalone only")

    def _after_sync(self, obs: Observation, active: bool) -> Decision:
        """verl's ``_fit_update_weights``: activation check, activation, then (once it has
        completed) ``update_after_step``; the rollouter's completed steps move on."""
        r, t = obs.batch_groups, obs.updates_per_burst
        ctx = self._ctx = self._context(obs, r * t * self._completed_steps)
        self._synced_version = obs.version
        self._wait_target = None
        self.last_hook = "should_activate_after_step"
        activate = self.hooks.should_activate_after_step(obs.version, active, ctx)
        if obs.groups_generated > self._generated_at_sync:  # verl's reset_staleness
            self._completed_steps += 1
        self._generated_at_sync = obs.groups_generated
        self._update = (obs.version, ctx)
        if activate and not active:
            self.hooks.request_rebalance(obs.version, ctx)
            return self._plan(
                Action.TO_ROLLOUT,
                f"activate hybrid replicas after the sync of version {obs.version}",
            )
        return self.decide(obs)  # nothing to wait for: update_after_step now


def _scheduler(
    name: str, hooks: DefaultHooks, rebalance: bool, staleness_threshold: float
) -> VerlScheduler:
    if (
        isinstance(staleness_threshold, bool)
        or not isinstance(staleness_threshold, int | float)
        or staleness_threshold < 0
    ):
        raise ConfigError("policy.args.staleness_threshold", "must be a number >= 0")
    return VerlScheduler(name, hooks, rebalance, staleness_threshold)


@register_policy(
    "verl-default",
    "verl default: adaptive deactivate ratio (r0=0.3), "
    "cost/benefit activation gate; args deactivate_ratio, clamp, rebalance",
    mechanics=VerlScheduler.mechanics,
)
def verl_default(
    deactivate_ratio: float = 0.3,
    clamp: bool = False,
    rebalance: bool = False,
    only_hybrid: bool = False,
    staleness_threshold: float = 1.0,
) -> VerlScheduler:
    return _scheduler(
        "verl-default",
        DefaultHooks(deactivate_ratio, only_hybrid, clamp),
        rebalance,
        staleness_threshold,
    )


@register_policy(
    "verl-fixed-ratio",
    "verl fixed_ratio: constant deactivate ratio, pure gap "
    "activation check; args deactivate_ratio, rebalance",
    mechanics=VerlScheduler.mechanics,
)
def verl_fixed_ratio(
    deactivate_ratio: float = 0.3,
    rebalance: bool = False,
    only_hybrid: bool = False,
    staleness_threshold: float = 1.0,
) -> VerlScheduler:
    return _scheduler(
        "verl-fixed-ratio",
        FixedRatioHooks(deactivate_ratio, only_hybrid),
        rebalance,
        staleness_threshold,
    )


@register_policy(
    "verl-static",
    "verl static_fully_async: hybrid replicas never roll out; "
    "arg colocated_fallback (roll out on them when there is no standalone engine)",
    mechanics=VerlScheduler.mechanics,
)
def verl_static(
    colocated_fallback: bool = False, only_hybrid: bool = False, staleness_threshold: float = 1.0
) -> VerlScheduler:
    return _scheduler(
        "verl-static", StaticHooks(0.3, only_hybrid, colocated_fallback), False, staleness_threshold
    )


from tidal.control import verl_switch  # noqa: E402,F401  (registers verl-switch)
