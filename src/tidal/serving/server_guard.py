"""Every route of a vLLM server behind the run's token: an ASGI middleware vLLM loads itself.

vLLM's own ``--api-key`` guards only its ``/v1``-style routes; the control routes tidal needs
(``VLLM_SERVER_DEV_MODE``: ``/collective_rpc``, which calls any method of the workers,
``/pause``, ``/sleep``, ``/wake_up``, ``/reset_prefix_cache``, ...) stay open to whoever reaches
the port. That is acceptable only on loopback; a server bound to its node's address (an engine
on another node of a Ray cluster) must refuse them. ``runtime.vllm_host`` starts the server with
``--middleware tidal.serving.server_guard.TokenGuard`` and the run's token in
``$TIDAL_ENGINE_TOKEN``: vLLM instantiates ``TokenGuard(app)`` around its whole app, and every
request (``/health`` included, as on tidal's own engine) without ``Authorization: Bearer
<token>`` is answered 401 before vLLM sees it.

Pure ASGI and the standard library only: it is imported inside vLLM's venv, which has none of
tidal's dependencies.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable
from typing import Any

TOKEN_ENV = "TIDAL_ENGINE_TOKEN"
MIDDLEWARE = "tidal.serving.server_guard.TokenGuard"


def _digest(text: str | bytes) -> bytes:
    return hashlib.sha256(text if isinstance(text, bytes) else text.encode()).digest()


class TokenGuard:
    """``TokenGuard(app)``: ``app`` behind the bearer token in ``$TIDAL_ENGINE_TOKEN``; a
    server started with it and no token fails at start (``RuntimeError`` naming the variable)
    rather than serving unguarded. In: an ASGI scope. Out: the app's answer, or 401 (http) /
    close 1008 (websocket) without the token; lifespan events pass through."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        token = os.environ.get(TOKEN_ENV, "")
        if not token:
            raise RuntimeError(
                f"{MIDDLEWARE}: ${TOKEN_ENV} is empty: refusing to serve without the run's token"
            )
        self.app, self._want = app, _digest(token)

    def allowed(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether the request's ``Authorization`` header is ``Bearer <token>``
        (compared in constant time)."""
        for name, value in headers:
            if name.lower() == b"authorization":
                scheme, _, given = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(
                    _digest(given.strip()), self._want
                )
        return False

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        kind = scope.get("type")
        if kind not in ("http", "websocket") or self.allowed(scope.get("headers") or []):
            await self.app(scope, receive, send)
            return
        if kind == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps(
            {"error": "unauthorized: this server needs the run's token (Authorization: Bearer ...)"}
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
