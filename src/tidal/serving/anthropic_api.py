"""Anthropic's Messages API on the proxy (``POST /v1/messages``, ``/v1/messages/count_tokens``):
what Claude Code and the ``anthropic`` SDK send, answered by tidal's engines through the chat
route's internals (``tidal.serving.dialects``).

In: a Messages body: ``system`` (text or text blocks), ``messages`` (text, ``tool_use`` and
``tool_result`` blocks), ``tools`` (custom tools) and ``tool_choice`` ``auto``/``none``,
``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stop_sequences``, ``stream``;
``anthropic-version`` / ``anthropic-beta`` headers and ``?beta=true`` are accepted. Accepted
without effect (they cannot change what is sampled): ``cache_control`` hints (top level, on
blocks and tools), ``metadata``, ``service_tier``, ``thinking`` ``disabled``, ``caller`` and
``toolset_name`` null, a tool result's ``is_error`` (rendered as its text). Any other field
or block (images, documents, thinking blocks and budgets, server tools, ``tool_choice``
``any``/``tool``, ``output_config``, ``context_management``) is a 400 in Anthropic's error
shape naming it.
Out: a ``message`` (text and ``tool_use`` blocks, ``stop_reason``, ``usage``, and tidal's
``tidal`` extension with the ids and weight versions) or its SSE events (``message_start``,
``content_block_start/delta/stop``, ``message_delta``, ``message_stop``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from tidal.serving.chat import MAX_PROMPT_CHARS, MAX_TOOLS
from tidal.serving.dialects import (
    Dialect,
    Piece,
    Sampled,
    chat_request,
    guarded,
    parse,
    route,
    sse,
    tidal_extra,
)
from tidal.serving.protocol import MAX_STOP_CHARS, MAX_STOP_STRINGS

if TYPE_CHECKING:
    from fastapi import Request
    from fastapi.responses import Response

    from tidal.serving.proxy_handlers import ProxyHandlers

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CacheControl(_Strict):
    """A prompt-caching hint: no effect (the engines' prefix cache works without hints)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str = Field(..., max_length=MAX_PROMPT_CHARS)
    cache_control: CacheControl | None = None
    citations: None = None


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str = Field(..., min_length=1, max_length=256)
    name: str = Field(..., min_length=1, max_length=256)
    input: dict
    cache_control: CacheControl | None = None
    caller: None = Field(None, description="null only: no programmatic tool calling")
    toolset_name: None = Field(None, description="null only: no server toolsets")


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str = Field(..., min_length=1, max_length=256)
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(b.text for b in self.content)
        return self.content or ""


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(_Strict):
    role: Literal["user", "assistant", "system"] = Field(
        ..., description="system: a system message mid-conversation (Claude Code's beta)"
    )
    content: str | list[Block]


class CustomTool(_Strict):
    type: Literal["custom"] | None = Field(None, description="server tools are refused")
    name: str = Field(..., min_length=1, max_length=256)
    description: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    input_schema: dict
    cache_control: CacheControl | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "none"] = Field(
        ..., description="'any' and 'tool' need constrained decoding: refused"
    )
    disable_parallel_tool_use: bool | None = None


class Thinking(_Strict):
    type: Literal["disabled"] = Field(..., description="thinking budgets are not implemented")


class Metadata(_Strict):
    user_id: str | None = Field(None, max_length=4096)


class CountTokensRequest(_Strict):
    model: str | None = Field(None, max_length=256)
    messages: list[Message] = Field(..., min_length=1, max_length=4096)
    system: str | list[TextBlock] | None = None
    tools: list[CustomTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(..., ge=1, le=1_000_000)
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]] | None = (
        Field(None, max_length=MAX_STOP_STRINGS)
    )
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    cache_control: CacheControl | None = None


def to_chat(body: CountTokensRequest) -> dict:
    """The request as the chat route's ``ChatRequest`` takes it: the system text first, each
    ``tool_result`` a ``tool`` message, each ``tool_use`` an assistant tool call (its input as
    JSON arguments), the text blocks of a turn joined by newlines (as vLLM joins text parts)."""
    msgs: list[dict] = []
    if body.system:
        system = (
            body.system if isinstance(body.system, str) else "\n".join(b.text for b in body.system)
        )
        msgs.append({"role": "system", "content": system})
    for m in body.messages:
        if isinstance(m.content, str):
            msgs.append({"role": m.role, "content": m.content})
            continue
        texts: list[str] = []
        calls: list[dict] = []
        for b in m.content:
            if isinstance(b, ToolResultBlock):
                if texts:
                    msgs.append({"role": m.role, "content": "\n".join(texts)})
                    texts = []
                msgs.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
            elif isinstance(b, ToolUseBlock):
                calls.append(
                    {
                        "id": b.id,
                        "type": "function",
                        "function": {
                            "name": b.name,
                            "arguments": json.dumps(b.input, ensure_ascii=False),
                        },
                    }
                )
            else:
                texts.append(b.text)
        if calls:
            msgs.append(
                {"role": "assistant", "content": "\n".join(texts) or None, "tool_calls": calls}
            )
        elif texts or not m.content:
            msgs.append({"role": m.role, "content": "\n".join(texts)})
    out: dict = {"model": body.model, "messages": msgs}
    if body.tools:
        out["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.input_schema,
                },
            }
            for t in body.tools
        ]
        if body.tool_choice is not None:
            out["tool_choice"] = body.tool_choice.type
    if isinstance(body, MessagesRequest):
        out.update(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            stop=body.stop_sequences,
            stream=body.stream,
        )
    return out


def _blocks(s: Sampled) -> list[dict]:
    blocks = [{"type": "text", "text": s.text}] if s.text or not s.calls else []
    for c in s.calls:
        blocks.append(
            {
                "type": "tool_use",
                "id": f"toolu_{c['id'].removeprefix('call_')}",
                "name": c["function"]["name"],
                "input": _input(c),
            }
        )
    return blocks


def _input(call: dict) -> dict:
    """A parsed call's arguments as the object Anthropic's ``input`` is (a non-object JSON
    value is kept under ``arguments``, never dropped)."""
    try:
        value = json.loads(call["function"]["arguments"])
    except ValueError:
        value = call["function"]["arguments"]
    return value if isinstance(value, dict) else {"arguments": value}


def _stop(s: Sampled) -> tuple[str, str | None]:
    if s.stop_string is not None and s.reason == "stop":
        return "stop_sequence", s.stop_string
    return STOP_REASONS.get(s.reason, "end_turn"), None


def _usage(s: Sampled) -> dict:
    return {
        "input_tokens": len(s.result.prompt_token_ids),
        "output_tokens": len(s.result.token_ids),
        "cache_read_input_tokens": s.result.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def answer(_: MessagesRequest, model: str, s: Sampled) -> dict:
    reason, seq = _stop(s)
    return {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": _blocks(s),
        "stop_reason": reason,
        "stop_sequence": seq,
        "usage": _usage(s),
        "tidal": tidal_extra(s.result),
    }


async def stream(
    _: MessagesRequest, model: str, n_prompt: int, pieces: AsyncIterator[Piece]
) -> AsyncIterator[bytes]:
    """Anthropic's event sequence: text as one block streamed while it comes, then one block
    per tool call (its input as one ``input_json_delta``), then the stop reason and usage."""
    yield sse(
        "message_start",
        {
            "type": "message_start",
            "message": {
                "id": f"msg_{uuid.uuid4().hex}",
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": n_prompt, "output_tokens": 0},
            },
        },
    )
    index, text_open = 0, False
    async for p in pieces:
        if p.kind == "error":
            yield sse("error", {"type": "error", "error": {"type": "api_error", "message": p.text}})
            return
        if p.kind == "text":
            if not text_open:
                yield sse(
                    "content_block_start",
                    {
                        "type": "content_block_start",
                        "index": 0,
                        "content_block": {"type": "text", "text": ""},
                    },
                )
                text_open = True
            yield sse(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": p.text},
                },
            )
            continue
        s = p.sampled
        if text_open:
            yield sse("content_block_stop", {"type": "content_block_stop", "index": 0})
            index = 1
        for block in _blocks(s):
            if block["type"] == "text":
                if not text_open:  # an empty answer: one empty text block
                    yield sse(
                        "content_block_start",
                        {"type": "content_block_start", "index": index, "content_block": block},
                    )
                    yield sse("content_block_stop", {"type": "content_block_stop", "index": index})
                    index += 1
                continue
            yield sse(
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": index,
                    "content_block": {**block, "input": {}},
                },
            )
            yield sse(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": index,
                    "delta": {
                        "type": "input_json_delta",
                        "partial_json": json.dumps(block["input"]),
                    },
                },
            )
            yield sse("content_block_stop", {"type": "content_block_stop", "index": index})
            index += 1
        reason, seq = _stop(s)
        yield sse(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": seq},
                "usage": {"output_tokens": len(s.result.token_ids)},
                "tidal": tidal_extra(s.result),
            },
        )
        yield sse("message_stop", {"type": "message_stop"})


def error(message: str, status: int) -> dict:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


MESSAGES = Dialect(MessagesRequest, to_chat, answer, stream, error)


async def count_tokens(h: ProxyHandlers, request: Request) -> Response:
    """``POST /v1/messages/count_tokens``: the prompt's length in tokens as the model's chat
    template renders it (``{"input_tokens"}``); nothing is sampled or recorded."""

    async def work() -> dict:
        body = await parse(request, CountTokensRequest)
        chat = chat_request(to_chat(body))
        h.check_model(chat.model)
        ids = await h.proxy.tokenize(messages=chat.wire_messages(), tools=chat.template_tools())
        return {"input_tokens": len(ids)}

    return await guarded(error, work())


async def messages(h: ProxyHandlers, request: Request) -> Response:
    """``POST /v1/messages``: sampled as a chat call (``tidal.serving.dialects.route``)."""
    return await route(h, request, MESSAGES)
