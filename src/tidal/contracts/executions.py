"""How one execution ends: ``Turn`` and ``Outcome``, the one contract between ``agents/`` and
the rest of tidal.

In: an agent kind's ``run(ctx)`` returns an ``Outcome`` (built-in chat loop, a user's Python
agent, a command harness, a verifiers environment alike); the harness pool adds the reward
(the agent's own, or the run's reward function's) and the close reason. Out: the runtime (the
harness bridge, the ledger, ``executions.jsonl``) reads the ``Outcome`` and nothing else of
``agents/``.

Kept: a reward is finite or absent (``None`` leaves it to the reward function); a non-finite
reward is refused here (``ValidationError``), and the producer turns that into
``CloseReason.REWARD_ERROR`` (never a default 0.0). An ``Outcome`` with reason
``REWARD_ERROR`` carries no reward. Transcripts are ``Turn``s, never free dicts.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tidal.contracts.close import CloseReason


class Turn(BaseModel):
    """One model call of an execution and what the environment answered. Timings are on the
    harness's monotonic clock (``tidal calibrate`` reads them); absent when the agent kind
    cannot observe them (a black-box command)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    action: str
    observation: str = ""
    t_call: float | None = None  # monotonic time the call started
    call_s: float | None = Field(None, ge=0)  # the model call's duration
    tool_s: float | None = Field(None, ge=0)  # the environment's (tool's) duration


class Outcome(BaseModel):
    """What one execution produced. ``reason`` is why it closed; ``reward`` None means "not
    scored by the agent" until the pool scores it, and stays None only for ``REWARD_ERROR``.
    ``detail`` is the one-line cause of a failure (shown in logs and ``executions.jsonl``)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    reason: CloseReason = CloseReason.COMPLETED
    reward: float | None = Field(None, allow_inf_nan=False)
    answer: str = ""
    transcript: list[Turn] = Field(default_factory=list)
    exit_code: int | None = None
    stdout_tail: str = ""
    stderr_tail: str = ""
    detail: str = ""

    @model_validator(mode="after")
    def _reward_error_has_no_reward(self) -> Outcome:
        if self.reason is CloseReason.REWARD_ERROR and self.reward is not None:
            raise ValueError("an outcome closed 'reward_error' carries no reward")
        return self

    @property
    def turns(self) -> int:
        return len(self.transcript)


def finite_reward(value: object) -> float:
    """``value`` as a finite float; ``ValueError`` naming what it was otherwise (a bool, a
    non-number, NaN or an infinity): the caller closes the execution ``reward_error``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"reward is {type(value).__name__}, not a number")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"reward is {out!r}, not finite")
    return out


class ExecutionOutcome(BaseModel):
    """One execution of the harness pool, closed: its id, its group and its ``Outcome`` (what
    the pool returns to the runtime; ``executions.jsonl`` is written from it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    execution_id: str
    group_id: str
    outcome: Outcome
