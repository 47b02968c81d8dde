"""Sampling the engine can compute, and what it computes for the OpenAI fields: temperatures
below the floor refused by name; a request whose own sampling fails ends alone while its batch
goes on; top-p keeps the nucleus; stop strings end generation at the completing token with the
text cut before them; tool calls parsed back (hermes); a refused field named in the 400."""

from __future__ import annotations

import asyncio

import pytest
import torch
from pydantic import ValidationError

from tidal.models import load_model
from tidal.serving.chat import hermes
from tidal.serving.engine import Engine, EngineConfig
from tidal.serving.engine_state import nucleus
from tidal.serving.openai_api import ChatRequest, CompletionRequest, validation_message
from tidal.serving.protocol import GenerateRequest, SamplingParams, StopText
from tidal.serving.token_in import TokenInRequest


def _refusal(model, body: dict) -> str:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return validation_message(info.value.errors())


def test_tiny_positive_temperature_is_refused_by_name_and_zero_is_greedy():
    for t in (1e-300, 1e-38, 1e-4):
        assert _refusal(CompletionRequest, {"prompt": "a", "temperature": t}).startswith(
            "temperature:"
        )
        assert "temperature" in _refusal(
            TokenInRequest, {"token_ids": [3], "sampling_params": {"temperature": t}}
        )
    assert (
        CompletionRequest.model_validate({"prompt": "a", "temperature": 0}).sampling().temperature
        == 0.0
    )
    with pytest.raises(ValidationError):
        SamplingParams(temperature=1e-300)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"response_format": {"type": "json_object"}}, "response_format.type"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": 1}, "frequency_penalty"),
        ({"logit_bias": {"5": 2}}, "logit_bias"),
        (
            {"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f"}}]},
            "tool_choice",
        ),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ]
            },
            "messages.0.content.0",
        ),
    ],
)
def test_chat_fields_not_implemented_are_named(body, field):
    full = {"messages": [{"role": "user", "content": "hi"}], **body}
    assert field in _refusal(ChatRequest, full)


def test_completion_fields_not_implemented_are_named():
    for body, field in (
        ({"echo": True}, "echo"),
        ({"suffix": "x"}, "suffix"),
        ({"logprobs": 2}, "logprobs"),
        ({"best_of": 3}, "best_of"),
    ):
        assert field in _refusal(CompletionRequest, {"prompt": "a", **body})
    assert "sampling_params.repetition_penalty" in _refusal(
        TokenInRequest, {"token_ids": [3], "sampling_params": {"repetition_penalty": 1.2}}
    )


def test_content_parts_and_tools_reach_the_template():
    req = ChatRequest.model_validate(
        {
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": '{"x": 1}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "42"},
            ],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "max_completion_tokens": 7,
            "stop": "e",
            "top_p": 0.5,
        }
    )
    msgs = req.template_messages()
    assert msgs[0]["role"] == "system" and msgs[1]["content"] == "a\nb"
    assert msgs[2]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    params = req.sampling()
    assert (params.max_tokens, params.stop, params.top_p) == (7, ["e"], 0.5)


def test_nucleus_keeps_the_smallest_set_reaching_top_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert nucleus(probs, 0.7).tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0])
    assert nucleus(probs, 0.1).tolist() == pytest.approx([1.0, 0.0, 0.0, 0.0])


def test_stop_text_cuts_before_the_stop_string_and_holds_back_its_prefix():
    st = StopText(["END"])
    out = [st.feed("abc E"), st.feed("N"), st.feed("D tail"), st.feed("more", final=True)]
    assert "".join(out) == "abc " and out[0] == "abc"
    assert StopText(["END"]).feed("no stop here", final=True) == "no stop here"


def test_hermes_parser_reads_calls_and_keeps_other_text():
    text = (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
        '\n</tool_call><tool_call>{"name": "f", "arguments": "{}"}</tool_call>'
    )
    content, calls = hermes(text)
    assert content == "Let me look."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "f"]
    assert calls[0]["function"]["arguments"] == '{"city": "Paris"}'
    assert hermes("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])


def _engine(tiny_dir, **cfg) -> Engine:
    model, tok = load_model(tiny_dir)
    return Engine(model, tok, tiny_dir, EngineConfig(**cfg))


async def _run(engine, req):
    return [c async for c in engine.generate(req)]


def test_a_request_whose_sampling_fails_ends_alone(tiny_dir):
    """A poisoned temperature (what validation now refuses, forced past it here) in a batch
    of honest requests: it ends with ``error``, every other request runs to its full length,
    and the engine counts a sampling failure, not a failed step."""

    async def main():
        eng = _engine(tiny_dir, max_batch=16)
        await eng.start()
        reqs = []
        for i in range(12):
            poisoned = i % 4 == 0
            params = SamplingParams.model_construct(
                **{
                    **SamplingParams().model_dump(),
                    "max_tokens": 8,
                    "ignore_eos": True,
                    "temperature": 1e-300 if poisoned else (1.0 if i % 2 else 0.7),
                }
            )
            reqs.append((poisoned, GenerateRequest(f"r{i}", [3 + i, 4, 5], params)))
        outs = await asyncio.gather(*[_run(eng, r) for _, r in reqs])
        await eng.stop()
        return eng.totals, [(p, o) for (p, _), o in zip(reqs, outs, strict=True)]

    totals, outs = asyncio.run(main())
    for poisoned, chunks in outs:
        if poisoned:
            assert chunks[-1].finish_reason == "error"
        else:
            assert chunks[-1].finish_reason == "length"
            assert sum(len(c.token_ids) for c in chunks) == 8
    assert totals["step_failures"] == 0 and totals["sampling_failures"] == 3


def test_stop_string_ends_at_the_completing_token(tiny_dir):
    """Greedy output once without a stop, then with a stop string taken from inside it: the
    tokens end at the one completing it, the text ends before it."""

    async def main():
        eng = _engine(tiny_dir)
        await eng.start()
        base = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        full = await _run(eng, GenerateRequest("a", [3, 4, 5], base))
        ids = [t for c in full for t in c.token_ids]
        text = eng.tokenizer.decode(ids)
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        cut = await _run(
            eng, GenerateRequest("b", [3, 4, 5], base.model_copy(update={"stop": [stop]}))
        )
        await eng.stop()
        return eng.tokenizer, ids, text, stop, cut

    tok, ids, text, stop, cut = asyncio.run(main())
    got = [t for c in cut for t in c.token_ids]
    assert cut[-1].finish_reason == "stop" and got == ids[: len(got)]
    assert stop in tok.decode(got) and stop not in tok.decode(got[:-1])
    assert "".join(c.text for c in cut) == text[: text.find(stop)]


def test_a_template_without_tools_refuses_them_by_name(tiny_dir, serve_asgi):
    """SmolLM2's template (the tiny model's) never reads ``tools``: a chat call offering tools
    is a 400 naming ``tools`` (transformers would drop them silently), at the engine's chat
    route and at its ``/tokenize`` (where the proxy renders)."""
    import httpx

    from tidal.serving.engine_server import build_engine_app

    async def main():
        app = build_engine_app(_engine(tiny_dir), "tiny")
        tools = [{"type": "function", "function": {"name": "f"}}]
        msgs = [{"role": "user", "content": "hi"}]
        async with serve_asgi(app) as url, httpx.AsyncClient(base_url=url) as c:
            chat = await c.post("/v1/chat/completions", json={"messages": msgs, "tools": tools})
            tok = await c.post("/tokenize", json={"messages": msgs, "tools": tools})
            plain = await c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})
        return chat, tok, plain

    chat, tok, plain = asyncio.run(main())
    for r in (chat, tok):
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("tools:")
    assert plain.status_code == 200 and plain.headers["x-tidal-weight-versions"] == "0-2=v0"
