"""The verifiers agent kind checks its settings before a run starts: one line naming the field."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tidal.agents.verifiers_kind import VerifiersKind
from tidal.errors import ConfigError

pytest.importorskip("renderers")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tidal.models import create_tiny

    return create_tiny(
        tmp_path_factory.mktemp("tiny") / "m",
        seed=1,
        n_layers=1,
        d_model=32,
        n_heads=2,
        max_seq_len=128,
    )


def test_settings_are_checked_by_name(tiny_dir):
    with pytest.raises(ConfigError, match=r"task.agent.args.tokenizer"):
        VerifiersKind(SimpleNamespace(args={}))
    with pytest.raises(ConfigError, match=r"task.agent.args.temperature"):
        VerifiersKind(SimpleNamespace(args={"tokenizer": str(tiny_dir), "temperature": 1}))
    with pytest.raises(ConfigError, match=r"task.agent.args"):
        VerifiersKind(SimpleNamespace(args={"tokenizer": str(tiny_dir), "renderer": "qwen3"}))
    kind = VerifiersKind(SimpleNamespace(args={"tokenizer": str(tiny_dir)}))
    assert kind.renderer.render(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True
    ).token_ids


ENV = "tidal.agents.verifiers_envs:reasoning_gym_env"
ENV_ARGS = {"name": "spell_backward", "size": 3, "seed": 0, "system_prompt": "Reverse it."}


def test_environment_is_checked_by_name(tiny_dir):
    base = {"tokenizer": str(tiny_dir)}
    with pytest.raises(ConfigError, match=r"task.agent.args.environment: .*no attribute"):
        VerifiersKind(SimpleNamespace(args={**base, "environment": "tidal.agents:nope"}))
    with pytest.raises(ConfigError, match=r"task.agent.args.environment: .*raised TypeError"):
        VerifiersKind(
            SimpleNamespace(args={**base, "environment": ENV, "environment_args": {"nom": "x"}})
        )
    with pytest.raises(ConfigError, match=r"task.agent.args.environment: .*not a finite"):
        VerifiersKind(
            SimpleNamespace(
                args={**base, "environment": "json:dumps", "environment_args": {"obj": 1}}
            )
        )
    with pytest.raises(ConfigError, match=r"task.agent.args.tool_parser: not used"):
        VerifiersKind(SimpleNamespace(args={**base, "environment": ENV, "tool_parser": "qwen3"}))
    with pytest.raises(ConfigError, match=r"task.agent.args.environment_args: needs"):
        VerifiersKind(SimpleNamespace(args={**base, "environment_args": {}}))
    with pytest.raises(ConfigError, match=r"task.agent.args.environment_args: a mapping"):
        VerifiersKind(SimpleNamespace(args={**base, "environment": ENV, "environment_args": [1]}))


def test_rows_meet_their_environment_task_or_fail(tiny_dir):
    from tidal.agents.tasks import TaskRow
    from tidal.agents.verifiers_kind import task_for_row

    kind = VerifiersKind(
        SimpleNamespace(
            args={"tokenizer": str(tiny_dir), "environment": ENV, "environment_args": ENV_ARGS}
        )
    )
    assert len(kind.tasks) == 3
    task = kind.tasks[1]
    assert task.data.system_prompt == "Reverse it." and task.data.entry["answer"]
    assert task_for_row(kind.tasks, TaskRow(1, prompt=task.data.prompt)) is task
    with_system = TaskRow(
        1,
        messages=[
            {"role": "system", "content": "s"},
            {"role": "user", "content": task.data.prompt},
        ],
    )
    assert task_for_row(kind.tasks, with_system) is task
    with pytest.raises(ValueError, match="another prompt"):
        task_for_row(kind.tasks, TaskRow(2, prompt=task.data.prompt))
    with pytest.raises(ValueError, match="has 3 tasks"):
        task_for_row(kind.tasks, TaskRow(3, prompt="x"))


def test_environment_reward_scores_the_trace_offline():
    """The example task's reward is reasoning-gym's score of the trace's last answer."""
    import asyncio

    import verifiers.v1 as vf
    from verifiers.v1.types import AssistantMessage

    from tidal.agents.verifiers_envs import reasoning_gym_env

    [task] = list(reasoning_gym_env(**{**ENV_ARGS, "size": 1}))
    answer = task.data.entry["answer"]
    for text, want in ((answer, 1.0), ("", 0.0)):
        trace = vf.Trace(
            task=vf.TraceTask(type="t", data=task.data), agent=vf.AgentInfo(config=vf.AgentConfig())
        )
        trace.nodes.append(vf.MessageNode(message=AssistantMessage(content=text)))
        asyncio.run(task.score(trace))
        assert trace.reward == want and list(trace.rewards) == ["correct"]


def test_check_rows_names_the_environment_args(tiny_dir):
    """A task source that is not the environment's data is refused before a run starts."""
    from tidal.agents.tasks import TaskRow

    kind = VerifiersKind(
        SimpleNamespace(
            args={"tokenizer": str(tiny_dir), "environment": ENV, "environment_args": ENV_ARGS}
        )
    )
    kind.check_rows([TaskRow(i, prompt=t.data.prompt) for i, t in enumerate(kind.tasks)])
    with pytest.raises(ConfigError, match=r"task.agent.args.environment_args: task row 0"):
        kind.check_rows([TaskRow(0, prompt="Spell 'cat' backward.")])


@pytest.mark.parametrize("stopped", [True, False])
def test_chain_renderer_extends_the_sampled_ids(tiny_dir, stopped):
    """The next turn's prompt is the last prompt and sampled ids verbatim, then what the chat
    template adds (the assistant's close, less a sampled stop token; the new user turn; the
    generation prompt): its text is the template's full render of the conversation, though
    the sampled ids are not what re-tokenizing the answer's text gives."""
    from transformers import AutoTokenizer

    from tidal.agents.verifiers_bridge import ChainRenderer

    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    renderer = ChainRenderer(tok)
    first = [{"role": "system", "content": "Reply briefly."}, {"role": "user", "content": "cat"}]
    prompt = renderer.render(first, add_generation_prompt=True).token_ids
    answer = "tac"
    # sampled one character at a time: not the tokenizer's own split of "tac"
    sampled = [i for ch in answer for i in tok.encode(ch, add_special_tokens=False)]
    assert sampled != tok.encode(answer, add_special_tokens=False)
    sampled += renderer.get_stop_token_ids()[:1] if stopped else []
    new = [{"role": "user", "content": "Wrong, try again."}]
    out = renderer.bridge_to_next_turn(prompt, sampled, new)
    assert out.token_ids[: len(prompt) + len(sampled)] == prompt + sampled
    full = [*first, {"role": "assistant", "content": answer}, *new]
    assert tok.decode(out.token_ids) == tok.apply_chat_template(
        full, tokenize=False, add_generation_prompt=True
    )
    added = out.message_indices[len(prompt) + len(sampled) :]
    assert 0 in added and set(added) == {-1, 0}
    assert renderer.bridge_to_next_turn(prompt, sampled, [full[2]]) is None  # an assistant turn
