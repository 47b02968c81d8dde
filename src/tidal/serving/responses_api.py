"""OpenAI's Responses API on the proxy (``POST /v1/responses``): what Codex CLI and the ``openai``
SDK's ``responses.create`` send, answered by tidal's engines through the chat route's internals
(``tidal.serving.dialects``).

In: ``input`` (text, or items: messages with ``input_text`` / ``output_text`` parts,
``function_call``, ``function_call_output``), ``instructions``, ``tools`` (functions),
``tool_choice`` ``auto``/``none``, ``parallel_tool_calls``, ``max_output_tokens`` (default:
what the served context leaves after the prompt),
``temperature``, ``top_p``, ``stream``. Accepted without effect (they cannot change what is
sampled): ``store`` (nothing is kept), ``metadata``, ``client_metadata``, ``user``,
``service_tier``, ``truncation`` ``disabled``, ``include`` ``reasoning.encrypted_content``,
``reasoning`` without an effort (or effort ``none``), ``prompt_cache_key`` (the engine-affinity
session when no ``X-Session-ID`` is sent). Refused with a 400 naming the field:
``previous_response_id`` (the proxy keeps no chain: send the whole input), reasoning items and
efforts, non-function tools, images and files, and any field not listed.
Out: a ``response`` object (a ``message`` item with the text, one ``function_call`` item per
parsed call, ``usage``, ``status`` ``incomplete`` at ``max_output_tokens``, and tidal's ``tidal``
extension) or its SSE events (``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``
/ ``.done``, ``response.content_part.done``, ``response.function_call_arguments.delta`` /
``.done``, ``response.output_item.done``, ``response.completed`` / ``response.incomplete``,
``response.failed`` on an error), each with its ``sequence_number``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from tidal.serving.chat import MAX_PROMPT_CHARS, MAX_TOOLS
from tidal.serving.dialects import Dialect, Piece, Sampled, route, sse, tidal_extra
from tidal.serving.openai_api import _only, error_body

# the Responses API's own statuses: its wire vocabulary, not tidal's close reasons
STATUS_DONE, STATUS_FAILED = "completed", "failed"

if TYPE_CHECKING:
    from fastapi import Request
    from fastapi.responses import Response

    from tidal.serving.proxy_handlers import ProxyHandlers


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["input_text", "output_text"] = Field(
        ..., description="images and files are refused"
    )
    text: str = Field(..., max_length=MAX_PROMPT_CHARS)
    annotations: list | None = None


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    id: str | None = Field(None, max_length=256)
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    id: str | None = Field(None, max_length=256)
    call_id: str = Field(..., min_length=1, max_length=256)
    name: str = Field(..., min_length=1, max_length=256)
    arguments: str = Field(..., max_length=MAX_PROMPT_CHARS)
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    id: str | None = Field(None, max_length=256)
    call_id: str = Field(..., min_length=1, max_length=256)
    output: str | list[TextPart]
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "\n".join(p.text for p in self.output)


def _item_type(v) -> str:
    return v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", "message")


Item = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_type),
]


class FunctionTool(_Strict):
    type: Literal["function"] = Field(..., description="built-in (server) tools are refused")
    name: str = Field(..., min_length=1, max_length=256)
    description: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    parameters: dict | None = None
    strict: bool | None = None


class Reasoning(_Strict):
    effort: Literal["none"] | None = Field(None, description="reasoning efforts are refused")
    summary: Literal["auto", "concise", "detailed", "none"] | None = None


class ResponsesRequest(_Strict):
    model: str | None = Field(None, max_length=256)
    input: str | list[Item] = Field(...)
    instructions: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["auto", "none"] | None = Field(
        None, description="'required' and a named function need constrained decoding: refused"
    )
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=1_000_000)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    client_metadata: dict[str, str] | None = None
    user: str | None = Field(None, max_length=256)
    service_tier: Literal["auto", "default"] | None = None
    truncation: Literal["disabled"] | None = None
    include: list[Literal["reasoning.encrypted_content"]] | None = None
    reasoning: Reasoning | None = None
    prompt_cache_key: str | None = Field(None, max_length=256)

    @field_validator("previous_response_id")
    @classmethod
    def _no_chain(cls, v):
        return _only(v, None, "the proxy keeps no responses; send the whole input")


def to_chat(body: ResponsesRequest) -> dict:
    """The request as the chat route's ``ChatRequest`` takes it: ``instructions`` as the
    system message, each message item a message, consecutive ``function_call`` items the tool
    calls of one assistant turn (joined to the assistant message before them), each
    ``function_call_output`` a ``tool`` message."""
    msgs: list[dict] = []
    if body.instructions:
        msgs.append({"role": "system", "content": body.instructions})
    items = (
        [MessageItem(role="user", content=body.input)]
        if isinstance(body.input, str)
        else body.input
    )
    for it in items:
        if isinstance(it, MessageItem):
            msgs.append({"role": it.role, "content": it.text()})
        elif isinstance(it, FunctionCallItem):
            call = {
                "id": it.call_id,
                "type": "function",
                "function": {"name": it.name, "arguments": it.arguments},
            }
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                last["content"] = last["content"] or None
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            msgs.append({"role": "tool", "tool_call_id": it.call_id, "content": it.text()})
    out: dict = {
        "model": body.model,
        "messages": msgs,
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stream": body.stream,
        "user": body.user,
    }
    if body.tools:
        out["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in body.tools
        ]
        out["tool_choice"] = body.tool_choice
        out["parallel_tool_calls"] = body.parallel_tool_calls
    return out


def _message(mid: str, text: str, status: str = STATUS_DONE) -> dict:
    return {
        "id": mid,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def _call_item(c: dict) -> dict:
    return {
        "id": f"fc_{c['id'].removeprefix('call_')}",
        "type": "function_call",
        "status": STATUS_DONE,
        "call_id": c["id"],
        "name": c["function"]["name"],
        "arguments": c["function"]["arguments"],
    }


def _output(s: Sampled, mid: str) -> list[dict]:
    items = [_message(mid, s.text)] if s.text or not s.calls else []
    return items + [_call_item(c) for c in s.calls]


def _response(
    body: ResponsesRequest,
    model: str,
    rid: str,
    status: str,
    output: list[dict],
    s: Sampled | None = None,
) -> dict:
    out = {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "error": None,
        "incomplete_details": None,
        "model": model,
        "output": output,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": None,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tool_choice": body.tool_choice or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "metadata": body.metadata or {},
        "store": False,
        "usage": None,
    }
    if s is not None:
        res = s.result
        out["usage"] = {
            "input_tokens": len(res.prompt_token_ids),
            "input_tokens_details": {"cached_tokens": res.cached_tokens},
            "output_tokens": len(res.token_ids),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": len(res.prompt_token_ids) + len(res.token_ids),
        }
        if s.reason == "length":
            out["status"] = "incomplete"
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        out["tidal"] = tidal_extra(res)
    return out


def answer(body: ResponsesRequest, model: str, s: Sampled) -> dict:
    return _response(
        body,
        model,
        f"resp_{uuid.uuid4().hex}",
        STATUS_DONE,
        _output(s, f"msg_{uuid.uuid4().hex}"),
        s,
    )


async def stream(
    body: ResponsesRequest, model: str, _n_prompt: int, pieces: AsyncIterator[Piece]
) -> AsyncIterator[bytes]:
    """The Responses event sequence: the text as one message item streamed while it comes,
    then one function-call item per parsed call, then the whole response."""
    rid, mid = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
    seq = iter(range(1 << 62))

    def event(kind: str, **data) -> bytes:
        return sse(kind, {"type": kind, "sequence_number": next(seq), **data})

    base = _response(body, model, rid, "in_progress", [])
    yield event("response.created", response=base)
    yield event("response.in_progress", response=base)
    text, text_open = "", False
    async for p in pieces:
        if p.kind == "error":
            failed = {
                **base,
                "status": STATUS_FAILED,
                "error": {"code": "server_error", "message": p.text},
            }
            yield event("response.failed", response=failed)
            return
        if p.kind == "text":
            if not text_open:
                text_open = True
                yield event(
                    "response.output_item.added",
                    output_index=0,
                    item={**_message(mid, "", "in_progress"), "content": []},
                )
                yield event(
                    "response.content_part.added",
                    item_id=mid,
                    output_index=0,
                    content_index=0,
                    part={"type": "output_text", "text": "", "annotations": []},
                )
            text += p.text
            yield event(
                "response.output_text.delta",
                item_id=mid,
                output_index=0,
                content_index=0,
                delta=p.text,
                logprobs=[],
            )
            continue
        s = p.sampled
        output = _output(s, mid)
        for index, item in enumerate(output):
            if item["type"] == "message":
                if not text_open:
                    yield event(
                        "response.output_item.added",
                        output_index=index,
                        item={**item, "status": "in_progress", "content": []},
                    )
                    yield event(
                        "response.content_part.added",
                        item_id=mid,
                        output_index=index,
                        content_index=0,
                        part={"type": "output_text", "text": "", "annotations": []},
                    )
                part = item["content"][0]
                yield event(
                    "response.output_text.done",
                    item_id=mid,
                    output_index=index,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                )
                yield event(
                    "response.content_part.done",
                    item_id=mid,
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            else:
                yield event(
                    "response.output_item.added",
                    output_index=index,
                    item={**item, "status": "in_progress", "arguments": ""},
                )
                yield event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=index,
                    delta=item["arguments"],
                )
                yield event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                )
            yield event("response.output_item.done", output_index=index, item=item)
        final = _response(body, model, rid, STATUS_DONE, output, s)
        yield event(f"response.{final['status']}", response=final)


def error(message: str, status: int) -> dict:
    return error_body(message, status)


RESPONSES = Dialect(ResponsesRequest, to_chat, answer, stream, error)


async def responses(h: ProxyHandlers, request: Request) -> Response:
    """``POST /v1/responses``: sampled as a chat call (``tidal.serving.dialects.route``)."""
    return await route(h, request, RESPONSES)
