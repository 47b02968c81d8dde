"""Both servers' guard on a real uvicorn server on loopback: bearer token, body limits, a 500
that leaves the connection usable, a read deadline for half-sent requests and a head-size
limit (431)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from fastapi import FastAPI

from tidal.serving.guard import CatchAll, Guard, is_loopback
from tidal.serving.openai_api import install_error_handlers

TOKEN = "s3cret"


def _app(token: str | None = TOKEN, **kw) -> Guard:
    app = FastAPI()

    @app.get("/ok")
    async def ok():
        return {"ok": True}

    @app.get("/boom")
    async def boom():
        raise RuntimeError("a bug")

    @app.post("/echo")
    async def echo(body: dict):
        return {"n": len(body)}

    install_error_handlers(app)
    app.add_middleware(CatchAll)
    return Guard(app, token, **kw)


def _run(app, check, **limits):
    async def main(serve_asgi):
        async with serve_asgi(app, **limits) as url:
            return await check(url)

    return main


def test_token_required_on_every_route(serve_asgi):
    async def check(url):
        async with httpx.AsyncClient(base_url=url) as c:
            out = [
                (await c.get("/ok")).status_code,
                (await c.get("/ok", headers={"Authorization": "Bearer wrong"})).status_code,
                (await c.get("/ok", headers={"Authorization": f"Basic {TOKEN}"})).status_code,
                (await c.get("/ok", headers={"Authorization": f"Bearer {TOKEN}"})).status_code,
            ]
            body = (await c.get("/nope")).json()
            return out, body

    statuses, body = asyncio.run(_run(_app(), check)(serve_asgi))
    assert statuses == [401, 401, 401, 200]
    assert "bearer token" in body["error"]["message"]


def test_a_route_bug_is_a_500_and_the_connection_stays(serve_asgi):
    async def check(url):
        conns = []
        async with httpx.AsyncClient(
            base_url=url,
            headers={"Authorization": f"Bearer {TOKEN}"},
            limits=httpx.Limits(max_connections=1),
        ) as c:
            r1 = await c.get("/boom", extensions={"trace": _trace(conns)})
            r2 = await c.get("/ok", extensions={"trace": _trace(conns)})
        return r1, r2, conns

    r1, r2, conns = asyncio.run(_run(_app(), check)(serve_asgi))
    assert r1.status_code == 500 and r1.json()["error"]["message"] == "internal error: RuntimeError"
    assert r2.status_code == 200
    assert conns.count("connection.connect_tcp.complete") == 1  # one connection for both


def _trace(events: list):
    async def trace(name, info):
        events.append(name)

    return trace


def test_body_limits_by_length_and_by_chunks(serve_asgi):
    async def check(url):
        async with httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}
        ) as c:
            big = b'{"a": "' + b"x" * 5000 + b'"}'
            by_length = await c.post(
                "/echo", content=big, headers={"content-type": "application/json"}
            )

            async def chunks():
                yield big[:3000]
                yield big[3000:]

            by_chunks = await c.post(
                "/echo", content=chunks(), headers={"content-type": "application/json"}
            )
            small = await c.post("/echo", json={"a": 1})
            return by_length, by_chunks, small

    r1, r2, r3 = asyncio.run(_run(_app(max_body=1000), check)(serve_asgi))
    assert r1.status_code == 413 and "content-length" in r1.json()["error"]["message"]
    assert r2.status_code == 413 and "body over 1000" in r2.json()["error"]["message"]
    assert r3.status_code == 200


def test_half_sent_requests_are_closed_at_the_read_deadline(serve_asgi):
    async def check(url):
        host, port = url.removeprefix("http://").split(":")
        out = []
        for partial in (
            b"",
            b"GET /ok HTTP/1.1\r\nHost: x\r\n",
            b"POST /echo HTTP/1.1\r\nHost: x\r\ncontent-length: 50\r\n\r\n{",
        ):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(partial)
            t0 = time.monotonic()
            data = await asyncio.wait_for(reader.read(), 10)  # returns at EOF
            out.append((time.monotonic() - t0, data))
            writer.close()
        return out

    results = asyncio.run(
        _run(_app(None, needs_token=lambda _: False), check, read_timeout_s=0.5)(serve_asgi)
    )
    for took, data in results:
        assert 0.3 < took < 5 and data == b""


def test_an_oversized_head_is_a_431(serve_asgi):
    async def check(url):
        async with httpx.AsyncClient(base_url=url) as c:
            big = await c.get("/ok", headers={"x-big": "a" * 1_000_000})
            fine = await c.get("/ok", headers={"x-small": "a" * 1000})
            return big, fine

    big, fine = asyncio.run(
        _run(_app(None, needs_token=lambda _: False), check, max_header_bytes=16_384)(serve_asgi)
    )
    assert big.status_code == 431 and b"16384" in big.content
    assert fine.status_code == 200


@pytest.mark.parametrize(
    "host,loop",
    [
        ("127.0.0.1", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("10.1.2.3", False),
        ("example.org", False),
    ],
)
def test_loopback_hosts(host, loop):
    assert is_loopback(host) is loop


def test_binding_beyond_loopback_needs_a_token(tiny_dir, monkeypatch):
    from click.testing import CliRunner

    from tidal.commands.engine import command as engine
    from tidal.commands.proxy import command as proxy

    for var in ("TIDAL_ADMIN_TOKEN", "TIDAL_ENGINE_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    out = CliRunner().invoke(proxy, ["--host", "0.0.0.0"])
    assert out.exit_code == 2 and "--admin-token" in out.output
    out = CliRunner().invoke(engine, ["--model", str(tiny_dir), "--host", "0.0.0.0"])
    assert out.exit_code == 2 and "--token" in out.output
