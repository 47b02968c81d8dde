"""A Python agent for tidal's ``python`` agent kind (configs/python-agent.yaml).

tidal calls ``solve`` once per execution with an ``openai.AsyncOpenAI`` client already bound
to that execution (its base URL and API key name it at tidal's proxy, so every token the model
samples here is recorded for training), the task row and the execution's workspace. This agent
answers, then is asked to check its answer, and returns its final text: the run's reward
function (``task.reward``) scores it. Return a number instead to give the reward yourself.
"""

from pathlib import Path

from openai import AsyncOpenAI

SYSTEM = "Reply with the answer only."


async def solve(client: AsyncOpenAI, row, workspace: Path, model: str) -> str:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": row.text()}]
    first = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=16, temperature=0.7
    )
    draft = first.choices[0].message.content or ""
    messages += [
        {"role": "assistant", "content": draft},
        {"role": "user", "content": "Check it. Reply with the final answer only."},
    ]
    final = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=16, temperature=0.7
    )
    answer = final.choices[0].message.content or ""
    (workspace / "answer.txt").write_text(answer)  # the workspace is this execution's own
    return answer
