"""One HTTP transport set per run for every execution's model client (never one per execution).

In: each execution's base URL, key and timeout (``SharedHTTP.client``), or the running loop
(``shared_openai_http``, for ``openai.AsyncOpenAI(http_client=...)``). Out: an ``httpx`` client
bound to that execution over transports shared by the run. Why: an ``httpx.AsyncClient`` of its
own costs ~15 ms of CPU and ~0.9 MB (its TLS context and pool); one over a shared transport
~0.02 ms and ~3 KB (docs/scale.md). The shared connections are split over ``SHARDS`` pools by
the execution's key: ``httpcore``'s pool scans every connection and queued request for each
request, so one pool of 10,000 connections costs O(n^2) of the driver's CPU (the 256-GPU
stress's second ceiling, docs/scale.md).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import weakref
import zlib
from collections.abc import Awaitable, Callable

import httpx

log = logging.getLogger(__name__)

SHARDS = 64  # pools per run: 10,240 executions -> 160 connections per pool


class KeptOpen(httpx.AsyncBaseTransport):
    """A client's close leaves the shared transport (and its connections) open."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        return None


def _pool() -> httpx.AsyncHTTPTransport:
    return httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=None))


class Sharded(httpx.AsyncBaseTransport):
    """``n`` connection pools (default ``SHARDS``): a client bound to one execution uses the
    pool its ``key`` picks (``pick``); requests sent through this transport itself go to the
    pools in turn."""

    def __init__(self, n: int | None = None) -> None:
        self.pools = [KeptOpen(_pool()) for _ in range(n or SHARDS)]
        self._turn = itertools.count()

    def pick(self, key: str) -> KeptOpen:
        return self.pools[zlib.crc32(key.encode()) % len(self.pools)]

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        pool = self.pools[next(self._turn) % len(self.pools)]
        return await pool.handle_async_request(request)

    async def aclose(self) -> None:
        for p in self.pools:
            await p.inner.aclose()


class SharedHTTP:
    """The run's shared transports (per event loop); ``client`` binds one execution's URL, key
    and timeout over the pool its key picks."""

    def __init__(self, shards: int | None = None) -> None:
        self.shards = shards
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pools: Sharded | None = None

    def transport(self, key: str = "") -> KeptOpen:
        loop = asyncio.get_running_loop()
        if self._pools is None or self._loop is not loop:
            self._loop, self._pools = loop, Sharded(self.shards)
        return self._pools.pick(key)

    def client(self, base_url: str, api_key: str, timeout_s: float) -> httpx.AsyncClient:
        """A client bound to one execution (its URL and key) over a shared pool."""
        return httpx.AsyncClient(
            base_url=base_url,
            timeout=timeout_s,
            headers={"Authorization": f"Bearer {api_key}"},
            transport=self.transport(api_key),
        )


_OPENAI_HTTP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = (
    weakref.WeakKeyDictionary()
)


def shared_openai_http() -> httpx.AsyncClient:
    """The running loop's one ``httpx`` client for ``openai.AsyncOpenAI(http_client=...)``
    (its requests spread over ``SHARDS`` pools in turn). The
    ``AsyncOpenAI`` over it keeps the execution's URL and key; it is not closed (that would
    close this client for every execution)."""
    import openai

    loop = asyncio.get_running_loop()
    client = _OPENAI_HTTP.get(loop)
    if client is None or client.is_closed:
        client = _OPENAI_HTTP[loop] = openai.DefaultAsyncHttpxClient(transport=Sharded())
    return client


async def idempotent(
    send: Callable[[], Awaitable[httpx.Response]],
    what: str = "admin request",
    attempts: int = 3,
    wait_s: float = 0.5,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
) -> httpx.Response:
    """``send()`` again (up to ``attempts`` in all, ``wait_s`` then twice that between them)
    when the connection fails (``httpx.TransportError``: refused, reset, closed before the
    answer): only for requests whose repeat changes nothing (an execution's close is kept once
    by the proxy, a records read changes nothing). In the 256-GPU stress with two proxy
    processes 132 closes and 28 records reads failed so once, and 28 executions were lost."""
    for attempt in range(1, attempts + 1):
        try:
            return await send()
        except httpx.TransportError as exc:
            if attempt == attempts:
                raise
            log.warning("%s: %s, sent again (%d of %d)", what, why(exc), attempt + 1, attempts)
            await sleep(wait_s * 2 ** (attempt - 1))
    raise AssertionError("unreachable")


def why(exc: BaseException) -> str:
    """An exception as ``Type: message`` (httpx's connection errors often have no message)."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
