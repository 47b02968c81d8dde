"""The proxy's other dialects, driven with the official SDKs against ``tidal proxy`` over a
built-in engine process: Anthropic Messages with the ``anthropic`` client (streamed and not, a
tool round trip, ``count_tokens``, each refused field in Anthropic's error shape) and OpenAI
Responses with the ``openai`` client's ``responses.create`` (the same); each call's records hold
the ids the engine sampled (invariant 8), and the chat route's bridge holds across turns.

The tiny model carries a Hermes/Qwen2.5-style tools template and was taught
(``tidal.testing.chat_models.teach``) to answer one weather question with one tool call, so
the round trips are the model's own greedy output, parsed back into ``tool_use`` blocks and
``function_call`` items."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tidal.serving.execution_keys import execution_key, execution_url
from tidal.serving.launch import start_engine, start_proxy

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
TOKEN = "dialects-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": SCHEMA,
        },
    }
]
A_TOOLS = [{"name": "get_weather", "description": "Weather of a city", "input_schema": SCHEMA}]
R_TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": SCHEMA,
    }
]
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
GREEDY = {"temperature": 0}  # the SDK no longer names temperature, top_p, top_k: extra_body
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
        tool_model, name="tiny", max_batch=16, log_path=logs / "e.log", token=TOKEN
    ).wait_healthy(120)
    proxy = start_proxy([engine.url], [], TOKEN, cap=16, log_path=logs / "p.log")
    try:
        proxy.wait_healthy(60)
        yield proxy.url
    finally:
        proxy.stop()
        engine.stop()


def _records(url: str, eid: str) -> list[dict]:
    return httpx.get(f"{url}/tidal/executions/{eid}/records", headers=ADMIN).json()["calls"]


def _claude(url: str, eid: str):
    """A harness's Anthropic client: its execution's URL and key (sent as ``x-api-key``)."""
    return anthropic.Anthropic(
        base_url=execution_url(url, eid).removesuffix("/v1"),
        api_key=execution_key(TOKEN, eid),
        max_retries=0,
    )


def _openai(url: str, eid: str):
    return openai.OpenAI(
        base_url=execution_url(url, eid), api_key=execution_key(TOKEN, eid), max_retries=0
    )


def test_messages_tool_round_trip(served, tool_model):
    cl = _claude(served, "a-tools")
    first = cl.messages.create(
        model="tiny", max_tokens=64, messages=QUESTION, tools=A_TOOLS, extra_body=GREEDY
    )
    assert first.stop_reason == "tool_use", first
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    with cl.messages.stream(
        model="tiny", max_tokens=64, messages=QUESTION, tools=A_TOOLS, extra_body=GREEDY
    ) as s:
        events = [e.type for e in s]
        streamed = s.get_final_message()
    assert events[0] == "message_start" and "content_block_start" in events
    assert streamed.stop_reason == "tool_use"
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [{"city": "Paris"}]
    follow = [
        *QUESTION,
        {"role": "assistant", "content": [use.model_dump()]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": use.id,
                    "content": [{"type": "text", "text": "sunny, 21 C"}],
                }
            ],
        },
    ]
    second = cl.messages.create(
        model="tiny",
        max_tokens=4,
        messages=follow,
        tools=A_TOOLS,
        extra_body=GREEDY,
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        extra_headers={"anthropic-beta": "prompt-caching-2024-07-31"},
    )
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    calls = _records(served, "a-tools")
    assert len(calls) == 3
    assert calls[0]["output_token_ids"] == first.model_extra["tidal"]["token_ids"]
    assert calls[1]["output_token_ids"] == calls[0]["output_token_ids"]
    from tidal.models.tokenizer import HFTokenizer

    rendered = HFTokenizer(tool_model).decode(calls[2]["prompt_token_ids"])
    assert "Be brief." in rendered and "<tool_response>\nsunny, 21 C\n</tool_response>" in rendered
    assert '"city": "Paris"' in rendered
    n = cl.messages.count_tokens(model="tiny", messages=QUESTION, tools=A_TOOLS)
    assert n.input_tokens == len(calls[0]["prompt_token_ids"])


def test_messages_sampling_streamed_and_not(served):
    cl = _claude(served, "a-fields")
    base = {
        "model": "tiny",
        "max_tokens": 24,
        "extra_body": GREEDY,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Tell"}, {"type": "text", "text": "a story"}],
            }
        ],
    }
    full = cl.messages.create(**base)
    text = full.content[0].text
    assert full.usage.output_tokens == len(full.model_extra["tidal"]["token_ids"])
    assert full.usage.input_tokens == len(full.model_extra["tidal"]["prompt_token_ids"])
    if full.stop_reason == "max_tokens":
        assert full.usage.output_tokens == 24
    else:
        assert full.stop_reason == "end_turn"
    assert "".join(_texts(cl, base)) == text
    raw = [
        e.type
        for e in cl.messages.create(
            **{**base, "extra_body": {"top_k": 5, "top_p": 0.9}}, stream=True
        )
    ]
    assert raw[0] == "message_start" and raw[-2:] == ["message_delta", "message_stop"]
    assert len(text) > 8, text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = cl.messages.create(**base, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.find(stop)]
    with pytest.raises(anthropic.BadRequestError):
        cl.messages.create(**{**base, "extra_body": {"temperature": 1e-30}})
    assert len(_records(served, "a-fields")) >= 3


def _texts(cl, base) -> list[str]:
    out = []
    with cl.messages.stream(**base) as s:
        out.extend(s.text_stream)
    return out


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"tool_choice": {"type": "any"}, "tools": A_TOOLS}, "tool_choice"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/png",
                                    "data": "AA==",
                                },
                            }
                        ],
                    }
                ]
            },
            "messages.0.content.0",
        ),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0"),
        ({"extra_body": {"output_config": {"effort": "high"}}}, "output_config"),
        ({"extra_body": {"context_management": {"edits": []}}}, "context_management"),
    ],
)
def test_messages_refused_fields_are_named(served, extra, field):
    cl = _claude(served, "a-refused")
    body = {"model": "tiny", "max_tokens": 2, "messages": QUESTION, **extra}
    with pytest.raises(anthropic.BadRequestError) as info:
        cl.messages.create(**body)
    assert field in str(info.value)
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert _records(served, "a-refused") == []


def test_messages_headers_and_beta_query(served):
    r = httpx.post(
        f"{served}/v1/messages?beta=true",
        json={"model": "tiny", "max_tokens": 3, "messages": QUESTION, "metadata": {"user_id": "u"}},
        headers={
            "anthropic-version": "2023-06-01",
            "x-api-key": execution_key(TOKEN, "a-beta"),
            "anthropic-beta": "claude-code-20250219",
            "X-Tidal-Execution": "a-beta",
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["type"] == "message" and r.headers["x-tidal-weight-versions"]
    gone = httpx.post(
        f"{served}/v1/messages", json={"model": "nope", "max_tokens": 3, "messages": QUESTION}
    )
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "not_found_error"


def test_responses_tool_round_trip(served):
    oa = _openai(served, "r-tools")
    first = oa.responses.create(
        model="tiny",
        input=QUESTION,
        tools=R_TOOLS,
        temperature=0,
        max_output_tokens=64,
        store=False,
    )
    [call] = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    events = list(
        oa.responses.create(
            model="tiny",
            input=QUESTION,
            tools=R_TOOLS,
            temperature=0,
            max_output_tokens=64,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [json.loads(i.arguments) for i in done if i.type == "function_call"] == [
        {"city": "Paris"}
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    second = oa.responses.create(
        model="tiny",
        instructions="Be brief.",
        tools=R_TOOLS,
        temperature=0,
        max_output_tokens=4,
        input=[
            *QUESTION,
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
        ],
    )
    assert second.status in ("completed", "incomplete")
    calls = _records(served, "r-tools")
    assert len(calls) == 3 and calls[0]["output_token_ids"] == calls[1]["output_token_ids"]
    assert calls[0]["output_token_ids"] == first.model_extra["tidal"]["token_ids"]
    assert second.usage.input_tokens == len(calls[2]["prompt_token_ids"])


def test_responses_text_streamed_and_not(served):
    oa = _openai(served, "r-fields")
    base = {
        "model": "tiny",
        "input": "Tell a story",
        "max_output_tokens": 16,
        "temperature": 0,
        "top_p": 1.0,
    }
    whole = oa.responses.create(**base)
    events = list(oa.responses.create(**base, stream=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1].response
    assert final.usage.output_tokens == whole.usage.output_tokens
    if whole.usage.output_tokens == 16:
        assert whole.status == "incomplete" and events[-1].type == "response.incomplete"
    calls = _records(served, "r-fields")
    assert calls[0]["output_token_ids"] == calls[1]["output_token_ids"]


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
        ({"tools": [{"type": "web_search"}]}, "tools.0"),
        ({"tool_choice": "required", "tools": R_TOOLS}, "tool_choice"),
        (
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}
                ]
            },
            "input",
        ),
        ({"text": {"format": {"type": "json_object"}}}, "text"),
    ],
)
def test_responses_refused_fields_are_named(served, extra, field):
    oa = _openai(served, "r-refused")
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2, **extra}
    with pytest.raises(openai.BadRequestError) as info:
        oa.responses.create(**body)
    assert field in str(info.value)
    assert _records(served, "r-refused") == []


def _engine_stats(url: str) -> dict:
    [engine] = httpx.get(f"{url}/tidal/engines", headers=ADMIN).json()["engines"]
    return httpx.get(f"{engine['url']}/stats", headers=ADMIN).json()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/messages", {"max_tokens": 900, "messages": [{"role": "user", "content": "Go on"}]}),
        ("/v1/responses", {"max_output_tokens": 900, "input": "Go on"}),
    ],
)
def test_a_caller_that_hangs_up_cancels_its_whole_call(served, path, body):
    """A non-streamed Messages or Responses call whose HTTP client goes away mid-generation
    is cancelled as a chat call is: its engine request is aborted (the engine stops sampling
    for it), nothing is left in flight, and no call is recorded for it."""
    eid = f"gone{path.replace('/', '-')}"
    url = execution_url(served, eid).removesuffix("/v1") + path
    head = {"Authorization": f"Bearer {execution_key(TOKEN, eid)}"}
    body = {"model": "tiny", "temperature": 0, **body}
    # the same greedy call, whole, samples hundreds of tokens (so the one below is mid-way)
    t0 = time.monotonic()
    whole = httpx.post(url, json=body, headers=head, timeout=60)
    took = time.monotonic() - t0
    usage = whole.json()["usage"]
    # long enough that a client hanging up at a quarter of it is mid-way (0.5 s on an idle CI)
    assert usage["output_tokens"] >= 500 and took > 0.2, (usage, took)
    before = _engine_stats(served)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json=body, headers=head, timeout=httpx.Timeout(60, read=took / 4))
    end = time.monotonic() + 10
    while time.monotonic() < end:
        stats, proxy = _engine_stats(served), httpx.get(f"{served}/tidal/stats", headers=ADMIN)
        if stats["aborted"] > before["aborted"] and not proxy.json()["inflight"]:
            break
        time.sleep(0.05)
    assert stats["aborted"] == before["aborted"] + 1 and not stats["running"], stats
    sampled = stats["generated_tokens"] - before["generated_tokens"]
    assert 0 < sampled < usage["output_tokens"], (sampled, usage)
    assert len(_records(served, eid)) == 1  # the whole call's; the cancelled one is not kept
