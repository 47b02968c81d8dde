"""tidal's ``waterlevel`` and ``tidal`` policies inside verl (0.9.1's fully-async trainer).

In: verl's hook calls (``DynamicSchedulePolicyBase``: ``should_deactivate``,
``deactivate_wait_samples``, ``should_activate_after_step``, ``request_rebalance``,
``update_after_step``) with verl's ``DynamicScheduleContext``, and the rollouter's statistics
(``get_statistics()`` of the actor verl injects as ``policy._rollouter``: samples in generation,
queue size, capacity, dispatch budget and samples dispatched in this version). Out: verl's
answers, decided by the real tidal policy object on an ``Observation`` built from them.

verl switches every hybrid replica together, only at two points: before a fit step (the
trainer needs the GPUs back: ``should_deactivate`` answers "hybrids active", as verl's own
policies do, and ``deactivate_wait_samples`` says when) and after a weight sync (whether the
hybrids roll out during the next version). The bridge maps the hybrids to one tidal cell of
``HYBRID`` kind (slots: the hybrids' share of the capacity) and the standalone replicas to
standalone slots; one sample (prompt group) counts as one execution. Then:
- ``deactivate_wait_samples``: the smallest queue size at which the policy would move the cell
  to training, found by asking a copy of the policy on the observations the rollout would
  reach as samples complete (each completion adds one to the queue and frees one in-flight
  sample, refilled from the budget while any is left); the whole budget if it never would;
- ``should_activate_after_step``: a weight sync is a burst end; True iff the policy returns the
  cell to rollout. ``update_after_step`` and ``request_rebalance`` do nothing: the policies
  learn from observations, and tidal never aborts requests to rebalance.
verl cannot express a hold time on the supply: ``supply_hold_s`` is 0 here.
Nor a dispatch hold: verl's rollouter dispatches from its own per-version budget and no hook
can limit it, so a decision carrying ``Decision.dispatch_limit`` is answered as the hold it is
(the hybrids stay until the policy would move them) and the limit itself is not applied.
tidal's over-subscription does reach verl: an over-subscribed move (``Decision.oversubscribe``)
is a move to training like any other, so the hybrids deactivate with the waterlevel above the
standalone capacity; verl then aborts the hybrids' requests and the samples wait in the
standalone servers' own request queues. tidal does not see that wait: verl runs report no
``queued_execution_*`` figures; ``max_queued`` bounds the move as in tidal's own runs, and the
wait cap (``max_wait_s``) can act only when verl next asks, after a weight sync (whether to
activate), so there it bounds the forecast, not every measured wait.

Registration: importing this module registers ``waterlevel`` and ``tidal`` in verl's policy
registry when verl is importable (verl 0.9.1 imports every ``verl.plugins`` entry point when
it is imported, and tidal declares this module as one, so Ray workers register them too).
Policy arguments (verl passes only ``deactivate_ratio`` and ``only_hybrid``) come from
``TIDAL_VERL_POLICY_ARGS`` (``k=v,k=v``).
"""

from __future__ import annotations

import copy
import logging
import os
import time
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

from tidal.control.policy import (
    Action,
    CellView,
    Observation,
    Policy,
    make_policy,
    parse_policy_spec,
)
from tidal.control.supply import SupplyTracker
from tidal.errors import TidalError
from tidal.types import CellKind, Role

if TYPE_CHECKING:
    from tidal.runtime.ray_types import ActorHandle


class VerlContextLike(Protocol):
    """verl's dynamic-schedule context as the bridge reads it (verl's own object; the hooks
    copy every field with ``VerlContext.of``)."""

    required_samples: int
    trigger_parameter_sync_step: int


log = logging.getLogger(__name__)

POLICIES = {"waterlevel": "waterlevel", "tidal": "tidal"}  # verl's name -> tidal's policy
STATS_KEYS = (
    "monitor/active_tasks_size",
    "monitor/queue/mq_queue_size",
    "static/max_concurrent_samples",
    "static/max_required_samples",
    "count/staleness_samples",
    "count/total_generated_samples",
)


class BridgeError(TidalError):
    """The bridge has no rollouter statistics to decide on."""


def _rollouter_stats(rollouter: ActorHandle) -> dict[str, Any]:
    import ray  # verl's rollouter is a Ray actor

    return ray.get(rollouter.get_statistics.remote(), timeout=60)


class VerlBridge:
    """The hook methods; ``register`` mixes them into subclasses of verl's base class."""

    tidal_policy = "waterlevel"

    def __init__(
        self,
        deactivate_ratio: float = 0.3,
        only_hybrid: bool = False,
        *,
        policy_args: dict[str, Any] | None = None,
        stats: Callable[[], dict[str, Any]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        supply_fraction: float = 0.5,
    ) -> None:
        if policy_args is None:
            _, policy_args = parse_policy_spec(f"x:{os.environ.get('TIDAL_VERL_POLICY_ARGS', '')}")
        self.deactivate_ratio = deactivate_ratio  # what verl logs; unused by tidal's policies
        self.only_hybrid = only_hybrid
        self.policy: Policy = make_policy(self.tidal_policy, policy_args)
        self._stats = stats
        self._clock = clock
        self.supply_fraction = supply_fraction
        self._supply: SupplyTracker | None = None
        self._standalone_cap: int | None = 0 if only_hybrid else None
        self._hybrid_cap = 0
        self.fit_steps = 0
        self.bursts_ended = 0
        self.last_reason = ""

    # ----------------------------------------------------------------- observation
    def stats(self) -> dict[str, Any]:
        if self._stats is not None:
            return self._stats()
        rollouter = getattr(self, "_rollouter", None)
        if rollouter is None:
            raise BridgeError("no rollouter statistics: verl injects policy._rollouter")
        return _rollouter_stats(rollouter)

    def observe(
        self,
        global_steps: int,
        active: bool,
        ctx: VerlContextLike,
        waiting: bool,
        st: dict[str, Any] | None = None,
        done: int = 0,
    ) -> Observation:
        """The observation for verl's state; ``done``: samples assumed completed since."""
        st = st if st is not None else self.stats()
        inflight = int(st["monitor/active_tasks_size"])
        queue = int(st["monitor/queue/mq_queue_size"])
        cap = int(st["static/max_concurrent_samples"] or 0)
        budget = int(st["static/max_required_samples"] or 0)
        pending = max(0, budget - int(st["count/staleness_samples"]))
        if active:
            if self._standalone_cap is not None:
                self._hybrid_cap = max(0, cap - self._standalone_cap)
        else:
            self._standalone_cap = cap
        standalone = self._standalone_cap if self._standalone_cap is not None else cap
        hybrid = max(1, self._hybrid_cap)
        outstanding = max(0, inflight + pending - done)
        inflight = min(inflight, outstanding)
        pending = outstanding - inflight
        queue += done
        r = ctx.required_samples
        if self._supply is None:
            self._supply = SupplyTracker(r, self.supply_fraction, 0.0)
        now = self._clock()
        cell = CellView(0, hybrid, 1, CellKind.HYBRID, Role.ROLLOUT if active else Role.TRAINING)
        return Observation(
            now_s=now,
            trigger="verl",
            cells=(cell,),
            standalone_slots=standalone,
            standalone_gpus=1 if standalone else 0,
            rollout_capacity=standalone + (hybrid if active else 0),
            waterlevel=inflight,
            queued=0,
            running=inflight,
            pending_dispatch=pending,
            supply=self._supply.view(now, queue, 0),
            ready_groups=queue,
            groups_generated=int(st["count/total_generated_samples"]) + done,
            executions_finished=int(st["count/total_generated_samples"]) + done,
            batch_groups=r,
            updates_per_burst=ctx.trigger_parameter_sync_step,
            trainer_waiting=waiting,
            trainer_step=self.fit_steps,
            steps_in_version=0,
            version=global_steps,
            bursts_ended=self.bursts_ended,
            in_flight=False,
        )

    # -------------------------------------------------------------------- verl's hooks
    def should_deactivate(
        self, global_steps: int, is_hybrid_active: bool, ctx: VerlContextLike
    ) -> bool:
        self.fit_steps += 1
        self._step = (global_steps, is_hybrid_active)
        return is_hybrid_active  # the trainer needs its GPUs: when is the next hook's answer

    def deactivate_wait_samples(self, ctx: VerlContextLike) -> int:
        global_steps, active = getattr(self, "_step", (0, True))
        st = self.stats()
        queue = int(st["monitor/queue/mq_queue_size"])
        reach = int(st["monitor/active_tasks_size"]) + max(
            0, int(st["static/max_required_samples"] or 0) - int(st["count/staleness_samples"])
        )
        d = self.policy.decide(self.observe(global_steps, active, ctx, True, st))
        self.last_reason = d.reason
        if d.action is Action.TO_TRAINING:
            return queue
        for k in range(1, reach + 1):
            what_if = copy.deepcopy(self.policy)
            d = what_if.decide(self.observe(global_steps, active, ctx, True, st, done=k))
            if d.action is Action.TO_TRAINING:
                self.last_reason = f"after {k} more samples: {d.reason}"
                return queue + k
        self.last_reason = f"the policy keeps the hybrids while {reach} samples are out"
        return queue + reach

    def should_activate_after_step(
        self, global_steps: int, is_hybrid_active: bool, ctx: VerlContextLike
    ) -> bool:
        if is_hybrid_active:
            return False
        if global_steps > 0:
            self.bursts_ended += 1  # a weight sync ends a burst
        d = self.policy.decide(self.observe(global_steps, False, ctx, False))
        self.last_reason = d.reason
        return d.action is Action.TO_ROLLOUT

    def request_rebalance(self, global_steps: int, ctx: VerlContextLike) -> None:
        return None  # tidal never aborts requests to rebalance

    def update_after_step(self, global_steps: int, ctx: VerlContextLike) -> None:
        return None


def register(base: ModuleType | None = None) -> dict[str, type]:
    """Subclasses of verl's ``DynamicSchedulePolicyBase`` for ``POLICIES``, registered in
    verl's registry (``base``: verl's ``dynamic_schedule.base`` module; imported if None)."""
    if base is None:
        from verl.experimental.fully_async_policy.dynamic_schedule import base
    out = {}
    for verl_name, tidal_name in POLICIES.items():
        cls = type(
            f"Tidal{tidal_name.capitalize()}Policy",
            (VerlBridge, base.DynamicSchedulePolicyBase),
            {
                "tidal_policy": tidal_name,
                "__module__": __name__,
                "__doc__": f"tidal's {tidal_name!r} policy as a verl dynamic-schedule "
                "policy (tidal.integrations.verl).",
            },
        )
        base.register_policy(verl_name)(cls)
        out[verl_name] = cls
    return out


def _register_if_verl() -> dict[str, type]:
    try:
        return register()
    except ImportError:  # verl is not installed: nothing to register with
        return {}


REGISTERED = _register_if_verl()
