"""Shared vocabulary: ids, roles, execution states and the events the control plane consumes.

Everything here is a frozen dataclass or an enum, so events can be logged, diffed and replayed.
No torch, no ray, no I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from tidal.contracts.close import CloseReason

# The smallest positive sampling temperature engines compute safely (below it the softmax of
# logits / t overflows to inf/NaN); 0 means greedy. Checked by the run config and every engine.
MIN_TEMPERATURE = 1e-3

ExecutionId = str
GroupId = str
CellIndex = int
EngineId = str


class Role(enum.StrEnum):
    """What a cell is doing. The two MOVING states hold a cell between roles during a plan."""

    ROLLOUT = "rollout"
    TRAINING = "training"
    MOVING_TO_TRAINING = "moving_to_training"
    MOVING_TO_ROLLOUT = "moving_to_rollout"

    @property
    def training_side(self) -> bool:
        """Counted in the training prefix (a moving cell keeps its place in the order)."""
        return self is not Role.ROLLOUT


class CellKind(enum.StrEnum):
    """ELASTIC cells start in rollout (QwenGyre); HYBRID cells live on trainer GPUs (verl)."""

    ELASTIC = "elastic"
    HYBRID = "hybrid"


class ExecState(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    CLOSED = "closed"


class Direction(enum.StrEnum):
    TO_TRAINING = "to_training"
    TO_ROLLOUT = "to_rollout"


# --------------------------------------------------------------------------- events


@dataclass(frozen=True)
class Event:
    """Base of every control-plane event. ``t_s`` is on the injected clock's time line."""

    t_s: float

    @property
    def kind(self) -> str:
        return type(self).__name__

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"event": self.kind}
        for k, v in self.__dict__.items():
            out[k] = v.value if isinstance(v, enum.Enum) else v
        return out


@dataclass(frozen=True)
class BurstStarted(Event):
    """A burst publishes its dispatch quota (executions) under weight version ``version``. It
    supersedes what is left of earlier bursts' quotas: no ``ExecutionDispatched`` of an earlier
    burst follows it (the simulator forfeits a version's unused budget; the runtime tags every
    dispatch with the current burst)."""

    burst: int
    quota_executions: int
    version: int = 0


@dataclass(frozen=True)
class ExecutionDispatched(Event):
    execution_id: ExecutionId
    group_id: GroupId
    group_size: int
    burst: int = 0


@dataclass(frozen=True)
class ExecutionLaunched(Event):
    execution_id: ExecutionId


@dataclass(frozen=True)
class ExecutionClosed(Event):
    """Closes an execution once. ``reward`` None means "closed, not scored yet"."""

    execution_id: ExecutionId
    reason: CloseReason = CloseReason.COMPLETED
    reward: float | None = None


@dataclass(frozen=True)
class ExecutionScored(Event):
    execution_id: ExecutionId
    reward: float


@dataclass(frozen=True)
class RequestRetried(Event):
    """A model request of a live execution was retried elsewhere; moves no counter."""

    execution_id: ExecutionId


@dataclass(frozen=True)
class GroupsAssigned(Event):
    """The trainer took ready groups into its current batch."""

    group_ids: tuple[GroupId, ...]


@dataclass(frozen=True)
class TrainerReady(Event):
    """The trainer wants to start optimizer step ``step`` (verl: start of a collection)."""

    step: int


@dataclass(frozen=True)
class BatchShort(Event):
    """Step ``step`` trains ``groups`` groups, fewer than ``batch_groups``: no more can come
    before its burst's weights are published (groups of the burst were dropped, e.g. for
    ``reward_error`` members); the supply view counts only those."""

    step: int
    groups: int


@dataclass(frozen=True)
class TrainerStepDone(Event):
    """One optimizer step (verl: one fit step / collection) finished.

    ``wait_s`` is how long the trainer waited for data, ``queue_at_start`` the ready groups when
    it started collecting, ``compute_s`` / ``alloc_s`` the verl utilization numerator and
    denominator, ``final_of_burst`` marks the last update of a burst (weights get published).
    """

    step: int
    wait_s: float = 0.0
    queue_at_start: int = 0
    compute_s: float = 0.0
    alloc_s: float = 0.0
    final_of_burst: bool = False
    wait_for_samples_s: float = 0.0


@dataclass(frozen=True)
class WeightSyncDone(Event):
    version: int
    duration_s: float = 0.0
    transports: tuple[tuple[str, str], ...] = ()  # (engine id, its carrier) per load
    # what it cost: write_s, bytes, gbps, engines: {id: {carrier, bytes, seconds, pause_s}}
    detail: dict | None = None


@dataclass(frozen=True)
class TransitionStepDone(Event):
    plan_id: int
    step_index: int
    ok: bool = True
    duration_s: float = 0.0
    error: str = ""
    detail: dict | None = None  # what the step chose and what it cost (decision log)


@dataclass(frozen=True)
class Tick(Event):
    """Nothing happened but time passed (hold intervals are measured on ticks too)."""


@dataclass(frozen=True)
class EngineCapacityChanged(Event):
    """A standalone engine joined (slots > 0) or left (slots == 0)."""

    engine_id: EngineId
    slots: int


EVENT_TYPES: dict[str, type[Event]] = {
    cls.__name__: cls
    for cls in (
        BurstStarted,
        ExecutionDispatched,
        ExecutionLaunched,
        ExecutionClosed,
        ExecutionScored,
        RequestRetried,
        GroupsAssigned,
        TrainerReady,
        TrainerStepDone,
        WeightSyncDone,
        TransitionStepDone,
        Tick,
        EngineCapacityChanged,
    )
}


def event_from_json(data: dict[str, Any]) -> Event:
    """Inverse of ``Event.to_json`` (used to replay decision logs)."""
    data = dict(data)
    cls = EVENT_TYPES[data.pop("event")]
    if cls is ExecutionClosed and "reason" in data:
        data["reason"] = CloseReason(data["reason"])
    if cls is GroupsAssigned:
        data["group_ids"] = tuple(data["group_ids"])
    return cls(**data)


CHAIN_WINDOW_CALLS = 16  # how many earlier calls of an execution a new call may continue


def continues_chain(prompt: list[int], earlier: list[tuple[list[int], list[int]]]) -> bool:
    """Whether a call's ``prompt`` continues its execution's chain: it starts with one of the
    last ``CHAIN_WINDOW_CALLS`` earlier calls' prompt + output, or repeats one's prompt (another
    choice of that turn). ``earlier``: (prompt ids, output ids) per call, oldest first. The one
    rule the proxy counts chain breaks by and training splits sequences by."""
    for before, output in reversed(earlier[-CHAIN_WINDOW_CALLS:]):
        stream = before + output
        if prompt[: len(stream)] == stream or prompt == before:
            return True
    return False
