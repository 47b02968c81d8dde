"""The proxy's door (``ExecutionIdentity``) in front of a recording app: who may call which
route naming which execution. The same rules against a real proxy and engines:
``tests/integration/serving/test_execution_identity.py``."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tidal.serving.execution_identity import CALLER, ExecutionIdentity
from tidal.serving.execution_keys import execution_key, execution_url, parse_key
from tidal.serving.fast_path import FastPath
from tidal.serving.proxy_app import ROUTES, model_routes, open_routes

TOKEN = "tok"
KEY = execution_key(TOKEN, "b1-g2-e3")
OTHER = execution_key(TOKEN, "other")


def _door(token: str | None = TOKEN, open_api: bool = True):
    seen: list[tuple[str, dict, object]] = []

    async def app(scope, receive, send):
        seen.append((scope["path"], dict(scope["headers"]), scope.get(CALLER)))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    return ExecutionIdentity(app, token, model_routes(), open_routes(), open_api), seen


def _calls(door, requests: list[tuple[str, str, dict]]) -> list[int]:
    async def go():
        transport = httpx.ASGITransport(door)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
            return [(await c.request(m, p, headers=h)).status_code for m, p, h in requests]

    return asyncio.run(go())


def _bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def test_keys_name_one_execution_of_one_run():
    assert parse_key(TOKEN, KEY) == "b1-g2-e3" and parse_key("other", KEY) is None
    assert parse_key(TOKEN, "tx-b1-g2-e3.00") is None


def test_the_model_routes_are_declared_once():
    """The fast path serves only declared model routes, and every ``"model"`` row is a path
    without parameters (matched exactly at the door)."""
    assert set(FastPath.ROUTES) <= model_routes()
    assert {
        "/v1/completions",
        "/v1/chat/completions",
        "/inference/v1/generate",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/responses",
        "/v1/models",
    } == model_routes()
    assert all("{" not in p for p in model_routes())
    assert {access for *_, access, _ in ROUTES} == {"model", "open", "admin"}


def test_an_execution_key_calls_its_own_model_routes_only():
    door, seen = _door()
    base = execution_url("http://proxy", "b1-g2-e3")
    statuses = _calls(
        door,
        [
            ("POST", base + "/chat/completions", _bearer(KEY)),
            ("POST", "/v1/chat/completions", _bearer(KEY)),
            ("POST", "/inference/v1/generate", _bearer(KEY)),
            ("GET", base + "/models", _bearer(KEY)),
            # the dialects' routes: the same rule (an Anthropic SDK sends its key as x-api-key)
            ("POST", base.removesuffix("/v1") + "/v1/messages", {"x-api-key": KEY}),
            ("POST", "/v1/responses", _bearer(KEY)),
            # every route that is not a model call: the admin token only
            ("GET", "/tidal/executions/other/records", _bearer(KEY)),
            ("POST", "/tidal/executions/other/close", _bearer(KEY)),
            ("POST", "/tidal/executions/b1-g2-e3/close", _bearer(KEY)),
            ("POST", "/tidal/executions", _bearer(KEY)),
            ("POST", "/tidal/engines/s0/drain", _bearer(KEY)),
            ("DELETE", "/tidal/engines/s0", _bearer(KEY)),
            ("GET", "/tidal/stats", _bearer(KEY)),
            ("GET", "/openapi.json", _bearer(KEY)),
            ("GET", base.removesuffix("/v1") + "/tidal/stats", _bearer(KEY)),
            ("POST", "/v1/some-new-route", _bearer(KEY)),
        ],
    )
    assert statuses == [200] * 6 + [401] * 10
    assert [p for p, _, _ in seen] == [
        "/v1/chat/completions",
        "/v1/chat/completions",
        "/inference/v1/generate",
        "/v1/models",
        "/v1/messages",
        "/v1/responses",
    ]
    for _, headers, caller in seen:
        assert headers[b"x-tidal-execution"] == b"b1-g2-e3"
        given = headers.get(b"authorization") or b"Bearer " + headers[b"x-api-key"]
        assert given == f"Bearer {KEY}".encode()  # passed on as it came: never the run's token
        assert caller.execution == "b1-g2-e3" and not caller.admin


def test_naming_an_execution_needs_its_key_or_the_admin_token():
    door, seen = _door()
    victim = execution_url("http://proxy", "victim")
    statuses = _calls(
        door,
        [
            ("POST", "/v1/completions", {"X-Tidal-Execution": "victim"}),
            ("POST", victim + "/completions", {}),
            ("POST", victim + "/completions", _bearer("sk-placeholder")),
            ("POST", victim + "/completions", _bearer(KEY)),
            ("POST", "/v1/completions", {**_bearer(KEY), "X-Tidal-Execution": "victim"}),
            ("POST", "/v1/completions", _bearer("tx-victim.0123456789abcdef")),
            ("POST", victim.removesuffix("/v1") + "/v1/messages", {"x-api-key": "sk-ant-none"}),
            ("POST", "/v1/responses", {**_bearer(KEY), "X-Tidal-Execution": "victim"}),
            # the admin token names any execution (the driver's own harness pool)
            ("POST", "/v1/completions", {**_bearer(TOKEN), "X-Tidal-Execution": "victim"}),
            ("POST", victim + "/completions", _bearer(TOKEN)),
            ("POST", victim + "/completions", {**_bearer(TOKEN), "X-Tidal-Execution": "b"}),
            # anonymous on loopback: a model call naming no execution, recorded nowhere
            ("POST", "/v1/completions", _bearer("sk-placeholder")),
            ("GET", "/health", {}),
        ],
    )
    assert statuses == [401] * 8 + [200, 200, 400, 200, 200]
    assert [h.get(b"x-tidal-execution") for _, h, _ in seen[:2]] == [b"victim", b"victim"]
    assert b"x-tidal-execution" not in seen[2][1] and not seen[2][2].admin


def test_beyond_loopback_and_without_a_token():
    exposed, _ = _door(open_api=False)
    assert _calls(
        exposed,
        [
            ("POST", "/v1/completions", {}),
            ("POST", "/v1/completions", _bearer(KEY)),
            ("GET", "/tidal/stats", _bearer(TOKEN)),
            ("GET", "/live", {}),
        ],
    ) == [401, 200, 200, 200]
    tokenless, seen = _door(token=None)
    assert _calls(
        tokenless,
        [
            ("POST", "/v1/completions", {"X-Tidal-Execution": "a"}),
            ("GET", "/tidal/stats", {}),
            ("POST", "/v1/completions", _bearer(KEY)),
        ],
    ) == [200, 401, 200]
    assert not seen[0][2].enforced


@pytest.mark.parametrize("user", ["victim", None])
def test_the_body_user_field_is_checked_like_a_header(user, serve_asgi):
    """The body's ``user`` names an execution on a real proxy app with an admin token: an
    anonymous caller naming one is refused (401); the admin token may name it; with an
    execution's key the call is its own execution's (``user`` is not read)."""
    from tidal.serving.proxy import Proxy, ProxyConfig
    from tidal.serving.proxy_app import build_proxy_app

    async def main():
        # no engine joins: a call let through waits for one and is answered 503 at once
        proxy = Proxy(ProxyConfig(admin_token=TOKEN, request_timeout_s=0.05))
        async with serve_asgi(build_proxy_app(proxy)) as url, httpx.AsyncClient(base_url=url) as c:
            body = {"prompt": [1, 2], "max_tokens": 1, **({"user": user} if user else {})}
            return [
                await c.post("/v1/completions", json=body, headers=h)
                for h in ({}, _bearer(TOKEN), _bearer(KEY))
            ]

    anonymous, admin, keyed = asyncio.run(main())
    assert anonymous.status_code == (401 if user else 503), anonymous.text
    assert admin.status_code == keyed.status_code == 503, (admin.text, keyed.text)
    if user:
        assert "'victim' is named without its key" in anonymous.json()["error"]["message"]
