"""A verifiers (``verifiers.v1``) environment built on a reasoning-gym dataset, in-process and
without network: the example that ``configs/verifiers.yaml`` trains.

In: a reasoning-gym dataset name, size, seed and generator args (rows generated here by
``reasoning_gym.create_dataset``, nothing downloaded), an optional system prompt. Out: a
``verifiers.v1.Taskset`` whose tasks carry the question as their prompt and the reasoning-gym
entry as data; the task's ``@vf.reward`` scores the trace's last assistant message with the
dataset's own ``score_answer``. Any ``verifiers.v1`` taskset whose tasks score offline (their
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


class ReasoningGymTaskset(vf.Taskset[ReasoningGymTask, vf.TasksetConfig]):
    """The dataset's entries in order, one task each."""

    def __init__(self, entries: list[dict[str, Any]], system_prompt: str | None) -> None:
        super().__init__(vf.TasksetConfig())
        self.entries, self.default_system_prompt = entries, system_prompt

    def load(self) -> Iterator[ReasoningGymTask]:
        for i, entry in enumerate(self.entries):
            data = ReasoningGymData(
                id=str(i),
                prompt=entry["question"],
                entry=entry,
                system_prompt=self.default_system_prompt,
            )
            yield ReasoningGymTask(data)


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
