"""The run directory's schema: one pydantic model per file line, used by the writer
(``tidal.runtime``) and by every reader (``tidal.rundir`` for ``tidal report`` and the plots,
``tidal.sim.from_run`` for ``tidal calibrate``).

In: dicts as the runtime builds them, or as a reader parsed them from a file. Out: the same
dicts, checked: ``check(model, obj, where)`` raises ``ConfigError`` naming the file, line and
field of the first wrong value (one line, never a traceback). Fields a newer runtime added are
optional (older run directories stay readable); keys no model names are kept (verl's
metrics ride on the first step after a weight version closed). An execution's close reason is
``contracts.close.CloseReason``; a call line is made from the proxy's ``CallRecord``
(``CallLine.of``), never assembled by hand.
"""

from __future__ import annotations

from typing import Any, TypeVar, cast

from pydantic import BaseModel, ConfigDict, ValidationError

from tidal.contracts.calls import CallRecord
from tidal.contracts.close import CloseReason
from tidal.errors import ConfigError

M = TypeVar("M", bound=BaseModel)


class _Line(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)


class MetricsLine(_Line):
    """``metrics.jsonl``: one optimizer step."""

    t: float
    burst: int
    step: int
    version: int
    mean_reward: float
    loss: float
    grad_norm: float
    n_groups: int
    n_tokens: int
    max_staleness: int
    step_s: float
    wait_s: float
    waterlevel: int
    ready_groups: int
    roles: list[str]
    training_cells: int
    groups: list[str] | None = None
    satellites: list[int] | None = None
    micro_steps_by_cell: dict[str, int] | None = None
    compute_s: float | None = None
    update_s: float | None = None
    core_compute_s: float | None = None
    core_tokens: int | None = None
    device_peak_mb: dict[str, float] | None = None  # cell -> its trainer's GPU peak so far


class StateLine(_Line):
    """``state.jsonl``: a sample of the live state."""

    t: float
    burst: int
    step: int
    version: int
    reward: float | None
    waterlevel: int
    queued: int
    running: int
    ready_groups: int
    roles: list[str]
    switches: int
    replaced: int
    closed: int | None = None  # executions closed so far (newer runtimes)
    proxy_queued: int | None = None  # calls waiting at the proxy for an engine slot


class StepLine(_Line):
    """``steps.jsonl``: one plan step the actuator ran."""

    plan_id: int
    step: str
    cells: list[int]
    ok: bool
    duration_s: float
    error: str


class CallLine(_Line):
    """One model call of an execution (``executions.jsonl``)."""

    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    reprefill_tokens: int = 0
    engines: list[str]
    start_s: float | None = None
    call_s: float | None = None
    tool_s: float | None = None
    # a deterministic run's (runtime.deterministic): what the engines sampled, per token
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    versions: list[str] | None = None

    @classmethod
    def of(cls, call: CallRecord, tokens: bool = False) -> CallLine:
        """The line of a recorded call: its token counts and the engines that served it;
        with ``tokens`` (a deterministic run) also what the engines sampled, per token."""
        segs = call.segments
        sampled = (
            {
                "prompt_token_ids": list(call.prompt_token_ids),
                "token_ids": call.output_token_ids,
                "logprobs": call.output_logprobs,
                "versions": [v for s in segs for v in s.versions],
            }
            if tokens
            else {}
        )
        return cls(
            prompt_tokens=len(call.prompt_token_ids),
            output_tokens=sum(len(s.token_ids) for s in segs),
            cached_tokens=sum(s.cached_tokens for s in segs),
            reprefill_tokens=sum(s.reprefill_tokens for s in segs),
            engines=[s.engine_id for s in segs],
            **sampled,
        )


class ExecutionLine(_Line):
    """``executions.jsonl``: one closed execution."""

    execution: str
    group: str
    burst: int | None
    reason: CloseReason
    reward: float | None  # None: reward_error (never a stand-in 0.0)
    dispatched_s: float | None = None
    launched_s: float | None = None
    closed_s: float | None = None
    calls: list[CallLine]
    transcript: list[dict[str, Any]] | None = None


class DecisionLine(_Line):
    """``decisions.jsonl``: a scheduling decision or a plan record of the controller; ``t`` in
    seconds since the first dispatch (runs without the summary's ``t0_utc``: the monotonic
    clock)."""

    t: float
    type: str


class Timeline(BaseModel):
    """``timeline.json``: per cell, ``[start_s, end_s, role]`` segments."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cells: list[list[tuple[float, float, str]]]


class Summary(_Line):
    """``summary.json`` as a reader may rely on it (a summary-only directory is still a run;
    every figure is optional to a reader, and checked when present)."""

    policy: str | None = None
    # the mechanics the policy declares (tidal.control.mechanics.Mechanics as JSON)
    policy_mechanics: dict[str, Any] | None = None
    bursts: int | None = None
    trainer_steps: int | None = None
    run_time_s: float | None = None
    bursts_s: float | None = None
    version: int | None = None
    switches_to_training: int | None = None
    switches_to_rollout: int | None = None
    failed_requests: int | None = None
    lost_executions: int | None = None
    dispatched: int | None = None
    closed: int | None = None
    trained_executions: int | None = None
    close_reasons: dict[str, int] | None = None
    mean_reward_per_step: list[float] | None = None
    mean_reward: float | None = None  # over the scored executions
    # executions closed reward_error (no reward), and groups dropped for fewer than 2 scored
    # members (tidal.control.ledger's rule)
    reward_errors: int | None = None
    groups_dropped: int | None = None
    final_roles: str | None = None
    verl_metrics: list[dict[str, float]] | None = None
    t0_utc: str | None = None  # the first dispatch as UTC: every file's time zero
    nodes: int | None = None  # Ray nodes alive when the engines started
    nodes_lost: int | None = None  # of those, nodes gone by the end of the run
    engines_undescribed: list[str] | None = None  # engines whose end-of-run describe failed
    backend_by_engine: dict[str, str] | None = None  # engine id -> builtin | vllm | sglang
    reprefill_tokens: int | None = None  # prompt tokens computed again after moves
    # model calls whose prompt extended no earlier call of their execution (re-tokenization
    # drift a bridge could not remove), per 100 recorded calls
    chain_breaks_per_100_calls: float | None = None
    chain_breaks: int | None = None
    bridged_calls: int | None = None  # calls whose earlier turns got the sampled ids back
    cached_token_share: float | None = None  # prompt tokens engines found cached
    cached_token_share_by_engine: dict[str, float] | None = None
    switch_s: dict[str, dict[str, float]] | None = None  # direction -> n, p50_s, max_s
    # direction -> plan step -> n, p50_s, max_s (each step's measured cost)
    switch_steps_s: dict[str, dict[str, dict[str, float]]] | None = None
    # versions, bytes_per_version, memcpy_gbps, gbps / write_s / engine_load_s /
    # engine_pause_s / engine_prepare_s / engine_step_wait_s as {p50, max}, carriers (loads
    # per carrier), fallbacks
    publication: dict[str, Any] | None = None
    # the control plane's own costs (tidal.runtime.control_plane): proxy calls/s, tokens/s,
    # CPU per call and added latency; controller decision latency; driver loop lag; memory
    control_plane: dict[str, Any] | None = None
    # GPU runs: torch's allocator peak per process (engine-<id>, trainer-c<cell>), MB
    device_peak_mb: dict[str, float] | None = None
    # runtime.deterministic: on or off; seconds dispatch waited at weight-version boundaries
    # for engines to serve the published version; boundaries passed, and of them those that held
    deterministic: bool | None = None
    deterministic_hold_s: float | None = None
    deterministic_boundaries: int | None = None
    deterministic_held_boundaries: int | None = None
    # executions that waited for a slot (tidal.control.queued_waits; in a run: their calls in
    # the proxy's admission queue), measured: how many, seconds in all, p99 and max per execution
    queued_executions: int | None = None
    queued_execution_s: float | None = None
    queued_execution_p99_s: float | None = None
    queued_execution_max_s: float | None = None


def check(model: type[BaseModel], obj: object, where: str) -> dict[str, Any]:
    """``obj`` checked against ``model``; returned unchanged (extra keys kept). A wrong or
    missing value is a ``ConfigError`` at ``where`` naming the field."""
    parse(model, obj, where)
    return cast(dict[str, Any], obj)  # parse refused anything but a dict of the model


def parse(model: type[M], obj: object, where: str) -> M:
    """``obj`` as a ``model`` instance (what a reader should hold); a wrong or missing value
    is a ``ConfigError`` at ``where`` naming the field."""
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "(line)"
        msg = (
            f"{err['input']!r} is not one of {err['ctx']['expected']}"
            if err["type"] == "enum"
            else err["msg"]
        )
        raise ConfigError(where, f"field {field}: {msg}") from None
