"""What both servers (``tidal engine``, ``tidal proxy``) put between a socket and their routes:
bearer-token checks and body limits (``Guard``), a catch-all that answers 500 without dropping
the connection (``CatchAll``), and a uvicorn protocol with a read deadline and a head limit.

In: raw ASGI requests; connections on uvicorn's HTTP parser. Out: the request handed to the app,
or a one-line JSON error (401 missing / wrong token, 413 body too large, 431 head too large, 500
with the exception's type); a connection that sends no complete request within the read
deadline is closed. Invariant kept: no request reaches a protected route without the token, and
no half-sent request holds a connection longer than ``read_timeout_s``.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
from collections.abc import Callable

from starlette.requests import ClientDisconnect

from tidal.serving.openai_api import error_body
from tidal.serving.protocol import ServingError

log = logging.getLogger(__name__)
MAX_HEADER_BYTES = 32 << 10
READ_TIMEOUT_S = 30.0


class PayloadTooLarge(ServingError):
    status = 413


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def send_error(send, message: str, status: int, headers: list | None = None) -> None:
    body = json.dumps(error_body(message, status)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def bearer_ok(scope, token: str) -> bool:
    """Constant-time check of ``Authorization: Bearer <token>`` in an ASGI scope."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            kind, _, given = value.partition(b" ")
            return kind.lower() == b"bearer" and hmac.compare_digest(given.strip(), token.encode())
    return False


class Guard:
    """ASGI wrapper. ``needs_token(path)``: whether a path needs ``token`` (default: all;
    with no token configured such paths answer 401, disabled). ``max_body``: bytes per request
    body (``body_limits`` per path prefix overrides it); a larger Content-Length is refused
    before the body is read, a longer chunked body when it gets there."""

    def __init__(
        self,
        app,
        token: str | None,
        needs_token: Callable[[str], bool] | None = None,
        max_body: int = 64 << 20,
        body_limits: dict[str, int] | None = None,
    ) -> None:
        self.app, self.token = app, token
        self.needs_token = needs_token or (lambda _: True)
        self.max_body, self.body_limits = max_body, body_limits or {}
        self.state = getattr(app, "state", None)

    def _limit(self, path: str) -> int:
        return next((n for p, n in self.body_limits.items() if path.startswith(p)), self.max_body)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if self.needs_token(path) and not (self.token and bearer_ok(scope, self.token)):
            why = (
                "missing or wrong bearer token"
                if self.token
                else f"{path} is disabled: no token configured"
            )
            return await send_error(send, why, 401, [(b"www-authenticate", b"Bearer")])
        limit = self._limit(path)
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and (not length.isdigit() or int(length) > limit):
            return await send_error(send, f"content-length: at most {limit} bytes", 413)
        if length is None:  # chunked (or no body): read it here, within the limit
            parts, seen = [], 0
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client left
                parts.append(message.get("body", b""))
                seen += len(parts[-1])
                if seen > limit:
                    return await send_error(send, f"request body over {limit} bytes", 413)
                if not message.get("more_body", False):
                    break
            receive = _replay(b"".join(parts), receive)
        await self.app(scope, receive, send)


def _replay(body: bytes, receive):
    """A receive that hands out ``body`` once, then the client's own messages."""
    sent = False

    async def replay():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


class CatchAll:
    """FastAPI middleware (``app.add_middleware(CatchAll)``, inside Starlette's error layer):
    an exception a route lets out becomes a 500 JSON answer naming its type, and the
    connection stays open (Starlette's own layer answers, then re-raises: uvicorn drops it)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except ClientDisconnect:
            return  # the client left (or was cut at the read deadline): no one to answer
        except Exception as exc:
            if started:
                raise  # nothing sensible left to answer: the server closes the connection
            log.exception("%s %s failed", scope.get("method"), scope.get("path"))
            await send_error(send, f"internal error: {type(exc).__name__}", 500)


class _BoundedMixin:
    """What ``bounded_protocol`` adds to uvicorn's httptools protocol (mixed in before it):
    a read deadline per request and a cap on the request head."""

    read_timeout_s: float = READ_TIMEOUT_S
    max_header_bytes: int = MAX_HEADER_BYTES
    _timer = None
    _head = 0
    _too_large = False

    def _arm(self) -> None:
        self._disarm()
        self._timer = self.loop.call_later(self.read_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if not self.transport.is_closing():
            log.info(
                "closing a connection that sent no whole request in %.0f s", self.read_timeout_s
            )
            self.transport.close()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head = 0
        self._arm()

    def _count(self, n: int) -> None:
        self._head += n
        if self._head > self.max_header_bytes:
            self._too_large = True
            raise ValueError("request head too large")  # httptools: a parser error

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        if not self._too_large:
            return super().send_400_response(msg)
        body = f"request head over {self.max_header_bytes} bytes".encode()
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: text/plain\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        self.transport.close()


def bounded_protocol(
    read_timeout_s: float = READ_TIMEOUT_S, max_header_bytes: int = MAX_HEADER_BYTES
):
    """uvicorn's ``http`` setting: its httptools protocol, where a request must arrive whole
    (head and body) within ``read_timeout_s`` of its first byte (or of the connection's
    opening) and a head longer than ``max_header_bytes`` is answered 431. Without httptools,
    uvicorn's h11 with its own incomplete-event limit (no read deadline)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # pragma: no cover - httptools is part of the serve extra
        return "h11"

    return type(
        "Bounded",
        (_BoundedMixin, HttpToolsProtocol),
        {"read_timeout_s": read_timeout_s, "max_header_bytes": max_header_bytes},
    )


def run_server(
    app,
    host: str,
    port: int,
    read_timeout_s: float = READ_TIMEOUT_S,
    max_header_bytes: int = MAX_HEADER_BYTES,
    **uvicorn_kw,
) -> None:
    """``uvicorn.run`` with the bounded protocol, long keep-alive (client pools reuse idle
    connections longer than uvicorn's 5 s) and a deep backlog; blocks until interrupted.

    With ``$TIDAL_LISTEN_FD`` (set by ``serving.launch``) it listens on that inherited socket,
    which must be bound to ``host:port``, instead of binding one itself."""
    import os
    import socket

    import uvicorn

    from tidal.serving.launch import LISTEN_FD_ENV

    kw = dict(
        log_level="warning",
        access_log=False,
        timeout_keep_alive=120,
        backlog=4096,
        http=bounded_protocol(read_timeout_s, max_header_bytes),
        h11_max_incomplete_event_size=max_header_bytes,
        **uvicorn_kw,
    )
    fd_text = os.environ.pop(LISTEN_FD_ENV, None)
    if fd_text is None:
        uvicorn.run(app, host=host, port=port, **kw)
        return
    try:
        sock = socket.socket(fileno=int(fd_text))
    except (ValueError, OSError) as e:
        raise SystemExit(f"{LISTEN_FD_ENV}={fd_text!r} is not an open socket: {e}") from None
    bound = sock.getsockname()
    if bound[1] != port:
        sock.close()
        raise SystemExit(
            f"{LISTEN_FD_ENV}={fd_text}: the socket is bound to port {bound[1]}, not --port {port}"
        )
    uvicorn.Server(uvicorn.Config(app, host=host, port=port, **kw)).run(sockets=[sock])
