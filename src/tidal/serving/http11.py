"""A small HTTP/1.1 client over asyncio streams: the proxy's upstream hop to its engines.

In: requests to one origin (``http://host:port``) with bytes bodies. Out: status, headers and
body (whole, or line by line for SSE). Keep-alive connections are pooled (LIFO, bounded) and
reused; a pooled connection the server closed while idle is detected before any response byte
and the request is sent again once on a fresh one. Every read and connect is bounded by a
timeout; a failure raises ``HTTPFailure`` (the adapters translate it at their boundary).

Why not httpx: on the serving hot path its per-request cost (pool machinery, header models,
anyio) was most of the proxy's CPU time; this client does one write and a few buffered reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque
from collections.abc import AsyncIterator
from urllib.parse import urlencode, urlsplit

MAX_HEADER_BYTES = 64 << 10  # a longer response head is a broken server, not a response
_LINE_LIMIT = 1 << 20  # the stream reader's buffer limit (a longer line fails the read)
_BROKEN = (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError)


class HTTPFailure(Exception):
    """The origin could not be reached or broke the protocol (refused, reset, timeout)."""


class Response:
    __slots__ = ("content", "headers", "status_code")

    def __init__(self, status_code: int, headers: dict[str, str], content: bytes) -> None:
        self.status_code, self.headers, self.content = status_code, headers, content

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self):
        return json.loads(self.content)


class _Conn:
    __slots__ = ("reader", "reused", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer, self.reused = reader, writer, False

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()

    def abort(self) -> None:
        """Drop the connection now, unsent bytes and all: a reader waiting on it sees its end
        (a peer that stopped, e.g. SIGSTOP, would otherwise hold it until a read timeout)."""
        with contextlib.suppress(Exception):
            self.writer.transport.abort()


class _Stale(Exception):
    """A reused connection ended before the first response byte: the server had closed it."""


class HTTPPool:
    def __init__(
        self,
        url: str,
        headers: dict[str, str] | None = None,
        max_idle: int = 256,
        connect_timeout_s: float = 10.0,
        timeout_s: float = 30.0,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"only http://host:port origins are supported, not {url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.prefix = parts.path.rstrip("/")
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._head_tail = f"Host: {parts.netloc}\r\n{extra}".encode()
        self.max_idle, self.connect_timeout_s, self.timeout_s = (
            max_idle,
            connect_timeout_s,
            timeout_s,
        )
        self._idle: deque[_Conn] = deque()
        self._busy: set[_Conn] = set()  # handed out: aborted by ``close``
        self.closed = False

    async def close(self) -> None:
        """Close idle connections and abort busy ones: a request or stream in progress on
        this pool fails at once with ``HTTPFailure`` (its caller moves elsewhere)."""
        self.closed = True
        while self._idle:
            self._idle.pop().close()
        for conn in list(self._busy):
            conn.abort()
        self._busy.clear()

    # -- one request --------------------------------------------------------------------
    async def request(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        json_body=None,
        params: dict | None = None,
        headers: dict[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> Response:
        """Send and read the whole response (bounded by ``timeout_s``)."""
        data, head = self._encode(method, path, body, json_body, params, headers)
        try:
            async with asyncio.timeout(timeout_s or self.timeout_s):
                for fresh in (False, True):
                    conn = await self._acquire(fresh)
                    try:
                        status, hdrs = await self._send(conn, head, data)
                        content = await self._body(conn, hdrs)
                    except _Stale:
                        self._drop(conn)
                        continue
                    except BaseException:
                        self._drop(conn)
                        raise
                    self._release(conn, hdrs)
                    return Response(status, hdrs, content)
        except TimeoutError:
            raise HTTPFailure(f"{method} {path}: timed out") from None
        except _BROKEN as exc:
            raise HTTPFailure(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        raise HTTPFailure(f"{method} {path}: connection closed by the server")

    @contextlib.asynccontextmanager
    async def stream(
        self,
        method: str,
        path: str,
        *,
        json_body=None,
        headers: dict[str, str] | None = None,
        read_timeout_s: float = 300.0,
    ) -> AsyncIterator[StreamResponse]:
        """Send, then hand out the response to read incrementally; each read is bounded by
        ``read_timeout_s``. A response not read to its end closes its connection."""
        data, head = self._encode(method, path, None, json_body, None, headers)
        conn = None
        try:
            for fresh in (False, True):
                conn = await self._acquire(fresh)
                try:
                    async with asyncio.timeout(read_timeout_s):
                        status, hdrs = await self._send(conn, head, data)
                    break
                except _Stale:
                    self._drop(conn)
                    conn = None
            if conn is None:
                raise HTTPFailure(f"{method} {path}: connection closed by the server")
        except TimeoutError:
            if conn is not None:
                self._drop(conn)
            raise HTTPFailure(f"{method} {path}: timed out") from None
        except _BROKEN as exc:
            if conn is not None:
                self._drop(conn)
            raise HTTPFailure(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        resp = StreamResponse(self, conn, status, hdrs, read_timeout_s)
        try:
            yield resp
        finally:
            resp.finish()

    # -- plumbing -------------------------------------------------------------------------
    def _encode(
        self,
        method: str,
        path: str,
        body: bytes | None,
        json_body,
        params: dict | None,
        headers: dict[str, str] | None,
    ) -> tuple[bytes, bytes]:
        if json_body is not None:
            body = json.dumps(json_body, separators=(",", ":")).encode()
            ctype = b"Content-Type: application/json\r\n"
        else:
            ctype = b"Content-Type: application/octet-stream\r\n" if body else b""
        if params:
            path += "?" + urlencode(
                {
                    k: str(v).lower() if isinstance(v, bool) else v
                    for k, v in params.items()
                    if v is not None
                }
            )
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()).encode()
        head = (
            f"{method} {self.prefix}{path} HTTP/1.1\r\n".encode()
            + self._head_tail
            + extra
            + ctype
            + b"Content-Length: %d\r\n\r\n" % len(body or b"")
        )
        return body or b"", head

    async def _acquire(self, fresh: bool) -> _Conn:
        if self.closed:
            raise OSError("client closed")
        while self._idle and not fresh:
            conn = self._idle.pop()
            if not conn.writer.is_closing() and not conn.reader.at_eof():
                conn.reused = True
                self._busy.add(conn)
                return conn
            conn.close()
        async with asyncio.timeout(self.connect_timeout_s):
            reader, writer = await asyncio.open_connection(self.host, self.port, limit=_LINE_LIMIT)
        conn = _Conn(reader, writer)
        if self.closed:  # closed while connecting
            conn.abort()
            raise OSError("client closed")
        self._busy.add(conn)
        return conn

    def _drop(self, conn: _Conn) -> None:
        self._busy.discard(conn)
        conn.close()

    def _release(self, conn: _Conn, headers: dict[str, str]) -> None:
        self._busy.discard(conn)
        if (
            self.closed
            or headers.get("connection", "").lower() == "close"
            or len(self._idle) >= self.max_idle
        ):
            conn.close()
        else:
            self._idle.append(conn)

    async def _send(self, conn: _Conn, head: bytes, body: bytes) -> tuple[int, dict[str, str]]:
        """Write the request, read the final status line and headers (1xx skipped)."""
        method = head[: head.index(b" ")]
        try:
            conn.writer.write(head + body if len(body) < 65536 else head)
            if len(body) >= 65536:
                conn.writer.write(body)
            await conn.writer.drain()
            line = await conn.reader.readuntil(b"\r\n")
        except asyncio.IncompleteReadError as exc:
            if conn.reused and not exc.partial:
                raise _Stale from None
            raise
        except (ConnectionResetError, BrokenPipeError):
            if conn.reused:
                raise _Stale from None
            raise
        while True:
            status, headers = _status(line), _headers(await conn.reader.readuntil(b"\r\n\r\n"))
            if not 100 <= status < 200 or status == 101:
                break
            line = await conn.reader.readuntil(b"\r\n")  # an interim answer: the next one
        if status in (204, 304) or method == b"HEAD":
            headers["content-length"] = "0"  # no body, whatever the headers say
        return status, headers

    async def _body(self, conn: _Conn, headers: dict[str, str]) -> bytes:
        if headers.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            while (piece := await _chunk(conn.reader)) is not None:
                parts.append(piece)
            return b"".join(parts)
        if "content-length" in headers:
            return await conn.reader.readexactly(int(headers["content-length"]))
        headers["connection"] = "close"
        return await conn.reader.read()


def _status(line: bytes) -> int:
    parts = line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise ValueError(f"bad status line {line[:80]!r}")
    return int(parts[1])


def _headers(raw: bytes) -> dict[str, str]:
    """Lower-cased names; a repeated header's values joined by ", " (RFC 9110 5.3)."""
    if len(raw) > MAX_HEADER_BYTES:
        raise ValueError(f"response headers over {MAX_HEADER_BYTES} bytes")
    headers: dict[str, str] = {}
    for hl in raw.decode("latin-1").split("\r\n"):
        if hl:
            k, _, v = hl.partition(":")
            k, v = k.strip().lower(), v.strip()
            headers[k] = f"{headers[k]}, {v}" if k in headers else v
    return headers


async def _chunk(reader: asyncio.StreamReader) -> bytes | None:
    """One chunk of a chunked body; None after the last (its trailer consumed)."""
    size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
    if size == 0:
        while await reader.readuntil(b"\r\n") != b"\r\n":
            pass
        return None
    data = await reader.readexactly(size + 2)
    return data[:-2]


class StreamResponse:
    def __init__(
        self,
        pool: HTTPPool,
        conn: _Conn,
        status_code: int,
        headers: dict[str, str],
        read_timeout_s: float,
    ) -> None:
        self.pool, self.conn = pool, conn
        self.status_code, self.headers = status_code, headers
        self.read_timeout_s = read_timeout_s
        self._chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        self._left = int(headers.get("content-length", "-1"))
        self._done = False

    async def _piece(self) -> bytes | None:
        if self._done:
            return None
        r = self.conn.reader
        try:
            async with asyncio.timeout(self.read_timeout_s):
                if self._chunked:
                    piece = await _chunk(r)
                elif self._left >= 0:
                    piece = await r.read(min(self._left, 65536)) if self._left else None
                    if piece == b"" and self._left:
                        raise asyncio.IncompleteReadError(b"", self._left)
                    self._left -= len(piece or b"")
                else:
                    piece = await r.read(65536) or None
                    if piece is None:
                        self.headers["connection"] = "close"
        except TimeoutError:
            raise HTTPFailure(f"no data from the server for {self.read_timeout_s} s") from None
        except _BROKEN as exc:
            raise HTTPFailure(f"stream broken: {type(exc).__name__}: {exc}") from exc
        if piece is None:
            self._done = True
        return piece

    async def read(self) -> bytes:
        parts = []
        while (piece := await self._piece()) is not None:
            parts.append(piece)
        return b"".join(parts)

    async def lines(self) -> AsyncIterator[bytes]:
        buf = b""
        while (piece := await self._piece()) is not None:
            buf += piece
            if b"\n" not in piece:
                continue
            *complete, buf = buf.split(b"\n")
            for line in complete:
                yield line
        if buf:
            yield buf

    def finish(self) -> None:
        if self._done:
            self.pool._release(self.conn, self.headers)
        else:
            self.pool._drop(self.conn)
