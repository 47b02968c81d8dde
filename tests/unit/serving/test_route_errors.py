"""Issue 38 item (18) on a real proxy and engine on loopback: an engine's refusal of a chat or
token-in call is answered naming the caller's route (on main: ``/v1/completions``, the engine's
route behind every kind), and the token-in route takes bodies of its own size (on main it fell
under the proxy's 1 MiB cap for control bodies)."""

from __future__ import annotations

import asyncio
import json

import httpx

from tidal.models import load_model
from tidal.serving.engine import Engine, EngineConfig
from tidal.serving.engine_server import build_engine_app
from tidal.serving.proxy import Proxy, ProxyConfig
from tidal.serving.proxy_app import build_proxy_app


def _answers(tiny_dir, serve_asgi, calls: list[tuple[str, dict]]) -> list[httpx.Response]:
    async def main():
        model, tok = load_model(tiny_dir)
        engine_app = build_engine_app(Engine(model, tok, tiny_dir, EngineConfig()), "tiny")
        async with serve_asgi(engine_app) as engine_url:
            proxy = Proxy(ProxyConfig())
            await proxy.join("e0", engine_url)
            async with (
                serve_asgi(build_proxy_app(proxy)) as url,
                httpx.AsyncClient(base_url=url, timeout=60) as c,
            ):
                return [
                    await c.post(
                        path, content=json.dumps(body), headers={"content-type": "application/json"}
                    )
                    for path, body in calls
                ]

    return asyncio.run(main())


def test_errors_name_the_route_called_and_token_in_takes_large_bodies(tiny_dir, serve_asgi):
    long_chat = {"messages": [{"role": "user", "content": "hi " * 600}], "max_tokens": 4}
    generate, chat, streamed, completion, large = _answers(
        tiny_dir,
        serve_asgi,
        [
            (
                "/inference/v1/generate",
                {"token_ids": [10**6], "sampling_params": {"max_tokens": 2}},
            ),
            ("/v1/chat/completions", long_chat),
            ("/v1/chat/completions", {**long_chat, "stream": True}),
            ("/v1/completions", {"prompt": [10**6], "max_tokens": 2}),
            # a token-in body over 1 MiB: answered by the route itself (its length limit)
            ("/inference/v1/generate", {"token_ids": [5] * 300_000}),
        ],
    )
    assert generate.status_code == 400
    assert generate.json()["error"]["message"].startswith(
        "/inference/v1/generate: token id 1000000 outside vocabulary"
    ), generate.text
    assert chat.status_code == 400
    assert chat.json()["error"]["message"].startswith("/v1/chat/completions: prompt of "), chat.text
    assert '"/v1/chat/completions: prompt of ' in streamed.text, streamed.text
    assert completion.json()["error"]["message"].startswith("/v1/completions: token id")
    assert large.status_code == 400, large.text[:200]
    assert large.json()["error"]["message"].startswith("token_ids: List should have at most")
