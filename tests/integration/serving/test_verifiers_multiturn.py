"""A multi-turn verifiers.v1 episode (``verifiers_env_episode.run_task``) against ``tidal proxy``
over a built-in engine process on loopback: the feedback environment
(``reasoning_gym_feedback_env``) answers every wrong reply with a user turn, so each episode
makes ``max_turns`` calls through verifiers' ``TrainClient`` to the token-in route. Checked: the
proxy recorded one call per turn holding exactly the prompt ids, sampled ids and log-probs
verifiers received; the training sequences built from that record train on exactly the sampled
ids of every turn, in order (invariant 8); a task without ``feedback`` stops after one turn;
the reward is the task's own score of the last answer."""

from __future__ import annotations

import asyncio
import importlib.util

import httpx
import pytest

from tidal.serving.execution_keys import execution_key, execution_url
from tidal.serving.launch import start_engine, start_proxy

if importlib.util.find_spec("verifiers") is None or importlib.util.find_spec("renderers") is None:
    pytest.skip("verifiers 0.4 is not installed (the 'verifiers' extra)", allow_module_level=True)
TOKEN = "multiturn-token"
ENV_ARGS = {"name": "spell_backward", "size": 3, "seed": 0, "system_prompt": "Reverse it."}
SAMPLING = {"max_tokens": 6, "temperature": 1.0}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tidal.models import create_tiny

    root = tmp_path_factory.mktemp("multiturn")
    model = create_tiny(root / "m", seed=1, n_layers=1, d_model=32, n_heads=2, max_seq_len=512)
    engine = start_engine(
        model, name="tiny", max_batch=8, log_path=root / "e.log", token=TOKEN
    ).wait_healthy(120)
    proxy = start_proxy([engine.url], [], TOKEN, cap=8, log_path=root / "p.log")
    try:
        proxy.wait_healthy(60)
        yield proxy.url, str(model)
    finally:
        proxy.stop()
        engine.stop()


def _record(url: str, eid: str):
    from tidal.training.records import record_from_proxy

    calls = httpx.get(
        f"{url}/tidal/executions/{eid}/records",
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=30,
    ).json()["calls"]
    return record_from_proxy(eid, "g", calls, 0.0)


def _episodes(url: str, model: str, tasks: list, prefix: str, max_turns: int) -> list:
    from tidal.agents.verifiers_env_episode import run_task

    async def main():
        return await asyncio.gather(
            *[
                run_task(
                    task,
                    execution_url(url, f"{prefix}{i}"),
                    execution_key(TOKEN, f"{prefix}{i}"),
                    "tiny",
                    model,
                    SAMPLING,
                    session=f"{prefix}{i}",
                    max_turns=max_turns,
                )
                for i, task in enumerate(tasks)
            ]
        )

    return asyncio.run(main())


def test_every_turn_goes_through_the_token_in_route_and_trains_as_sampled(served):
    from tidal.agents.verifiers_envs import reasoning_gym_feedback_env
    from tidal.training.records import record_to_sequences

    url, model = served
    tasks = list(reasoning_gym_feedback_env(**ENV_ARGS))
    for i, out in enumerate(_episodes(url, model, tasks, "mt", max_turns=3)):
        # a random tiny model never spells a word backward: every answer gets feedback
        assert out.reward < 1.0 and list(out.rewards) == ["correct"]
        assert len(out.turns) == 3
        assert [t["feedback"] is not None for t in out.turns] == [True, True, False]
        assert out.turns[0]["feedback"].startswith("Not right")
        record = _record(url, f"mt{i}")
        assert len(record.calls) == 3
        for call, turn in zip(record.calls, out.turns, strict=True):
            assert call.prompt_token_ids == turn["prompt_ids"]
            assert call.output_token_ids == turn["completion_ids"] and turn["completion_ids"]
            assert call.output_logprobs == pytest.approx(turn["logprobs"])
        # each turn's prompt carries the feedback message after the previous answer
        assert len(out.turns[1]["prompt_ids"]) > sum(
            len(out.turns[0][k]) for k in ("prompt_ids", "completion_ids")
        )
        trained = [
            tok
            for seq in record_to_sequences(record)
            for tok, m in zip(seq.token_ids, seq.trainable, strict=True)
            if m
        ]
        assert trained == [tok for t in out.turns for tok in t["completion_ids"]]
        # the verifiers trace's last branch ends with the last turn as the engine sampled it
        last = out.turns[-1]
        assert out.token_ids == last["prompt_ids"] + last["completion_ids"]
        assert out.sampled_mask[-len(last["completion_ids"]) :] == [True] * len(
            last["completion_ids"]
        )


def test_a_task_without_feedback_is_single_turn(served):
    from tidal.agents.verifiers_envs import reasoning_gym_env

    url, model = served
    tasks = list(reasoning_gym_env(**ENV_ARGS))[:1]
    [out] = _episodes(url, model, tasks, "st", max_turns=3)
    assert len(out.turns) == 1 and out.turns[0]["feedback"] is None
    [call] = _record(url, "st0").calls
    assert call.output_token_ids == out.turns[0]["completion_ids"]
