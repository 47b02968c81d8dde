"""The proxy's ASGI fast path: ``POST /v1/completions``, ``/v1/chat/completions`` and the token-in
``/inference/v1/generate`` go straight to the shared handler, without the framework's
middleware, routing and dependency layers (most of the proxy's CPU per call); every other
request goes to the FastAPI app.

In: the raw ASGI request (body at most ``MAX_BODY_BYTES``). Out: the handler's response, or a
one-line JSON error (400 validation, a ``ServingError``'s status, 500 with the exception's
type). A caller that hangs up before its answer cancels the call (and so its engine request).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import ClassVar

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

from tidal.serving.execution_identity import CALLER
from tidal.serving.guard import PayloadTooLarge
from tidal.serving.openai_api import error_body, validation_message
from tidal.serving.protocol import BadRequest, ServingError

MAX_BODY_BYTES = 64 << 20
log = logging.getLogger("tidal.serving.proxy_app")


class FastPath:
    """ASGI front of the proxy's FastAPI app; ``serve(raw, execution, kind, session)``
    answers the OpenAI routes and the token-in route."""

    ROUTES: ClassVar[dict[str, str]] = {
        "/v1/completions": "completions",
        "/v1/chat/completions": "chat",
        "/inference/v1/generate": "generate",
    }

    def __init__(self, app: FastAPI, serve) -> None:
        self.app, self.serve = app, serve
        self.state = app.state

    async def __call__(self, scope, receive, send) -> None:
        kind = self.ROUTES.get(scope.get("path", ""))
        if scope["type"] != "http" or kind is None or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        try:
            raw = await _read_body(receive)
            eid = session = None
            for k, v in scope["headers"]:
                if k == b"x-tidal-execution":
                    eid = v.decode("latin-1")
                elif k == b"x-session-id":
                    session = v.decode("latin-1")
            call = self.serve(raw, eid, kind, session, scope.get(CALLER))
            response = await unless_gone(call, receive)
            if response is None:  # the caller hung up: its call was cancelled
                return
        except RequestValidationError as exc:
            response = _error(validation_message(exc.errors()), 400)
        except ServingError as exc:
            response = _error(str(exc), exc.status)
        except Exception as exc:  # what the framework's error middleware would answer
            log.exception("proxy: %s failed", scope["path"])
            response = _error(f"internal error: {type(exc).__name__}", 500)
        await response(scope, receive, send)


async def unless_gone(work, receive):
    """``await work``, cancelled (None) if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def hang_up() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    gone = asyncio.ensure_future(hang_up())
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
    return None if task.cancelled() else task.result()


async def _read_body(receive) -> bytes:
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise BadRequest("the client went away before sending its body")
        parts.append(message.get("body", b""))
        size += len(parts[-1])
        if size > MAX_BODY_BYTES:
            raise PayloadTooLarge(f"request body over {MAX_BODY_BYTES} bytes")
        if not message.get("more_body", False):
            return b"".join(parts)


def _error(message: str, status: int) -> Response:
    return Response(
        json.dumps(error_body(message, status)).encode(), status, media_type="application/json"
    )
