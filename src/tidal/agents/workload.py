"""A run's workload from its ``task:`` section: the task rows, the agent kind and the reward,
built (and so checked) once, and one execution of it.

In: the run config. Out: ``Workload`` (``job(burst, group, seed)`` -> the ``AgentJob`` every
execution of that group runs: the same row, GRPO compares answers to one prompt; a built-in
source's row comes from the group's seed, ``tidal.agents.builtin_tasks``) and ``run_job``: one
execution in its workspace (the row's ``workspace_files`` written first, the agent run under the
execution's timeout, then the reward), ending in an ``Outcome`` with its close reason.
``check_workload`` is what ``tidal check`` and ``tidal run`` call before anything starts: a bad
field is one ``ConfigError``.
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

from tidal.agents import builtin_tasks
from tidal.agents.kinds import AgentContext, AgentKind, build_agent
from tidal.agents.rewards import Reward, RewardError
from tidal.agents.tasks import TaskRow, load_rows, row_for
from tidal.config import RunConfig
from tidal.contracts.close import CloseReason
from tidal.contracts.executions import Outcome, finite_reward
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
        task = cfg.task.with_builtin_defaults()  # a built-in source's step and reward
        c = cfg.control
        # rows per burst: the staleness budget's most (tidal.control.carry_over), so no two
        # groups of a run share a row within an epoch
        from tidal.control.carry_over import budget_groups

        self.groups_per_burst = (
            budget_groups(c.batch_groups, c.updates_per_burst, c.staleness)
            if c.staleness > 0
            else c.quota_executions // c.group_size
        )
        self.seed = cfg.seed
        self.source = task.source
        self.max_turns = task.max_turns
        self.builtin = task.source.kind in builtin_tasks.BUILTIN_SOURCES
        # a built-in source has no rows to load: each group's row comes from its seed
        self.rows = [] if self.builtin else load_rows(task.source, cfg.seed)
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
        if self.builtin:
            row = builtin_tasks.row(self.source, seed, group)
        else:
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


def check_workload(cfg: RunConfig) -> Workload:
    """The workload built from ``cfg.task``; raises ``ConfigError``."""
    return Workload(cfg)


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


def closed(outcome: Outcome, reason: CloseReason, reward: float | None) -> Outcome:
    """``outcome`` with its close reason and reward decided (validated again)."""
    return Outcome.model_validate({**outcome.model_dump(), "reason": reason, "reward": reward})


async def run_job(job: AgentJob, ctx: AgentContext) -> Outcome:
    """One execution: files written, the agent under ``ctx.timeout_s``, then the reward.
    Never raises (but for cancellation): every failure is a close reason."""
    ws = ctx.workspace
    ws.mkdir(parents=True, exist_ok=True)
    try:
        write_files(ws, ctx.row.metadata.get("workspace_files"))
    except (ValueError, OSError) as exc:  # a bad row fails its execution, never the run
        log.warning("execution %s failed: task row %d: %s", ctx.execution_id, ctx.row.index, exc)
        return Outcome(
            reason=CloseReason.FAILED, reward=0.0, detail=f"task row {ctx.row.index}: {exc}"
        )
    try:
        outcome = await asyncio.wait_for(job.agent.run(ctx), ctx.timeout_s)
    except TimeoutError:
        outcome = Outcome(reason=CloseReason.TIMEOUT)
    except Exception as exc:  # the agent is the user's code: its failure closes it FAILED
        log.warning(
            "execution %s: the agent failed: %s: %s",
            ctx.execution_id,
            type(exc).__name__,
            str(exc).splitlines()[0][:200] if str(exc) else "",
        )
        outcome = Outcome(reason=CloseReason.FAILED, detail=_line(exc))
    if outcome.reason is CloseReason.REWARD_ERROR:  # the agent's own reward was not finite
        log.error(
            "execution %s: reward_error: the agent's reward is not a finite number",
            ctx.execution_id,
        )
        return outcome
    if outcome.reward is not None:
        try:
            return closed(outcome, outcome.reason, finite_reward(outcome.reward))
        except ValueError as exc:
            log.error("execution %s: reward_error: %s", ctx.execution_id, exc)
            return closed(outcome, CloseReason.REWARD_ERROR, None)
    if job.reward is None:
        log.error(
            "execution %s: reward_error: no task.reward and the agent returned no reward",
            ctx.execution_id,
        )
        return closed(outcome, CloseReason.REWARD_ERROR, None)
    try:
        reward = await job.reward.score(ctx.row, outcome, ws)
    except RewardError as exc:
        log.error("execution %s: reward_error: %s", ctx.execution_id, exc)
        return closed(outcome, CloseReason.REWARD_ERROR, None)
    return closed(outcome, outcome.reason, reward)


def _line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def write_outcome(ws: Path, outcome: Outcome) -> None:
    """``.tidal/outcome.json`` in the workspace: the close reason, reward and exit code."""
    (ws / ".tidal").mkdir(parents=True, exist_ok=True)
    (ws / ".tidal" / "outcome.json").write_text(
        json.dumps(
            {"reason": outcome.reason, "reward": outcome.reward, "exit_code": outcome.exit_code}
        )
    )
