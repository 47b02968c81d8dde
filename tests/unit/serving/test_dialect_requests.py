"""The Messages and Responses bodies as the chat route takes them (no engine): blocks and items
become chat messages and tool calls, sampling fields carry over, and what is not implemented is
refused by name. The SDK-driven round trips are in tests/integration/serving/test_dialects.py."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from tidal.serving.anthropic_api import MessagesRequest
from tidal.serving.anthropic_api import to_chat as messages_to_chat
from tidal.serving.dialects import chat_request
from tidal.serving.openai_api import validation_message
from tidal.serving.protocol import BadRequest
from tidal.serving.responses_api import ResponsesRequest
from tidal.serving.responses_api import to_chat as responses_to_chat

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}


def test_messages_blocks_become_chat_messages():
    body = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 9,
            "temperature": 0.5,
            "top_k": 4,
            "stop_sequences": ["x"],
            "system": [
                {"type": "text", "text": "a"},
                {"type": "text", "text": "b", "cache_control": {"type": "ephemeral"}},
            ],
            "tools": [{"name": "w", "input_schema": SCHEMA}],
            "tool_choice": {"type": "auto"},
            "messages": [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "let me see"},
                        {"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "P"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [{"type": "text", "text": "sunny"}],
                        },
                        {"type": "text", "text": "and?"},
                    ],
                },
                {"role": "system", "content": "mid"},
            ],
        }
    )
    chat = chat_request(messages_to_chat(body))
    msgs = chat.template_messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "user", "system"]
    assert msgs[0]["content"] == "a\nb"
    assert msgs[2]["content"] == "let me see"
    assert msgs[2]["tool_calls"][0]["function"] == {"name": "w", "arguments": {"city": "P"}}
    assert msgs[3] == {"role": "tool", "content": "sunny", "tool_call_id": "t1"}
    assert chat.template_tools()[0]["function"]["parameters"] == SCHEMA
    p = chat.sampling()
    assert (p.max_tokens, p.temperature, p.top_k, p.stop) == (9, 0.5, 4, ["x"])
    assert chat.parses_tools


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"thinking": {"type": "adaptive"}}, "thinking.type"),
        ({"output_config": {"effort": "high"}}, "output_config"),
        ({"tool_choice": {"type": "tool", "name": "w"}}, "tool_choice.type"),
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            "messages.0.content",
        ),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools.0"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": [
                            {
                                "type": "tool_use",
                                "id": "t",
                                "name": "w",
                                "input": {},
                                "caller": {"type": "x"},
                            }
                        ],
                    }
                ]
            },
            "caller",
        ),
    ],
)
def test_messages_refusals_name_the_field(extra, field):
    with pytest.raises(ValidationError) as info:
        MessagesRequest.model_validate(
            {"max_tokens": 1, "messages": [{"role": "user", "content": "q"}], **extra}
        )
    assert field in validation_message(info.value.errors())


def test_responses_items_become_chat_messages():
    body = ResponsesRequest.model_validate(
        {
            "instructions": "be brief",
            "max_output_tokens": 7,
            "top_p": 0.5,
            "store": False,
            "include": ["reasoning.encrypted_content"],
            "reasoning": {"summary": "auto"},
            "tools": [{"type": "function", "name": "w", "parameters": SCHEMA, "strict": False}],
            "input": [
                {"role": "developer", "content": [{"type": "input_text", "text": "d"}]},
                {"type": "message", "role": "user", "content": "q"},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "ok", "annotations": []}],
                },
                {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "w", "arguments": '{"a": 1}'},
                {"type": "function_call_output", "call_id": "c1", "output": "r1"},
                {"type": "function_call_output", "call_id": "c2", "output": "r2"},
            ],
        }
    )
    chat = chat_request(responses_to_chat(body))
    msgs = chat.template_messages()
    assert [m["role"] for m in msgs] == ["system", "system", "user", "assistant", "tool", "tool"]
    assert [c["id"] for c in msgs[3]["tool_calls"]] == ["c1", "c2"]
    assert msgs[3]["content"] == "ok"
    assert chat.sampling().max_tokens == 7 and chat.sampling().top_p == 0.5
    assert json.loads(json.dumps(chat.template_tools()))[0]["function"]["name"] == "w"


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"reasoning": {"effort": "low"}}, "reasoning.effort"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
        ({"tools": [{"type": "namespace", "name": "n", "tools": []}]}, "tools.0"),
        ({"background": True}, "background"),
    ],
)
def test_responses_refusals_name_the_field(extra, field):
    with pytest.raises(ValidationError) as info:
        ResponsesRequest.model_validate({"input": "hi", **extra})
    assert field in validation_message(info.value.errors())


def test_a_chat_side_refusal_keeps_its_message():
    body = MessagesRequest.model_validate(
        {"max_tokens": 1, "temperature": 1e-9, "messages": [{"role": "user", "content": "q"}]}
    )
    with pytest.raises(BadRequest, match="temperature"):
        chat_request(messages_to_chat(body))
