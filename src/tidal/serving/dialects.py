"""What the proxy's other dialects (Anthropic Messages, OpenAI Responses) share with its chat
route: a request translated into a ``ChatRequest`` goes through the chat route's own
``ProxyHandlers.prepare`` (execution, model check, chat template, bridge to the ids the model
sampled earlier) and ``Proxy.complete`` (admission, drains, reroutes, weight versions, records),
so invariant 8 holds by construction: the records of a Messages or Responses call are the ids the
engines sampled, as for chat.

In: a dialect's raw body, its validating model and its translation to chat (``Dialect``). Out:
``Sampled`` (one choice's result with its text and parsed tool calls, whole) or, streamed, the
``Piece`` events a dialect turns into its own SSE; errors become the dialect's error body. A
caller that hangs up, streamed or not, cancels its call (the engine request is aborted).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from tidal.serving.execution_identity import CALLER
from tidal.serving.fast_path import unless_gone
from tidal.serving.openai_api import (
    VERSIONS_HEADER,
    ChatRequest,
    Result,
    validation_message,
    versions_header,
)
from tidal.serving.protocol import BadRequest, ServingError, TokenChunk, cut_at_stop

if TYPE_CHECKING:
    from tidal.serving.proxy_handlers import ProxyHandlers, _Call

SESSION_HEADERS = ("x-session-id", "x-claude-code-session-id", "session-id")


@dataclass
class Sampled:
    """One finished choice: the text the caller sees (tool calls cut out when tools were
    offered), the calls parsed from it, the finish reason (``tool_calls`` where the text ends
    in calls) and the stop string that ended it, if one did."""

    result: Result
    text: str
    calls: list[dict] = field(default_factory=list)
    reason: str = "stop"
    stop_string: str | None = None


@dataclass
class Piece:
    """A streamed event: ``text`` (a delta of text), then one ``end`` with the ``Sampled``, or
    ``error`` with its message."""

    kind: str
    text: str = ""
    sampled: Sampled | None = None


@dataclass
class Dialect:
    """A dialect: its request model, its translation to chat, its answer, its stream and its
    error body (``error(message, status)``)."""

    request: type[BaseModel]
    to_chat: Callable[[BaseModel], dict]
    answer: Callable[[BaseModel, str, Sampled], dict]
    stream: Callable[[BaseModel, str, int, AsyncIterator[Piece]], AsyncIterator[bytes]]
    error: Callable[[str, int], dict]


def chat_request(body: dict) -> ChatRequest:
    """The chat route's request; a chat-side refusal keeps its message (the dialect's field
    names are close enough: ``messages.3.content``, ``stop``)."""
    try:
        return ChatRequest.model_validate(body)
    except ValidationError as exc:
        raise BadRequest(validation_message(exc.errors(include_url=False))) from None


async def route(h: ProxyHandlers, request: Request, d: Dialect) -> Response:
    """One call of a dialect: validated, translated, prepared and sampled as chat; every
    failure before the first byte is the dialect's error body."""
    return await guarded(d.error, _route(h, request, d))


async def guarded(error: Callable[[str, int], dict], work) -> Response:
    """``await work``; a refusal or failure is the dialect's error body, never a traceback."""
    try:
        out = await work
    except RequestValidationError as exc:
        return _error(error, validation_message(exc.errors()), 400)
    except ServingError as exc:
        return _error(error, str(exc), exc.status)
    return (
        out
        if isinstance(out, Response)
        else Response(json.dumps(out).encode(), media_type="application/json")
    )


async def parse(request: Request, model: type[BaseModel]) -> BaseModel:
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        raise BadRequest(validation_message(exc.errors(include_url=False))) from None


async def _route(h: ProxyHandlers, request: Request, d: Dialect) -> Response:
    t_entry = time.perf_counter()
    body = await parse(request, d.request)
    chat = chat_request(d.to_chat(body))
    headers = request.headers
    # the session (engine affinity): tidal's header, else the harness's own session id
    session = next(
        (headers[k] for k in SESSION_HEADERS if k in headers),
        getattr(body, "prompt_cache_key", None),
    )
    call, t_engine = await h.prepare(
        chat, "chat", headers.get("x-tidal-execution"), session, request.scope.get(CALLER)
    )
    if chat.max_tokens is None:  # Responses' default: what the served context leaves
        lens = [m.max_model_len for m in h.proxy.router.members.values() if m.max_model_len]
        if lens:
            chat.max_tokens = max(1, min(lens) - len(call.prompt))
    model = chat.model or h._model_name(chat)
    if chat.stream:
        pieces = stream_pieces(h, call)
        return StreamingResponse(
            d.stream(body, model, len(call.prompt), pieces), media_type="text/event-stream"
        )
    # a caller that hangs up cancels its call and so its engine request, as on the chat route
    sampled = await unless_gone(sample_whole(h, call), request.receive)
    if sampled is None:
        return Response(status_code=499)  # nobody reads it
    out = d.answer(body, model, sampled)
    h.proxy.overhead_s.append(time.perf_counter() - t_entry - t_engine - sampled.result.upstream_s)
    return Response(
        json.dumps(out, separators=(",", ":")).encode(),
        media_type="application/json",
        headers={VERSIONS_HEADER: versions_header([sampled.result])},
    )


def _error(error: Callable[[str, int], dict], message: str, status: int) -> Response:
    return Response(
        json.dumps(error(message, status)).encode(), status, media_type="application/json"
    )


async def sample_whole(h: ProxyHandlers, c: _Call) -> Sampled:
    """One choice, whole: ``Proxy.complete`` as the chat route calls it."""
    res = await h.proxy.complete(
        c.eid,
        c.prompt,
        c.body.sampling(),
        record_overhead=False,
        timeout_s=c.timeout_s,
        session=c.session,
        bridged=c.bridged,
    )
    return await finish(h, c, res)


async def finish(h: ProxyHandlers, c: _Call, res: Result) -> Sampled:
    """A result as a dialect answers it: tool calls parsed (tools offered), the finish reason,
    and which stop string ended it (the engine cut the text before it; the ids are decoded
    once to name it). An engine's ``error`` or ``abort`` is an error of the call."""
    if res.finish_reason not in ("stop", "length"):
        raise ServingError(f"the call ended with {res.finish_reason}")
    out = Sampled(res, res.text, reason=res.finish_reason or "stop")
    if c.body.parses_tools:
        content, calls = h.parser(res.text)
        if calls:
            out.text, out.calls = content or "", calls
            out.reason = "tool_calls" if out.reason == "stop" else out.reason
    stops = c.body.sampling().stop
    if stops and res.finish_reason == "stop" and res.token_ids:
        member = next((m for m in h.proxy.router.members.values() if m.alive), None)
        if member is not None:
            full = await member.adapter.detokenize(res.token_ids)
            cut = cut_at_stop(full, stops)
            if cut is not None:
                out.stop_string = min((s for s in stops if full.find(s) == cut), key=len)
    return out


async def stream_pieces(h: ProxyHandlers, c: _Call) -> AsyncIterator[Piece]:
    """The choice's text as it comes (held back to the end when tools are offered: the calls
    are parsed from the whole text), then its end; closing the stream cancels the call."""
    queue: asyncio.Queue[TokenChunk | None] = asyncio.Queue()
    task = asyncio.create_task(
        h.proxy.complete(
            c.eid,
            c.prompt,
            c.body.sampling(),
            on_chunk=queue.put_nowait,
            timeout_s=c.timeout_s,
            session=c.session,
            bridged=c.bridged,
        )
    )
    task.add_done_callback(lambda _: queue.put_nowait(None))
    hold = c.body.parses_tools
    try:
        while (chunk := await queue.get()) is not None:
            if chunk.text and not hold:
                yield Piece("text", chunk.text)
        if task.cancelled() or task.exception() is not None:
            why = "the engine call was cancelled" if task.cancelled() else str(task.exception())
            yield Piece("error", why)
            return
        try:
            sampled = await finish(h, c, task.result())
        except ServingError as exc:
            yield Piece("error", str(exc))
            return
        if hold and sampled.text:
            yield Piece("text", sampled.text)
        yield Piece("end", sampled=sampled)
    finally:
        task.cancel()


def sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def tidal_extra(res: Result) -> dict:
    """tidal's extension of an answer: the ids (prompt and sampled) and weight versions."""
    from tidal.contracts.calls import version_spans

    return {
        "prompt_token_ids": res.prompt_token_ids,
        "token_ids": res.token_ids,
        "weight_versions": version_spans(res.versions),
    }
