"""The ``task:`` section of a run config: the user's task rows (``source``), how an execution is
scored (``reward``) and what runs it (``agent``). Read by ``tidal.agents`` (tasks, rewards,
kinds); ``tidal.config`` re-exports each model.

In: the section's mapping. Out: validated models, or a ``ConfigError`` naming the field.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from tidal.config_base import FieldError, Strict


class TaskSourceConfig(Strict):
    """Where task rows come from (``tidal.agents.tasks``): a file or saved dataset with a field
    mapping, or a procedural generator."""

    kind: str = Field(
        pattern="^(jsonl|parquet|disk|reasoning_gym|swe_repos|arithmetic|workspace)$",
        description="'jsonl' / 'parquet' (a local file), 'disk' (a Hugging Face dataset "
        "saved with save_to_disk), 'reasoning_gym' (create_dataset(name, size, "
        "seed), generated here), 'swe_repos' (small Python repos with a failing "
        "test, generated in each workspace), or a built-in task generated from "
        "each group's seed: 'arithmetic' (single-turn) or 'workspace' (multi-turn "
        "file tools)",
    )
    path: str | None = Field(None, description="the file or directory (jsonl, parquet, disk)")
    split: str | None = Field(None, description="the split of a saved DatasetDict (disk)")
    prompt: str | None = Field(None, description="the column holding the prompt text")
    messages: str | None = Field(
        None,
        description="the column holding chat messages ([{role, content}, ...]); instead of prompt",
    )
    answer: str | None = Field(None, description="the column holding the reference answer")
    metadata: list[str] | None = Field(
        None, description="columns passed as metadata (None: every column not mapped above)"
    )
    data_source: str | None = Field(
        None,
        description="the column naming each row's source "
        "(verl's data_source; None: the column 'data_source' if "
        "the data has it, else the source kind or name)",
    )
    name: str | None = Field(None, description="the reasoning-gym dataset name")
    size: int = Field(1000, ge=1, description="rows generated (reasoning_gym, swe_repos)")
    args: dict[str, Any] = Field(
        default_factory=dict, description="generator arguments (reasoning-gym dataset config)"
    )
    system_prompt: str | None = Field(
        None, description="a system message put before each row's prompt"
    )
    limit: int | None = Field(None, ge=1, description="use the first N rows only")
    tool_latency_s: float | None = Field(
        None,
        ge=0.0,
        description="workspace: the median tool-call latency (lognormal, long-tailed; None: 0.2 s)",
    )

    @model_validator(mode="after")
    def _latency_for_workspace(self) -> TaskSourceConfig:
        if self.tool_latency_s is not None and self.kind != "workspace":
            raise FieldError("tool_latency_s", "used by the 'workspace' source only")
        return self


class RewardConfig(Strict):
    """How a closed execution is scored (``tidal.agents.rewards``)."""

    function: str | None = Field(
        None,
        description="'module:function' or 'path/file.py:"
        "function': verl's compute_score(data_source, solution_str, "
        "ground_truth, extra_info) as it is, or a function taking "
        "any of row, answer, workspace, transcript, outcome by name",
    )
    builtin: str | None = Field(
        None,
        pattern="^(reasoning_gym|math_verify|tests|exact)$",
        description="'reasoning_gym' (the dataset's score_answer), "
        "'math_verify' (math-verify), 'tests' (the workspace's tests "
        "pass: 1, else 0) or 'exact' (the answer equals the reference)",
    )
    timeout_s: float = Field(60.0, gt=0.0, description="bound on one reward computation")

    @model_validator(mode="after")
    def _one(self) -> RewardConfig:
        if (self.function is None) == (self.builtin is None):
            raise FieldError("function", "set exactly one of reward.function and reward.builtin")
        return self


class AgentConfig(Strict):
    """What runs each execution (``tidal.agents.kinds``): a registered agent kind."""

    kind: str = Field(
        "chat",
        description="'chat' (tidal's multi-turn loop), 'python' (an "
        "async function given an AsyncOpenAI client), 'command' (any program, "
        "given OPENAI_BASE_URL / OPENAI_API_KEY) or a registered kind",
    )
    function: str | None = Field(
        None,
        description="python: 'module:function' (async, "
        "called with client, row, workspace and the context)",
    )
    step: str | None = Field(
        None,
        description="chat: optional 'module:function' giving the "
        "environment's feedback to each answer",
    )
    command: list[str] | None = Field(
        None,
        description="command: the program and its "
        "arguments; {prompt}, {task_file}, {workspace}, "
        "{execution_id}, {base_url}, {model} are filled in",
    )
    env: dict[str, str] = Field(default_factory=dict, description="command: extra environment")
    task_file: str = Field(
        "task.json",
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="the task row as JSON in each workspace",
    )
    args: dict[str, Any] = Field(default_factory=dict, description="arguments of the kind")
    user: str = Field(
        "auto",
        pattern=r"^[a-z_][a-z0-9_-]*$",
        description="command: the "
        "user the program runs as, in its own PID namespace: 'auto' = "
        "'tidal-agent' (created if absent) when tidal runs as root, else tidal's "
        "own user; a user name; or 'root' (no switch). See docs/security.md",
    )
    output_limit_bytes: int = Field(
        16 * 2**20,
        ge=1024,
        description="command: bytes kept "
        "of each of stdout and stderr (.tidal/stdout.log, "
        "stderr.log); the rest is dropped, marked in the log",
    )
    workers: int = Field(
        2,
        ge=1,
        le=64,
        description="python: worker processes the agent "
        "function (and the run's reward function) runs in",
    )


BUILTIN_SOURCES = ("arithmetic", "workspace")  # tidal.agents.builtin_tasks
_BUILTIN = "tidal.agents.builtin_tasks"


class TaskConfig(Strict):
    """The run's workload: task rows, how an execution is scored, what runs it. Absent: the
    built-in ``arithmetic`` source. A built-in source (``arithmetic``, ``workspace``) run by the
    ``chat`` kind gets its step and reward (``tidal.agents.builtin_tasks``) unless the config
    names its own."""

    source: TaskSourceConfig = Field(default_factory=lambda: TaskSourceConfig(kind="arithmetic"))
    reward: RewardConfig | None = Field(None, description="None: the agent returns rewards")
    agent: AgentConfig = Field(default_factory=AgentConfig)
    max_turns: int = Field(1, ge=1, description="model calls per execution at most")

    def with_builtin_defaults(self) -> TaskConfig:
        """This section with a built-in source's step and reward filled in where it names none
        (decided when the workload is built, never stored: ``--set task.source.kind=...`` on a
        resolved config picks the new source's)."""
        kind = self.source.kind
        if kind not in BUILTIN_SOURCES:
            return self
        update: dict[str, Any] = {}
        if self.agent.kind == "chat" and not self.agent.step:
            update["agent"] = self.agent.model_copy(update={"step": f"{_BUILTIN}:{kind}_step"})
        if self.reward is None:
            update["reward"] = RewardConfig(function=f"{_BUILTIN}:{kind}_reward")
        return self.model_copy(update=update)
