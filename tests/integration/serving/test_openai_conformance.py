"""What harnesses send, driven with the official ``openai`` client against ``tidal proxy`` over a
built-in engine process: every implemented field (streamed and not) does what it says, a
tool-calling round trip through the model's own chat template, the token-in route, the weight
versions header, each refused field a 400 naming it, and 10 poisoned calls among 40 costing the
30 honest ones nothing; and verifiers' train client over the token-in route.

The tiny model carries a Hermes/Qwen2.5-style tools template and was taught (a few hundred
optimizer steps, ``tidal.testing.chat_models.teach``) to answer one weather question with one
tool call, so the round trip is the model's own greedy output, parsed back."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tidal.serving.execution_keys import execution_key, execution_url
from tidal.serving.launch import start_engine, start_proxy

openai = pytest.importorskip("openai")
TOKEN = "conformance-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    import torch

    from tidal.models import create_tiny
    from tidal.models.tokenizer import HFTokenizer
    from tidal.testing.chat_models import HERMES_TOOLS_TEMPLATE, set_template, teach

    torch.set_num_threads(1)
    d = create_tiny(
        tmp_path_factory.mktemp("tools") / "m",
        seed=3,
        max_seq_len=1024,
        n_layers=2,
        d_model=64,
        n_heads=2,
    )
    set_template(d, HERMES_TOOLS_TEMPLATE)
    tok = HFTokenizer(d)
    teach(d, tok.apply_chat_template(QUESTION, TOOLS), [*tok.encode(CALL), tok.eos_id], lr=1e-2)
    return d


@pytest.fixture(scope="module")
def served(tool_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    engine = start_engine(
        tool_model, name="tiny", max_batch=64, log_path=logs / "e.log", token=TOKEN
    ).wait_healthy(120)
    proxy = start_proxy([engine.url], [], TOKEN, cap=64, log_path=logs / "p.log")
    try:
        proxy.wait_healthy(60)
        yield proxy.url
    finally:
        proxy.stop()
        engine.stop()


def _client(url: str, eid: str):
    """A harness's client: its execution's base URL and key."""
    return openai.OpenAI(
        base_url=execution_url(url, eid), api_key=execution_key(TOKEN, eid), max_retries=0
    )


def _records(url: str, eid: str) -> list[dict]:
    return httpx.get(f"{url}/tidal/executions/{eid}/records", headers=ADMIN).json()["calls"]


def test_tool_call_round_trip(served, tool_model):
    oa = _client(served, "tools")
    first = oa.chat.completions.create(
        model="tiny", messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=64
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    streamed = list(
        oa.chat.completions.create(
            model="tiny", messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=64, stream=True
        )
    )
    deltas = [c.choices[0].delta for c in streamed if c.choices]
    s_calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert [tc.function.name for tc in s_calls] == ["get_weather"]
    assert streamed[-1].choices[0].finish_reason == "tool_calls"
    follow = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    second = oa.chat.completions.create(
        model="tiny", messages=follow, tools=TOOLS, max_tokens=4, temperature=0
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    from tidal.models.tokenizer import HFTokenizer

    calls = _records(served, "tools")
    assert len(calls) == 3 and calls[0]["output_token_ids"] == calls[1]["output_token_ids"]
    rendered = HFTokenizer(tool_model).decode(second.model_extra["prompt_token_ids"])
    assert CALL in rendered and "<tool_response>\nsunny, 21 C\n</tool_response>" in rendered


def test_sampling_fields_streamed_and_not(served):
    oa = _client(served, "fields")
    base = {
        "model": "tiny",
        "max_completion_tokens": 24,
        "temperature": 0,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Tell"}, {"type": "text", "text": "a story"}],
            }
        ],
        "extra_body": {"ignore_eos": True},
    }
    full = oa.chat.completions.create(**base)
    text = full.choices[0].message.content
    assert full.usage.completion_tokens == 24 and full.choices[0].finish_reason == "length"
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = oa.chat.completions.create(**base, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.find(stop)]
    rec = _records(served, "fields")[-1]
    assert (
        rec["output_token_ids"]
        == full.choices[0].model_extra["token_ids"][: len(rec["output_token_ids"])]
    )  # the tokens sampled up to the stop are kept
    pieces = list(
        oa.chat.completions.create(
            **base, stop=stop, stream=True, stream_options={"include_usage": True}
        )
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
        == text[: text.find(stop)]
    )
    assert pieces[-1].usage.completion_tokens == len(rec["output_token_ids"])
    two = oa.chat.completions.create(**{**base, "temperature": 1.0}, n=2, top_p=0.9, seed=5)
    assert [c.index for c in two.choices] == [0, 1]
    ids = [c.model_extra["token_ids"] for c in two.choices]
    assert ids[0] != ids[1]  # two samples, not one twice
    assert len(_records(served, "fields")) == 3 + 2  # each choice its own record chain
    two_s = list(
        oa.chat.completions.create(**{**base, "temperature": 1.0}, n=2, stream=True, seed=5)
    )
    assert {c.choices[0].index for c in two_s if c.choices} == {0, 1}
    comp = oa.completions.create(
        model="tiny",
        prompt="The agent",
        max_tokens=12,
        n=2,
        temperature=0.7,
        top_p=0.5,
        stop=[" "],
        logprobs=0,
    )
    assert len(comp.choices) == 2 and all(" " not in c.text for c in comp.choices)


def test_token_in_route_models_card_and_versions_header(served):
    r = httpx.post(
        f"{served}/v1/completions",
        json={"prompt": [3, 4, 5, 6], "max_tokens": 9, "temperature": 0, "ignore_eos": True},
    )
    assert r.headers["x-tidal-weight-versions"] == "0-9=v0"
    g = httpx.post(
        f"{served}/inference/v1/generate",
        headers={"X-Session-ID": "s1"},
        json={
            "model": "tiny",
            "token_ids": [3, 4, 5, 6],
            "sampling_params": {
                "max_tokens": 9,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": 1,
                "skip_special_tokens": False,
            },
        },
    )
    assert g.status_code == 200, g.text
    body = g.json()
    choice = body["choices"][0]
    assert choice["token_ids"] == r.json()["choices"][0]["token_ids"]
    assert body["prompt_token_ids"] == [3, 4, 5, 6]
    assert [e["token"] for e in choice["logprobs"]["content"]] == [
        f"token_id:{t}" for t in choice["token_ids"]
    ]
    assert g.headers["x-tidal-weight-versions"] == "0-9=v0"
    bad = httpx.post(
        f"{served}/inference/v1/generate",
        json={"token_ids": [3], "sampling_params": {"repetition_penalty": 1.3}},
    )
    assert bad.status_code == 400 and "repetition_penalty" in bad.text
    card = httpx.get(f"{served}/v1/models").json()["data"][0]
    assert card["id"] == "tiny" and card["max_model_len"] == 1024


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
        ({"top_logprobs": 2, "logprobs": True}, "top_logprobs"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "data:,"}}],
                    }
                ]
            },
            "messages.0.content.0",
        ),
        ({"extra_body": {"min_p": 0.1}}, "min_p"),
    ],
)
def test_refused_fields_are_named(served, extra, field):
    oa = _client(served, "refused")
    body = {"model": "tiny", "messages": QUESTION, "max_tokens": 2, **extra}
    with pytest.raises(openai.BadRequestError) as info:
        oa.chat.completions.create(**body)
    assert field in str(info.value)


def test_verifiers_train_client_over_the_token_in_route(served, tool_model):
    """verifiers' own train-client path (``renderers.client.generate``, what ``verifiers.v1``'s
    ``TrainClient`` calls per turn: it renders the prompt, reads ``max_model_len`` from
    ``/v1/models``, posts the token-in route with ``X-Session-ID``, checks every log-prob entry)
    over reasoning-gym questions (generated locally), via tidal's verifiers agent kind: the
    proxy's records hold exactly the ids and log-probs verifiers received."""
    reasoning_gym = pytest.importorskip("reasoning_gym")
    pytest.importorskip("renderers")
    from tidal.agents.verifiers_kind import make_renderer, run_episode

    renderer = make_renderer(str(tool_model))
    dataset = reasoning_gym.create_dataset("basic_arithmetic", size=3, seed=7)

    async def episode(i: int, entry: dict) -> tuple[dict, float]:
        out = await run_episode(
            execution_url(served, f"vf{i}"),
            execution_key(TOKEN, f"vf{i}"),
            "tiny",
            renderer,
            [{"role": "user", "content": entry["question"]}],
            {"max_tokens": 12, "temperature": 1.0, "top_p": 0.95},
            session=f"vf{i}",
        )
        return out, float(dataset.score_answer(out["content"] or "", entry))

    async def main():
        return await asyncio.gather(*[episode(i, e) for i, e in enumerate(dataset)])

    for i, (out, reward) in enumerate(asyncio.run(main())):
        [call] = _records(served, f"vf{i}")
        assert call["prompt_token_ids"] == out["prompt_ids"]
        assert call["output_token_ids"] == out["completion_ids"] and out["completion_ids"]
        logprobs = [lp for s in call["segments"] for lp in s["logprobs"]]
        assert logprobs == pytest.approx(out["completion_logprobs"])
        assert 0.0 <= reward <= 1.0


def test_poisoned_sampling_fails_alone(served):
    """40 concurrent calls, 10 with a temperature no engine can sample with: those 10 are
    refused by name, the 30 honest ones come back whole (on main they failed with their
    batch)."""

    async def one(client, i: int):
        poisoned = i % 4 == 0
        body = {
            "prompt": [3 + i, 4, 5],
            "max_tokens": 24,
            "ignore_eos": True,
            "temperature": 1e-300 if poisoned else 1.0,
        }
        r = await client.post("/v1/completions", json=body)
        return poisoned, r.status_code, r.json()

    async def main():
        async with httpx.AsyncClient(base_url=served, timeout=120) as client:
            return await asyncio.gather(*[one(client, i) for i in range(40)])

    results = asyncio.run(main())
    honest = [(s, b) for p, s, b in results if not p]
    poisoned = [(s, b) for p, s, b in results if p]
    assert len(honest) == 30 and len(poisoned) == 10
    assert all(s == 200 and len(b["choices"][0]["token_ids"]) == 24 for s, b in honest)
    assert all(s == 400 and "temperature" in b["error"]["message"] for s, b in poisoned)
