"""verifiers (``verifiers.v1``) environments built on a reasoning-gym dataset, in-process and
without network: the examples that ``configs/verifiers.yaml`` (single-turn) and
``configs/verifiers-multiturn.yaml`` (a feedback turn after every wrong answer) train.

In: a reasoning-gym dataset name, size, seed and generator args (rows generated here by
``reasoning_gym.create_dataset``, nothing downloaded), an optional system prompt. Out: a
``verifiers.v1.Taskset`` whose tasks carry the question as their prompt and the reasoning-gym
entry as data; the task's ``@vf.reward`` scores the trace's last assistant message with the
dataset's own ``score_answer``; the multi-turn task's ``feedback`` (the hook
``verifiers_env_episode`` asks between turns) tells the model its answer's score and asks again
until it is right. Any ``verifiers.v1`` taskset whose tasks score offline (their
reward functions take ``task`` and ``trace``, not ``runtime``) can stand in its place.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import verifiers.v1 as vf

from tidal.agents.verifiers_env_episode import last_answer


class ReasoningGymData(vf.TaskData):
    """One reasoning-gym entry: ``prompt`` is its question, ``entry`` the whole entry."""

    entry: dict[str, Any]


class ReasoningGymTask(vf.Task[ReasoningGymData, vf.State, vf.TaskConfig]):
    """A single-answer task scored by its dataset's ``score_answer`` (0..1)."""

    @vf.reward
    async def correct(self, task: ReasoningGymData, trace: vf.Trace) -> float:
        import reasoning_gym

        score = reasoning_gym.get_score_answer_fn(task.entry["metadata"]["source_dataset"])
        return float(score(last_answer(trace), task.entry))


class ReasoningGymFeedbackTask(ReasoningGymTask):
    """The same task, multi-turn: after a wrong answer the user says so and asks again."""

    retry: str = "Not right (score {score:.2f}). Try again: reply with the answer only."

    async def feedback(self, task: ReasoningGymData, trace: vf.Trace) -> str | None:
        """The next user message after a model turn; ``None`` (the answer is right) ends."""
        score = await self.correct(task, trace)
        return None if score >= 1.0 else self.retry.format(score=score)


class ReasoningGymTaskset(vf.Taskset[ReasoningGymTask, vf.TasksetConfig]):
    """The dataset's entries in order, one task each."""

    def __init__(
        self,
        entries: list[dict[str, Any]],
        system_prompt: str | None,
        task_type: type[ReasoningGymTask] = ReasoningGymTask,
    ) -> None:
        super().__init__(vf.TasksetConfig())
        self.entries, self.default_system_prompt = entries, system_prompt
        self.task_type = task_type

    def load(self) -> Iterator[ReasoningGymTask]:
        for i, entry in enumerate(self.entries):
            data = ReasoningGymData(
                id=str(i),
                prompt=entry["question"],
                entry=entry,
                system_prompt=self.default_system_prompt,
            )
            yield self.task_type(data)


def reasoning_gym_env(
    name: str,
    size: int,
    seed: int,
    args: dict[str, Any] | None = None,
    system_prompt: str | None = None,
) -> ReasoningGymTaskset:
    """The taskset of ``reasoning_gym.create_dataset(name, size=size, seed=seed, **args)``
    (``task.agent.args.environment: tidal.agents.verifiers_envs:reasoning_gym_env``)."""
    import reasoning_gym

    entries = list(reasoning_gym.create_dataset(name, size=size, seed=seed, **(args or {})))
    return ReasoningGymTaskset(entries, system_prompt)


def reasoning_gym_feedback_env(
    name: str,
    size: int,
    seed: int,
    args: dict[str, Any] | None = None,
    system_prompt: str | None = None,
) -> ReasoningGymTaskset:
    """``reasoning_gym_env``'s taskset, multi-turn: each task answers a wrong reply with a
    feedback turn (``task.agent.args.environment:
    tidal.agents.verifiers_envs:reasoning_gym_feedback_env``; turns up to ``task.max_turns``)."""
    taskset = reasoning_gym_env(name, size, seed, args, system_prompt)
    taskset.task_type = ReasoningGymFeedbackTask
    return taskset
