"""One episode of a ``verifiers.v1`` environment's task, in-process: each turn goes through
verifiers' own ``TrainClient`` (it renders the prompt with the model's chat template and posts
the proxy's token-in route ``/inference/v1/generate``), is committed to a ``vf.Trace`` as
verifiers' interception server commits it (``graph.prepare_turn`` then ``commit``), and the
task's own rewards score the trace (``Task.score`` offline: no runtime).

Multi-turn: a task with an async ``feedback(data, trace) -> str | None`` method (tidal's hook;
verifiers 0.4.0 drives multi-turn only through harness programs) is asked after every model
turn; a string is the next user message, ``None`` ends the episode, and so does ``max_turns``.
The next turn's prompt is the conversation so far: ``TrainClient`` bridges it onto the
previous turn's prompt and sampled ids (``renderer.bridge_to_next_turn``; for a model without a
hand-coded renderer, ``verifiers_bridge.ChainRenderer``), so the trace's one branch and the
proxy's record hold every turn's sampled ids unchanged: one token chain per episode.

Why not ``Env.run_episode``: in verifiers 0.4.0 an episode runs a harness *program* (even the
tool-less ``null`` harness) as a PEP 723 script through ``uv sync --script`` in a runtime,
which installs the script's dependencies from the network (and ``uv`` itself when missing);
tidal runs offline. The model turn, the trace and the scoring here are verifiers' own code.

In: the environment's task, the execution's base URL and key, the tokenizer directory (the
renderer's model), the sampling settings. Out: ``EpisodeResult``: the answer, the trace's
reward, and the trace's token ids, sampled mask and log-probs (what prime-rl trains on).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from verifiers.v1 import Task, Trace
    from verifiers.v1.clients.train import TrainClient


@dataclass
class EpisodeResult:
    answer: str
    reward: float
    token_ids: list[int]
    sampled_mask: list[bool]
    logprobs: list[float]
    rewards: dict[str, float]
    turns: list[dict] = field(default_factory=list)


def task_messages(task: Task) -> list[dict]:
    """The chat messages a task opens with: its system prompt, then its prompt."""
    data = task.data
    head = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        return [*head, {"role": "user", "content": data.prompt}]
    return [*head, *[m.model_dump(exclude_none=True) for m in data.prompt or []]]


def train_client(base_url: str, api_key: str, tokenizer_dir: str) -> TrainClient:
    """verifiers' ``TrainClient`` over ``base_url`` (an OpenAI ``/v1`` base), its renderer
    pinned to the local model directory ``tokenizer_dir``. Every execution has its own key:
    it goes in as the Authorization header (the client's own key variable is left unset)."""
    import verifiers.v1 as vf
    from renderers.base import MODEL_RENDERER_MAP
    from renderers.configs import CustomRendererConfig
    from verifiers.v1.clients.train import TrainClient

    from tidal.agents.verifiers_bridge import IMPORT_PATH

    # a model without a hand-coded renderer gets the template's own render, bridged across
    # turns on the sampled ids (verifiers_bridge); a mapped one keeps its own renderer
    renderer = (
        None
        if tokenizer_dir in MODEL_RENDERER_MAP
        else CustomRendererConfig(import_path=IMPORT_PATH)
    )
    return TrainClient(
        vf.TrainClientConfig(
            base_url=base_url,
            renderer=renderer,
            renderer_model_name=tokenizer_dir,
            api_key_var="TIDAL_VERIFIERS_NO_KEY",
            headers={"Authorization": f"Bearer {api_key}"},
        )
    )


def renderers_lock_for_this_loop() -> None:
    """renderers keeps one module-level ``asyncio.Lock`` (``renderers.client``), bound to the
    first loop that waits on it; a process that runs episodes on more than one loop (one
    ``asyncio.run`` per run) gets a fresh one for the running loop."""
    import asyncio

    from renderers import client as rclient

    lock = getattr(rclient, "_max_prompt_len_lock", None)
    if lock is not None and getattr(lock, "_loop", None) not in (None, asyncio.get_running_loop()):
        rclient._max_prompt_len_lock = asyncio.Lock()


def last_answer(trace: Trace) -> str:
    """The text of the trace's last assistant message ("" when it has none)."""
    for node in reversed(trace.nodes):
        if node.message.role == "assistant":
            content = node.message.content
            return content if isinstance(content, str) else ""
    return ""


async def run_task(
    task: Task,
    base_url: str,
    api_key: str,
    model: str,
    tokenizer_dir: str,
    sampling: dict,
    session: str,
    max_turns: int = 1,
) -> EpisodeResult:
    """One episode of ``task`` (a ``verifiers.v1.Task``): up to ``max_turns`` model turns, a
    feedback message between two (when the task has ``feedback``), scored by its rewards."""
    import verifiers.v1 as vf
    from verifiers.v1 import graph
    from verifiers.v1.dialects.chat import ChatDialect
    from verifiers.v1.types import UserMessage

    dialect = ChatDialect()
    body = {"model": model, "messages": task_messages(task)}
    request = dialect.parse_request(body)
    prompt, tools = list(request.messages), request.tools
    trace = vf.Trace(
        task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        agent=vf.AgentInfo(config=vf.AgentConfig()),
    )
    feedback = getattr(task, "feedback", None)
    turns: list[dict] = []
    renderers_lock_for_this_loop()
    client = train_client(base_url, api_key, tokenizer_dir)
    try:
        while True:
            turn = graph.prepare_turn(trace, prompt, tools)
            response = await client.get_response(
                dialect, body, vf.SamplingConfig(**sampling), session_id=session, turn=turn
            )
            turn.commit(response)
            tokens = response.tokens
            turns.append(
                {
                    "prompt_ids": list(tokens.prompt_ids),
                    "completion_ids": list(tokens.completion_ids),
                    "logprobs": list(tokens.completion_logprobs),
                    "bridged": bool(tokens.bridged),
                    "content": response.message.content or "",
                    "feedback": None,
                }
            )
            prompt = [*prompt, response.message]
            if len(turns) >= max_turns or feedback is None:
                break
            note = await feedback(task.data, trace)
            if note is None:
                break
            turns[-1]["feedback"] = str(note)
            prompt.append(UserMessage(content=str(note)))
    finally:
        await client.close()
    trace.is_completed = trace.ok = True
    await task.score(trace)
    branch = trace.branches[-1]
    return EpisodeResult(
        answer=last_answer(trace),
        reward=float(trace.reward),
        token_ids=list(branch.token_ids),
        sampled_mask=list(branch.sampled_mask),
        logprobs=list(branch.logprobs),
        rewards={k: r.value for k, r in trace.rewards.items() if r is not None},
        turns=turns,
    )
