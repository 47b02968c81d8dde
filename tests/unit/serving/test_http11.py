"""The proxy's upstream HTTP/1.1 client against a raw asyncio server on loopback: keep-alive
reuse, a connection the server closed while idle, chunked bodies split across reads, refused
connections and silent servers (bounded waits)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tidal.serving.http11 import HTTPFailure, HTTPPool


async def _serve(handler):
    """A server whose ``handler(reader, writer, state)`` answers each request; returns it, its
    url and a state dict counting connections."""
    state = {"connections": 0}

    async def on_conn(reader, writer):
        state["connections"] += 1
        try:
            await handler(reader, writer, state)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", state


async def _read_request(reader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        ),
        0,
    )
    return await reader.readexactly(length)


async def _echo_keepalive(reader, writer, state, close_after: int | None = None):
    served = 0
    while True:
        body = await _read_request(reader)
        out = b'{"got": %d}' % len(body)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(out), out)
        )
        await writer.drain()
        served += 1
        if close_after is not None and served >= close_after:
            return


def test_keep_alive_reuse_and_a_connection_closed_while_idle():
    async def main():
        server, url, state = await _serve(_echo_keepalive)
        pool = HTTPPool(url)
        for _ in range(3):
            r = await pool.request("POST", "/x", json_body={"a": [1, 2, 3]})
            assert r.status_code == 200 and r.json() == {"got": 13}  # {"a":[1,2,3]}
        reused = state["connections"]
        await pool.close()
        await asyncio.sleep(0.05)
        server.close()

        async def one_then_close(reader, writer, st):
            await _echo_keepalive(reader, writer, st, close_after=1)

        server2, url2, state2 = await _serve(one_then_close)
        pool2 = HTTPPool(url2)
        await pool2.request("GET", "/a")
        await asyncio.sleep(0.05)  # the server has closed the idle connection
        r = await pool2.request("GET", "/b", params={"flag": True})
        await pool2.close()
        await asyncio.sleep(0.05)  # the server's handlers see the hang-up and end
        server2.close()
        return reused, r.status_code, state2["connections"]

    reused, status, opened = asyncio.run(main())
    assert reused == 1 and status == 200 and opened == 2


def test_chunked_stream_lines_and_the_connection_goes_back_idle():
    events = [b'data: {"n": 1}\n', b'\ndata: {"n"', b": 2}\n\ndata: [DONE]\n\n"]

    async def chunked(reader, writer, state):
        while True:
            await _read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            for e in events:
                writer.write(b"%x\r\n%s\r\n" % (len(e), e))
                await writer.drain()
                await asyncio.sleep(0.01)
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    async def main():
        server, url, state = await _serve(chunked)
        pool = HTTPPool(url)
        got = []
        for _ in range(2):
            async with pool.stream("POST", "/s", json_body={}) as resp:
                assert resp.status_code == 200
                got.append([line async for line in resp.lines()])
        await pool.close()
        await asyncio.sleep(0.05)
        server.close()
        return got, state["connections"]

    got, opened = asyncio.run(main())
    assert (
        got[0] == got[1] == [b'data: {"n": 1}', b"", b'data: {"n": 2}', b"", b"data: [DONE]", b""]
    )
    assert opened == 1


def test_refused_and_silent_servers_fail_within_their_bounds():
    async def silent(reader, writer, state):
        await reader.read()  # answers nothing; returns once the client hangs up

    async def main():
        server, url, _ = await _serve(silent)
        port = int(url.rsplit(":", 1)[1])
        server_gone = HTTPPool("http://127.0.0.1:9")
        with pytest.raises(HTTPFailure):
            await server_gone.request("GET", "/health")
        t0 = time.monotonic()
        with pytest.raises(HTTPFailure, match="timed out"):
            await HTTPPool(f"http://127.0.0.1:{port}").request("GET", "/x", timeout_s=0.3)
        waited = time.monotonic() - t0
        closed = HTTPPool(url)
        await closed.close()
        with pytest.raises(HTTPFailure):
            await closed.request("GET", "/x")
        await asyncio.sleep(0.05)
        server.close()
        return waited

    assert asyncio.run(main()) < 5


async def _answer_once(raw: bytes):
    """A server answering every request on a connection with the bytes ``raw``."""

    async def handler(reader, writer, state):
        while True:
            await _read_request(reader)
            writer.write(raw)
            await writer.drain()

    return await _serve(handler)


def _fetch(raw: bytes, method: str = "GET", timeout_s: float = 3.0):
    async def main():
        server, url, _ = await _answer_once(raw)
        pool = HTTPPool(url, timeout_s=timeout_s)
        try:
            first = await pool.request(method, "/x")
            second = await pool.request(method, "/y")  # the connection is still in step
            return first, second
        finally:
            await pool.close()
            server.close()

    return asyncio.run(main())


def test_interim_answers_are_skipped():
    raw = (
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n"
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    )
    first, second = _fetch(raw)
    assert (first.status_code, first.content) == (200, b"ok")
    assert (second.status_code, second.content) == (200, b"ok")


@pytest.mark.parametrize("status", [204, 304])
def test_no_body_answers_without_length_return_at_once(status):
    t0 = time.monotonic()
    first, second = _fetch(b"HTTP/1.1 %d X\r\netag: a\r\n\r\n" % status, timeout_s=5.0)
    assert first.status_code == second.status_code == status
    assert first.content == b"" and time.monotonic() - t0 < 2.0


def test_head_answers_have_no_body():
    first, _ = _fetch(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n", method="HEAD")
    assert first.status_code == 200 and first.content == b""


def test_repeated_headers_are_joined():
    first, _ = _fetch(b"HTTP/1.1 200 OK\r\nvary: a\r\nVary: b\r\ncontent-length: 0\r\n\r\n")
    assert first.headers["vary"] == "a, b"


@pytest.mark.parametrize("size", [100_000, 2_000_000])
def test_an_oversized_response_head_is_a_failure_not_a_crash(size):
    raw = b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * size + b"\r\ncontent-length: 0\r\n\r\n"
    with pytest.raises(HTTPFailure, match=r"header|limit|chunk|separator"):
        _fetch(raw)


def test_close_aborts_requests_and_streams_in_progress():
    """A hung server (it reads the request, never answers): closing the pool fails the waiting
    request and the waiting stream read at once, not at their 60 s timeouts."""

    async def hang(reader, writer, state):
        await _read_request(reader)
        if state["connections"] == 2:  # the stream's: its head, then silence
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            await writer.drain()
        await asyncio.sleep(3600)

    async def go():
        server, url, _ = await _serve(hang)
        pool = HTTPPool(url, timeout_s=60)

        async def streamed():
            async with pool.stream("POST", "/s", json_body={}, read_timeout_s=60) as resp:
                return await resp.read()

        plain = asyncio.create_task(pool.request("GET", "/r"))
        await asyncio.sleep(0.2)
        stream = asyncio.create_task(streamed())
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        await pool.close()
        outcomes = await asyncio.gather(plain, stream, return_exceptions=True)
        server.close()
        return outcomes, time.monotonic() - t0

    outcomes, took_s = asyncio.run(go())
    assert all(isinstance(o, HTTPFailure) for o in outcomes), outcomes
    assert took_s < 5
