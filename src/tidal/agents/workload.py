"""A run's workload from its ``task:`` section: the task rows, the agent kind and the reward,
built (and so checked) once, and one execution of it.

In: the run config. Out: ``Workload`` (``job(burst, group, seed)`` -> the ``AgentJob`` every
execution of that group runs: the same row, GRPO compares answers to one prompt) and
``run_job``: one execution in its workspace (the row's ``workspace_files`` written first, the
agent run under the execution's timeout, then the reward). ``check_workload`` is what ``tidal
check`` and ``tidal run`` call before anything starts: a bad field is one ``ConfigError``.
Close reasons: the agent's own (``completed``, or ``failed`` for a non-zero exit or an agent
that raised), ``timeout`` (cancelled at ``timeout_s``, then scored as it stands) and
``reward_error`` (the reward raised or returned a non-number, or the agent's own reward was
NaN, an infinity or a bool: logged with the execution id and the exception's line, counted; the
reward is None, never a silent 0). A row whose ``workspace_files`` cannot be written (not a
mapping of relative paths to text, a path outside the workspace) closes its execution
``failed`` with the reason logged, never the run.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal.agents.kinds import AgentContext, AgentKind, AgentOutcome, build_agent
from tidal.agents.rewards import Reward, RewardError
from tidal.agents.tasks import TaskRow, load_rows, row_for
from tidal.config import RunConfig
from tidal.contracts.executions import finite_reward
from tidal.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgentJob:
    """What every execution of one group runs."""

    row: TaskRow
    agent: AgentKind
    reward: Reward | None
    seed: int
    args: dict[str, Any]


class Workload:
    def __init__(self, cfg: RunConfig) -> None:
        task = cfg.task
        if task is None:
            raise ConfigError("task", "no task section (the run uses runtime.task)")
        c = cfg.control
        self.groups_per_burst = c.quota_executions // c.group_size
        self.seed = cfg.seed
        self.rows = load_rows(task.source, cfg.seed)
        self.agent = build_agent(task.agent.model_copy(deep=True))
        check_rows = getattr(self.agent, "check_rows", None)
        if check_rows is not None:  # a kind that brings its own tasks (verifiers) meets the rows
            check_rows(self.rows)
        self.reward = Reward(task.reward) if task.reward is not None else None
        if (
            task.reward is not None
            and task.reward.builtin == "reasoning_gym"
            and task.source.kind != "reasoning_gym"
        ):
            raise ConfigError(
                "task.reward.builtin", "'reasoning_gym' scores rows of a reasoning_gym source only"
            )
        self.args = dict(task.agent.args)
        self.system_prompt = task.source.system_prompt

    def job(self, burst: int, group: int, seed: int) -> AgentJob:
        row = row_for(self.rows, self.seed, burst, group, self.groups_per_burst)
        if self.system_prompt:
            row = TaskRow(
                row.index,
                messages=row.chat(self.system_prompt),
                answer=row.answer,
                metadata=row.metadata,
                data_source=row.data_source,
            )
        return AgentJob(row, self.agent, self.reward, seed, self.args)


def check_workload(cfg: RunConfig) -> Workload | None:
    """The workload built from ``cfg.task`` (None without one); raises ``ConfigError``."""
    return Workload(cfg) if cfg.task is not None else None


@dataclass
class JobResult:
    reason: str
    reward: float | None  # None exactly when the reason is reward_error
    outcome: AgentOutcome


def write_files(ws: Path, files: object) -> None:
    """The row's ``workspace_files`` (relative path -> text) into ``ws``; ``ValueError``
    naming what is wrong."""
    if not files:
        return
    if not isinstance(files, dict):
        raise ValueError(f"workspace_files is {type(files).__name__}, not a mapping path -> text")
    for rel, text in files.items():
        if not isinstance(text, str):
            raise ValueError(f"workspace_files[{rel!r}] is {type(text).__name__}, not text")
        path = (ws / rel).resolve()
        if not path.is_relative_to(ws.resolve()):
            raise ValueError(f"workspace file {rel!r} is outside the workspace")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


async def run_job(job: AgentJob, ctx: AgentContext) -> JobResult:
    """One execution: files written, the agent under ``ctx.timeout_s``, then the reward.
    Never raises (but for cancellation): every failure is a close reason."""
    ws = ctx.workspace
    ws.mkdir(parents=True, exist_ok=True)
    try:
        write_files(ws, ctx.row.metadata.get("workspace_files"))
    except (ValueError, OSError) as exc:  # a bad row fails its execution, never the run
        log.warning("execution %s failed: task row %d: %s", ctx.execution_id, ctx.row.index, exc)
        return JobResult("failed", 0.0, AgentOutcome(reason="failed"))
    try:
        outcome = await asyncio.wait_for(job.agent.run(ctx), ctx.timeout_s)
    except TimeoutError:
        outcome = AgentOutcome(reason="timeout")
    except Exception as exc:  # the agent is the user's code: its failure closes it "failed"
        log.warning(
            "execution %s: the agent failed: %s: %s",
            ctx.execution_id,
            type(exc).__name__,
            str(exc).splitlines()[0][:200] if str(exc) else "",
        )
        outcome = AgentOutcome(reason="failed")
    if outcome.reason == "reward_error":  # the agent's own reward was not a finite number
        log.error("execution %s: reward_error: the agent's reward is not a finite number",
                  ctx.execution_id)
        return JobResult("reward_error", None, outcome)
    if outcome.reward is not None:
        try:
            return JobResult(outcome.reason, finite_reward(outcome.reward), outcome)
        except ValueError as exc:
            log.error("execution %s: reward_error: %s", ctx.execution_id, exc)
            return JobResult("reward_error", None, outcome)
    if job.reward is None:
        log.error(
            "execution %s: reward_error: no task.reward and the agent returned no reward",
            ctx.execution_id,
        )
        return JobResult("reward_error", None, outcome)
    try:
        reward = await job.reward.score(ctx.row, outcome, ws)
    except RewardError as exc:
        log.error("execution %s: reward_error: %s", ctx.execution_id, exc)
        return JobResult("reward_error", None, outcome)
    return JobResult(outcome.reason, reward, outcome)


def write_outcome(ws: Path, result: JobResult) -> None:
    """``.tidal/outcome.json`` in the workspace: the close reason, reward and exit code."""
    (ws / ".tidal").mkdir(parents=True, exist_ok=True)
    (ws / ".tidal" / "outcome.json").write_text(
        json.dumps(
            {
                "reason": result.reason,
                "reward": result.reward,
                "exit_code": result.outcome.exit_code,
            }
        )
    )
