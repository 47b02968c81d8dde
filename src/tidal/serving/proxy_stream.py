"""The proxy's SSE stream of a call's choices (``n`` of them), interleaved as their chunks arrive.

In: one task per choice (``Proxy.complete``) and the queue their chunks land on as
``(index, chunk)``, ``(index, None)`` when the task is done. Out: OpenAI SSE events; a choice's
last event carries its finish reason (with tools offered: its held-back text and parsed tool
calls), then the usage event if asked for, then ``[DONE]``. Closing the stream cancels every
choice (their engine requests are aborted).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from tidal.serving.openai_api import SSE_DONE, ToolParse, sse_chunk, sse_usage, tool_delta
from tidal.serving.protocol import TokenChunk


async def stream_choices(
    rid: str,
    model: str,
    tasks: list[asyncio.Task],
    queue: asyncio.Queue,
    chat: bool,
    parse: ToolParse | None,
    usage: bool,
) -> AsyncIterator[bytes]:
    """SSE events of ``len(tasks)`` choices as their chunks arrive; a choice's last event
    carries its finish reason (and, with tools offered, its held-back text and tool calls)."""
    texts = [""] * len(tasks)
    open_ = len(tasks)
    try:
        while open_:
            i, chunk = await queue.get()
            if chunk is not None:
                texts[i] += chunk.text
                plain = TokenChunk(chunk.token_ids, chunk.logprobs, chunk.versions, chunk.text)
                yield sse_chunk(rid, model, plain, chat, i, {} if parse else None)
                continue
            open_ -= 1
            task = tasks[i]
            if task.exception() is not None:
                err = task.exception()
                yield f"data: {json.dumps({'error': {'message': str(err)}})}\n\n".encode()
                continue
            res = task.result()
            end = TokenChunk(finish_reason=res.finish_reason)
            delta = None
            if parse is not None:
                delta, called = tool_delta(texts[i], parse)
                if called and res.finish_reason == "stop":
                    end.finish_reason = "tool_calls"
            yield sse_chunk(rid, model, end, chat, i, delta)
        if usage and all(t.exception() is None for t in tasks):
            yield sse_usage(rid, model, [t.result() for t in tasks], chat)
        yield SSE_DONE
    finally:
        for task in tasks:
            task.cancel()
