"""verl's newer switch policy (V1 separate-async trainer, verl PR #7373, in 0.9.1) as
``verl-switch``.

In: per training step (= one weight version of ``trigger`` mini-batches): the sampleable groups
when the step begins, per mini-batch the sampleable groups when sampling begins and the seconds
the sampling waited, the measured switch costs, and the sampleable groups for the next step
when it ends. Out: when the hybrid (trainer) GPUs go back to training, and whether they lend
themselves to rollout after the step.

``SwitchHooks`` is the logic of ``PPOTrainerSeparateAsync`` (``trainer/ppo/v1/
trainer_separate_async.py``), method for method: the hybrids start in rollout; a step that
begins with them in rollout takes them back at once if ``sampleable >= threshold``, else after
waiting for it; ``threshold = clip(round(ratio x train_batch), mini_batch, train_batch)``.
After a step: idle iff the step's sampling waited more than the buffer's poll interval (2 s);
the wait seconds and wait samples (``max(0, mini_batch - sampleable)`` per mini-batch) of
steps with both > 0 accumulate over the run; the ratio adapts with hysteresis (``+step_up``
only after ``release_steps`` idle steps in a row, ``-step_down`` after as many calm ones,
within [1/sync_step, 1]); then lend iff not the last step, ``remaining = max(0, threshold -
sampleable_next) > 0`` and (no per-sample time or no cost yet, or the benefit ``remaining x
per_sample_time x (1 - standalone / (hybrid + standalone))`` beats the cost, the mean
to-rollout plus the mean to-trainer switch time over the last ``window`` of each).
``tests/unit/control/test_verl_conformance.py`` drives it against verl's own methods.

``SwitchScheduler`` is the tidal ``Policy``: the hybrid cells switch together (verl plans; a
move to rollout clears the sticky cache as ``on_step_end`` does before the standalone weight
sync, so the requests in flight spread over every replica: ``clear_sticky``), a
step begins at the first trainer request of a version, its mini-batches are the controller's
per-step wait times and queue sizes (taken when the trainer has its GPUs, as verl's sampling
starts after the switch), it ends at the weight sync. tidal's trainer never asks for the step
after the last, so ``is_last_step`` is never true at a sync here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from tidal.control.mechanics import VERL
from tidal.control.policy import (
    Action,
    CellView,
    Decision,
    Observation,
    PlanStyle,
    register_policy,
)
from tidal.errors import ConfigError
from tidal.types import CellKind, Role


@dataclass(frozen=True)
class SwitchSettings:
    """verl's ``HybridRolloutSwitchConfig`` (switching on), plus the replay buffer's poll
    interval, which decides what counts as idle."""

    switch_threshold_ratio: float = 0.4
    adaptive_switch_threshold: bool = True
    switch_threshold_step_up: float = 0.05
    switch_threshold_step_down: float = 0.03
    switch_threshold_release_steps: int = 2
    switch_cost_window_size: int = 3
    poll_interval_s: float = 2.0

    def __post_init__(self) -> None:
        if not 0.0 < self.switch_threshold_ratio <= 1.0:
            raise ConfigError(
                "policy.args.switch_threshold_ratio",
                f"must be in (0, 1], got {self.switch_threshold_ratio}",
            )
        if self.switch_cost_window_size <= 0:
            raise ConfigError("policy.args.switch_cost_window_size", "must be positive")
        if self.switch_threshold_release_steps <= 0:
            raise ConfigError("policy.args.switch_threshold_release_steps", "must be positive")


class SwitchHooks:
    """The switch state of verl's separate-async trainer (pure; no clock)."""

    def __init__(
        self,
        settings: SwitchSettings,
        train_batch_size: int,
        parameter_sync_step: int,
        hybrid_gpus: int,
        standalone_gpus: int,
    ) -> None:
        if standalone_gpus <= 0:
            raise ConfigError(
                "cluster.standalone_count",
                "verl-switch needs standalone "
                "rollout GPUs (verl's separate-async trainer asserts it)",
            )
        self.s = settings
        self.train_batch_size = train_batch_size
        self.parameter_sync_step = parameter_sync_step
        self.ratio = settings.switch_threshold_ratio
        self.idle_steps = 0
        self.calm_steps = 0
        self.step_sample_wait_s = 0.0
        self.step_wait_samples = 0
        self.step_threshold = 0
        self.wait_s = 0.0
        self.wait_samples = 0
        self.to_rollout_costs: deque[float] = deque(maxlen=settings.switch_cost_window_size)
        self.to_trainer_costs: deque[float] = deque(maxlen=settings.switch_cost_window_size)
        self.scaling_factor = (hybrid_gpus + standalone_gpus) / standalone_gpus

    @property
    def mini_batch(self) -> int:
        return self.train_batch_size // self.parameter_sync_step

    def threshold(self) -> int:
        target = round(self.ratio * self.train_batch_size)
        return min(max(target, self.mini_batch), self.train_batch_size)

    def on_step_begin(self, in_rollout: bool, sampleable: int) -> bool:
        """A step begins; True: take the hybrids back now (else, when in rollout, after
        ``sampleable >= self.step_threshold``)."""
        self.step_sample_wait_s = 0.0
        self.step_wait_samples = 0
        self.step_threshold = 0
        if not in_rollout:
            return False
        self.step_threshold = self.threshold()
        return sampleable >= self.step_threshold

    def to_trainer_done(self, cost_s: float) -> None:
        self.to_trainer_costs.append(cost_s)

    def to_rollout_done(self, cost_s: float) -> None:
        self.to_rollout_costs.append(cost_s)

    def on_sample(self, sampleable: int, wait_s: float) -> None:
        """One mini-batch: the sampleable groups when sampling began, the seconds it took."""
        self.step_wait_samples += max(0, self.mini_batch - sampleable)
        self.step_sample_wait_s += wait_s

    def _adapt(self, had_idle: bool) -> None:
        s = self.s
        if had_idle:
            self.calm_steps = 0
            self.idle_steps = min(self.idle_steps + 1, s.switch_threshold_release_steps)
            if self.idle_steps < s.switch_threshold_release_steps:
                return
            self.ratio = min(1.0, self.ratio + s.switch_threshold_step_up)
            return
        self.idle_steps = 0
        self.calm_steps = min(self.calm_steps + 1, s.switch_threshold_release_steps)
        if self.calm_steps < s.switch_threshold_release_steps:
            return
        self.ratio = max(1.0 / self.parameter_sync_step, self.ratio - s.switch_threshold_step_down)

    def effective_switch_cost(self) -> float | None:
        if not self.to_rollout_costs or not self.to_trainer_costs:
            return None
        return sum(self.to_rollout_costs) / len(self.to_rollout_costs) + sum(
            self.to_trainer_costs
        ) / len(self.to_trainer_costs)

    def on_step_end(self, sampleable_next: int, is_last_step: bool) -> tuple[bool, dict]:
        """Whether the hybrids lend themselves to rollout now, and verl's decision metrics."""
        ratio_used = self.ratio
        had_idle = self.step_sample_wait_s > self.s.poll_interval_s
        if self.step_wait_samples > 0 and self.step_sample_wait_s > 0:
            self.wait_s += self.step_sample_wait_s
            self.wait_samples += self.step_wait_samples
        if self.s.adaptive_switch_threshold:
            self._adapt(had_idle)
        threshold = self.threshold()
        remaining = max(0, threshold - sampleable_next)
        per_sample = self.wait_s / self.wait_samples if self.wait_samples > 0 else None
        cost = self.effective_switch_cost()
        benefit = (
            remaining * per_sample * (1.0 - 1.0 / self.scaling_factor)
            if per_sample is not None
            else None
        )
        switch = (
            not is_last_step
            and remaining > 0
            and (benefit is None or cost is None or benefit > cost)
        )
        metrics = {
            "separate_async/switch/threshold_ratio": ratio_used,
            "separate_async/switch/wait_samples": float(self.step_wait_samples),
            "separate_async/switch/idle": float(had_idle),
            "separate_async/decision/sampleable_count": float(sampleable_next),
            "separate_async/decision/remaining": float(remaining),
            "separate_async/decision/should_switch_to_rollout": float(switch),
        }
        if per_sample is not None:
            metrics["separate_async/decision/per_sample_time_seconds"] = per_sample
        if cost is not None:
            metrics["separate_async/decision/effective_switch_cost_seconds"] = cost
        return switch, metrics

    def state(self) -> dict[str, Any]:
        cost = self.effective_switch_cost()
        return {
            "threshold_ratio": round(self.ratio, 6),
            "step_threshold": self.step_threshold,
            "idle_steps": self.idle_steps,
            "calm_steps": self.calm_steps,
            "per_sample_time_s": round(self.wait_s / self.wait_samples, 6)
            if self.wait_samples
            else None,
            "switch_cost_s": None if cost is None else round(cost, 6),
        }


class SwitchScheduler:
    """verl-switch as a tidal Policy: hybrid cells start in rollout and switch together."""

    mechanics = VERL
    waterlevel_safe = False

    def __init__(self, settings: SwitchSettings) -> None:
        self.name = "verl-switch"
        self.settings = settings
        self.hooks: SwitchHooks | None = None
        self._hybrid: tuple[int, ...] = ()
        self._begun_version = -1
        self._synced_version = 0
        self._waiting = False  # the step began with the hybrids in rollout: take them back
        self._moving: Role | None = None  # the target of our plan in flight
        self.last_metrics: dict[str, float] = {}

    def initial_prefix(self, cells: tuple[CellView, ...]) -> int:
        lead = next((i for i, c in enumerate(cells) if c.kind is not CellKind.HYBRID), len(cells))
        if any(c.kind is CellKind.HYBRID for c in cells[lead:]):
            raise ConfigError("cluster.cells", "hybrid cells must lead the cell order")
        return 0  # verl: "hybrid engine is in rollout mode after initialization"

    def state(self) -> dict[str, Any]:
        return self.hooks.state() if self.hooks else {}

    def _setup(self, obs: Observation) -> SwitchHooks:
        self._hybrid = tuple(c.index for c in obs.cells if c.kind is CellKind.HYBRID)
        hybrid_gpus = sum(obs.cells[i].gpus for i in self._hybrid)
        return SwitchHooks(
            self.settings,
            obs.batch_groups * obs.updates_per_burst,
            obs.updates_per_burst,
            hybrid_gpus,
            obs.standalone_gpus,
        )

    def _all(self, obs: Observation, role: Role) -> bool:
        return all(obs.cells[i].role is role for i in self._hybrid)

    def decide(self, obs: Observation) -> Decision:
        if self.hooks is None:
            self.hooks = self._setup(obs)
        h = self.hooks
        if obs.in_flight:
            return Decision.hold("transition in flight")
        if not self._hybrid:
            return Decision.hold("no hybrid cells")
        if self._moving is not None and self._all(obs, self._moving):
            if self._moving is Role.TRAINING:
                h.to_trainer_done(obs.last_deactivate_duration_s)
            else:
                h.to_rollout_done(obs.last_activate_duration_s)
            self._moving = None
        in_rollout = self._all(obs, Role.ROLLOUT)
        if obs.version > self._synced_version:
            self._synced_version = obs.version
            for q, w in zip(obs.cycle_queue_at_start, obs.cycle_wait_times_s, strict=True):
                h.on_sample(q, w)
            switch, self.last_metrics = h.on_step_end(obs.ready_groups, is_last_step=False)
            if switch and not in_rollout:
                short = int(self.last_metrics["separate_async/decision/remaining"])
                return self._move(
                    Action.TO_ROLLOUT,
                    Role.ROLLOUT,
                    f"lend hybrids to rollout: {short} groups short of the threshold",
                    {"clear_sticky": True},
                )
            return Decision.hold("hybrids stay in training after the step")
        if obs.trainer_waiting and obs.steps_in_version == 0 and self._begun_version < obs.version:
            self._begun_version = obs.version
            if h.on_step_begin(in_rollout, obs.ready_groups):
                return self._move(
                    Action.TO_TRAINING,
                    Role.TRAINING,
                    f"step begins: sampleable {obs.ready_groups} >= {h.step_threshold}",
                )
            self._waiting = in_rollout
        if self._waiting and in_rollout:
            if obs.ready_groups >= h.step_threshold:
                self._waiting = False
                return self._move(
                    Action.TO_TRAINING,
                    Role.TRAINING,
                    f"sampleable {obs.ready_groups} >= {h.step_threshold}",
                )
            return Decision.hold(
                f"lending hybrids until {h.step_threshold} groups are "
                f"sampleable ({obs.ready_groups})"
            )
        if (
            in_rollout
            and obs.trainer_waiting
            and not any(c.role is Role.TRAINING for c in obs.cells)
            and self._begun_version >= 0
            and self._moving is None
            and obs.ready_groups >= h.mini_batch
        ):
            # A plan aborted after the step began: the trainer would never get its GPUs.
            return self._move(Action.TO_TRAINING, Role.TRAINING, "take the hybrids back")
        return Decision.hold("hybrids in rollout" if in_rollout else "hybrids training")

    def _move(
        self, action: Action, target: Role, reason: str, options: dict[str, Any] | None = None
    ) -> Decision:
        self._moving = target
        return Decision(action, self._hybrid, reason, PlanStyle.VERL, dict(options or {}))


def _switch_settings(**kw: object) -> SwitchSettings:
    for key, val in kw.items():
        if key == "adaptive_switch_threshold":
            if not isinstance(val, bool):
                raise ConfigError(f"policy.args.{key}", "must be true or false")
        elif isinstance(val, bool) or not isinstance(val, int | float):
            raise ConfigError(f"policy.args.{key}", f"must be a number, got {val!r}")
    return SwitchSettings(**kw)


@register_policy(
    "verl-switch",
    "verl V1 separate-async switch (PR #7373): hybrids lend "
    "themselves to rollout after a step iff the sampleable groups fall short of an "
    "adaptive threshold (hysteresis) and the benefit beats the switch cost",
    mechanics=SwitchScheduler.mechanics,
)
def verl_switch(
    switch_threshold_ratio: float = 0.4,
    adaptive_switch_threshold: bool = True,
    switch_threshold_step_up: float = 0.05,
    switch_threshold_step_down: float = 0.03,
    switch_threshold_release_steps: int = 2,
    switch_cost_window_size: int = 3,
    poll_interval_s: float = 2.0,
) -> SwitchScheduler:
    return SwitchScheduler(
        _switch_settings(
            switch_threshold_ratio=switch_threshold_ratio,
            adaptive_switch_threshold=adaptive_switch_threshold,
            switch_threshold_step_up=switch_threshold_step_up,
            switch_threshold_step_down=switch_threshold_step_down,
            switch_threshold_release_steps=switch_threshold_release_steps,
            switch_cost_window_size=switch_cost_window_size,
            poll_interval_s=poll_interval_s,
        )
    )
