"""verl's dynamic-scheduling policies (verl 0.9.1, ``fully_async_policy/dynamic_schedule``),
hook for hook.

In: a ``VerlContext`` (verl's ``DynamicScheduleContext``, field for field) at each hook call.
Out: the hooks' answers, with verl's state updates. ``DefaultHooks``, ``FixedRatioHooks`` and
``StaticHooks`` are verl's ``default``, ``fixed_ratio`` and ``static_fully_async``; the
released code is the reference (it is what ``tests/unit/control/test_verl_conformance.py``
drives them against), in particular:
- ``default`` refreshes its per-sample time (sum of wait times / sum of wait samples, both
  > 0) only inside the cost/benefit check, i.e. only on cycles whose gap is positive, and
  keeps the last estimate otherwise (1000 s before any);
- ``update_after_step`` (after the activation decision and the activation itself) does
  nothing at step 0 or when ``only_hybrid``; otherwise it records the cycle's switch overhead
  ``last_activate + last_deactivate`` whenever that sum is > 0 (mean of the last 3: the switch
  cost, 10 s before any), then adapts the ratio: ``+clip(wait_samples / SR, 0.02, 0.1)``
  (capped at 1) after any real wait, ``-0.02`` otherwise, with no lower bound;
- ``only_hybrid`` is the constructor's flag (verl: no standalone replica), which forces the
  ratio to 1 and the activation check to True (``static_fully_async`` still never activates).
Departures are named options, off by default: ``clamp`` (default) keeps the ratio in
[1/trigger, 1]; ``colocated_fallback`` (static) activates when there is no standalone replica,
where verl's ``static_fully_async`` would never roll out at all.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tidal.errors import ConfigError

DEFAULT_SWITCH_COST_S = 10.0  # verl: DEFAULT_SWITCH_THRESHOLD_S
SWITCH_OVERHEAD_WINDOW = 3
RATIO_INCREASE_MIN = 0.02
RATIO_INCREASE_MAX = 0.1
RATIO_DECREASE_STEP = 0.02
INITIAL_PER_SAMPLE_TIME_S = 1000.0


@dataclass(frozen=True)
class VerlContext:
    """verl's ``DynamicScheduleContext``, field for field (one "sample" is a prompt group)."""

    required_samples: int
    trigger_parameter_sync_step: int
    total_generated_samples: int
    expected_samples: int
    buffer_samples: float
    step_wait_times: tuple[float, ...] = ()
    step_wait_samples: tuple[int, ...] = ()
    only_hybrid: bool = False
    last_activate_duration_s: float = 0.0
    last_deactivate_duration_s: float = 0.0

    @property
    def step_required_samples(self) -> int:
        return self.required_samples * self.trigger_parameter_sync_step

    @staticmethod
    def of(ctx: object) -> VerlContext:
        """From any object with verl's field names (e.g. verl's own context)."""
        kw = {f.name: getattr(ctx, f.name) for f in dataclasses.fields(VerlContext)}
        kw["step_wait_times"] = tuple(kw["step_wait_times"])
        kw["step_wait_samples"] = tuple(kw["step_wait_samples"])
        return VerlContext(**kw)


def dispatch_budget(required: int, staleness_threshold: float, trigger: int) -> int:
    """verl's per-version dispatch budget ``max_required_samples`` (also the queue bound)."""
    return int(required * (1 + staleness_threshold) * trigger)


def _check_ratio(r: float) -> float:
    if isinstance(r, bool) or not isinstance(r, int | float) or not 0.0 <= r <= 1.0:
        raise ConfigError("policy.args.deactivate_ratio", f"must be in [0, 1], got {r!r}")
    return float(r)


class DefaultHooks:
    """verl ``default``: adaptive ratio, cost/benefit activation gate."""

    def __init__(
        self, deactivate_ratio: float = 0.3, only_hybrid: bool = False, clamp: bool = False
    ) -> None:
        self.deactivate_ratio = _check_ratio(deactivate_ratio)
        self.only_hybrid = False
        self.clamp = clamp
        self.per_sample_time_s = INITIAL_PER_SAMPLE_TIME_S
        self.switch_overheads: list[float] = []
        self.set_only_hybrid(only_hybrid)

    def set_only_hybrid(self, only_hybrid: bool) -> None:
        """verl's constructor flag (no standalone replica): forces the ratio to 1."""
        self.only_hybrid = bool(only_hybrid)
        if self.only_hybrid:
            self.deactivate_ratio = 1.0

    # ---------------------------------------------------------------- verl's hooks
    def should_deactivate(
        self, global_steps: int, is_hybrid_active: bool, ctx: VerlContext
    ) -> bool:
        return is_hybrid_active

    def deactivate_wait_samples(self, ctx: VerlContext) -> int:
        return int(ctx.step_required_samples * self.deactivate_ratio)

    def should_activate_after_step(
        self, global_steps: int, is_hybrid_active: bool, ctx: VerlContext
    ) -> bool:
        if self.only_hybrid:
            return True
        if not self.gap(ctx) > 0:
            return False
        return self._has_positive_net_benefit(ctx)

    def request_rebalance(self, global_steps: int, ctx: VerlContext) -> None:
        return None  # the rebalance itself is a plan step (option ``rebalance``)

    def update_after_step(self, global_steps: int, ctx: VerlContext) -> None:
        if global_steps <= 0 or self.only_hybrid:
            return
        overhead = ctx.last_activate_duration_s + ctx.last_deactivate_duration_s
        if overhead > 0:
            self.switch_overheads.append(overhead)
            # verl keeps the whole history and averages the last 3: keep only those
            del self.switch_overheads[:-SWITCH_OVERHEAD_WINDOW]
        wait_samples = sum(ctx.step_wait_samples)
        if wait_samples > 0:
            sr = ctx.step_required_samples
            raw = wait_samples / sr if sr > 0 else RATIO_INCREASE_MAX
            delta = min(RATIO_INCREASE_MAX, max(RATIO_INCREASE_MIN, raw))
            self.deactivate_ratio = min(1.0, self.deactivate_ratio + delta)
        else:
            self.deactivate_ratio += -RATIO_DECREASE_STEP
        if self.clamp:
            lo = 1.0 / ctx.trigger_parameter_sync_step
            self.deactivate_ratio = min(1.0, max(lo, self.deactivate_ratio))

    # ---------------------------------------------------------------- verl's helpers
    def switch_cost_s(self) -> float:
        recent = self.switch_overheads[-SWITCH_OVERHEAD_WINDOW:]
        return sum(recent) / len(recent) if recent else DEFAULT_SWITCH_COST_S

    def gap(self, ctx: VerlContext) -> float:
        """Samples still missing to the deactivation threshold (verl ``_deactivate_gap``)."""
        threshold = self.deactivate_ratio * ctx.step_required_samples
        return threshold - (ctx.total_generated_samples - ctx.expected_samples)

    def _estimate_per_sample_time(self, ctx: VerlContext) -> float:
        waits, samples = sum(ctx.step_wait_times), sum(ctx.step_wait_samples)
        if waits > 0 and samples > 0:
            self.per_sample_time_s = waits / samples
        return self.per_sample_time_s

    def _has_positive_net_benefit(self, ctx: VerlContext) -> bool:
        cost = self.switch_cost_s()
        per_sample = self._estimate_per_sample_time(ctx)
        gap = max(0.0, self.gap(ctx))
        return gap * per_sample - cost > 0

    def state(self) -> dict[str, Any]:
        return {
            "deactivate_ratio": round(self.deactivate_ratio, 6),
            "per_sample_time_s": round(self.per_sample_time_s, 6),
            "switch_cost_s": round(self.switch_cost_s(), 6),
        }


class FixedRatioHooks(DefaultHooks):
    """verl ``fixed_ratio``: the ratio never adapts; activation is the pure gap check."""

    def should_activate_after_step(
        self, global_steps: int, is_hybrid_active: bool, ctx: VerlContext
    ) -> bool:
        if self.only_hybrid:
            return True
        return ctx.total_generated_samples - ctx.expected_samples < (
            self.deactivate_ratio * ctx.step_required_samples
        )

    def update_after_step(self, global_steps: int, ctx: VerlContext) -> None:
        return None

    def state(self) -> dict[str, Any]:
        return {"deactivate_ratio": round(self.deactivate_ratio, 6)}


class StaticHooks(DefaultHooks):
    """verl ``static_fully_async``: deactivate at once, never activate.

    ``colocated_fallback`` (a tidal departure, off by default): with no standalone replica
    (``only_hybrid``) roll the whole version out on the hybrids, then train; verl's policy
    never activates, so nothing would ever roll out.
    """

    def __init__(
        self,
        deactivate_ratio: float = 0.3,
        only_hybrid: bool = False,
        colocated_fallback: bool = False,
    ) -> None:
        if not isinstance(colocated_fallback, bool):
            raise ConfigError("policy.args.colocated_fallback", "must be true or false")
        self.colocated_fallback = colocated_fallback
        super().__init__(deactivate_ratio, only_hybrid)

    def deactivate_wait_samples(self, ctx: VerlContext) -> int:
        if self.colocated_fallback and self.only_hybrid:
            return ctx.step_required_samples
        return 0

    def should_activate_after_step(
        self, global_steps: int, is_hybrid_active: bool, ctx: VerlContext
    ) -> bool:
        return self.colocated_fallback and self.only_hybrid

    def update_after_step(self, global_steps: int, ctx: VerlContext) -> None:
        return None

    def state(self) -> dict[str, Any]:
        return {"deactivate_ratio": round(self.deactivate_ratio, 6)}


HOOKS: dict[str, type[DefaultHooks]] = {
    "default": DefaultHooks,
    "fixed_ratio": FixedRatioHooks,
    "static_fully_async": StaticHooks,
}
