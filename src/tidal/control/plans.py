"""Transition plans: the ordered steps a role change runs, built from a policy's decision.

In: a Decision, the cells and the destination order. Out: a ``TransitionPlan`` whose steps an
Actuator (runtime or simulator) executes one at a time and acknowledges.

Rollout -> training (QwenGyre, REFERENCE.md §1): stop admission -> reserve a destination and
reroute (standalone engines first, then rollout cells in descending order) -> cancel and retry
outstanding requests -> optional KV handoff -> release rollout memory -> restore training state.
Training -> rollout: offload training state -> wake engine -> load current weights -> resume
admission. verl activate: offload training state -> wake -> sync weights -> add to load balancer
-> resume generation [-> rebalance] (``clear_sticky``: the V1 trainer's redistribution of the
requests in flight over every replica); verl deactivate: remove from load balancer -> abort
in-flight (retries go to standalone) -> sleep -> restore training state (the order is critical).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from tidal.control.policy import Action, Decision, PlanStyle
from tidal.types import CellIndex, Direction


class StepKind(enum.StrEnum):
    STOP_ADMISSION = "stop_admission"
    RESERVE_AND_REROUTE = "reserve_and_reroute"
    CANCEL_AND_RETRY = "cancel_and_retry"
    KV_HANDOFF = "kv_handoff"
    RELEASE_ROLLOUT_MEMORY = "release_rollout_memory"
    RESTORE_TRAINING_STATE = "restore_training_state"
    OFFLOAD_TRAINING_STATE = "offload_training_state"
    WAKE_ENGINE = "wake_engine"
    LOAD_WEIGHTS = "load_weights"
    RESUME_ADMISSION = "resume_admission"
    REMOVE_FROM_LOAD_BALANCER = "remove_from_load_balancer"
    ABORT_INFLIGHT = "abort_inflight"
    SLEEP_ENGINE = "sleep_engine"
    SYNC_WEIGHTS = "sync_weights"
    ADD_TO_LOAD_BALANCER = "add_to_load_balancer"
    RESUME_GENERATION = "resume_generation"
    REBALANCE = "rebalance"


QWENGYRE_TO_TRAINING = (
    StepKind.STOP_ADMISSION,
    StepKind.RESERVE_AND_REROUTE,
    StepKind.CANCEL_AND_RETRY,
    StepKind.KV_HANDOFF,
    StepKind.RELEASE_ROLLOUT_MEMORY,
    StepKind.RESTORE_TRAINING_STATE,
)
QWENGYRE_TO_ROLLOUT = (
    StepKind.OFFLOAD_TRAINING_STATE,
    StepKind.WAKE_ENGINE,
    StepKind.LOAD_WEIGHTS,
    StepKind.RESUME_ADMISSION,
)
VERL_DEACTIVATE = (
    StepKind.REMOVE_FROM_LOAD_BALANCER,
    StepKind.ABORT_INFLIGHT,
    StepKind.SLEEP_ENGINE,
    StepKind.RESTORE_TRAINING_STATE,
)
VERL_ACTIVATE = (
    StepKind.OFFLOAD_TRAINING_STATE,
    StepKind.WAKE_ENGINE,
    StepKind.SYNC_WEIGHTS,
    StepKind.ADD_TO_LOAD_BALANCER,
    StepKind.RESUME_GENERATION,
    StepKind.REBALANCE,
)


@dataclass(frozen=True)
class PlanStep:
    index: int
    kind: StepKind
    cells: tuple[CellIndex, ...]
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TransitionPlan:
    plan_id: int
    direction: Direction
    style: PlanStyle
    cells: tuple[CellIndex, ...]
    steps: tuple[PlanStep, ...]
    reason: str
    created_s: float

    def to_json(self) -> dict[str, Any]:
        return {
            "plan_id": self.plan_id,
            "direction": self.direction.value,
            "style": self.style.value,
            "cells": list(self.cells),
            "steps": [s.kind.value for s in self.steps],
            "reason": self.reason,
        }


def build_plan(
    plan_id: int,
    decision: Decision,
    now_s: float,
    *,
    destinations: list[str],
    version: int,
    kv_handoff: bool,
) -> TransitionPlan:
    """Turns a move decision into its ordered steps."""
    if decision.action is Action.HOLD:
        raise ValueError("a hold decision has no plan")
    to_training = decision.action is Action.TO_TRAINING
    if decision.style is PlanStyle.VERL:
        kinds = VERL_DEACTIVATE if to_training else VERL_ACTIVATE
        if not decision.options.get("rebalance", False):
            kinds = tuple(k for k in kinds if k is not StepKind.REBALANCE)
    else:
        kinds = QWENGYRE_TO_TRAINING if to_training else QWENGYRE_TO_ROLLOUT
        if not kv_handoff:
            kinds = tuple(k for k in kinds if k is not StepKind.KV_HANDOFF)
    steps = []
    for i, kind in enumerate(kinds):
        args: dict[str, Any] = {}
        if kind in (StepKind.RESERVE_AND_REROUTE, StepKind.ABORT_INFLIGHT):
            args["destinations"] = list(destinations)
        if kind in (StepKind.LOAD_WEIGHTS, StepKind.SYNC_WEIGHTS):
            args["version"] = version
        if kind is StepKind.ADD_TO_LOAD_BALANCER and decision.options.get("clear_sticky"):
            # verl V1: the sticky cache is cleared as the replicas join, so the requests the
            # next weight sync aborts retry least-loaded over every replica (the simulator
            # redistributes them; a runtime that only undrains routes new requests alone).
            args["clear_sticky"] = True
        steps.append(PlanStep(i, kind, decision.cells, args))
    return TransitionPlan(
        plan_id=plan_id,
        direction=Direction.TO_TRAINING if to_training else Direction.TO_ROLLOUT,
        style=decision.style,
        cells=decision.cells,
        steps=tuple(steps),
        reason=decision.reason,
        created_s=now_s,
    )
