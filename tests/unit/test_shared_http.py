"""Every agent kind's model client shares one HTTP transport per run, never one per execution
(an ``httpx.AsyncClient`` of its own costs ~15 ms of CPU and ~0.9 MB: the 256-GPU stress's
first ceiling, docs/scale.md), and each execution's calls still carry its own URL and key."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from tidal.agents.emulated_agent import EmulatedKind
from tidal.agents.kinds import AgentContext, ChatKind
from tidal.agents.tasks import TaskRow
from tidal.config import AgentConfig
from tidal.serving import shared_http

N = 24


async def _serve(seen: list[tuple[str, str]]) -> tuple[web.AppRunner, str]:
    async def chat(request: web.Request) -> web.Response:
        seen.append((request.path, request.headers.get("Authorization", "")))
        return web.json_response({"choices": [{"message": {"content": "42"}}]})

    async def generate(request: web.Request) -> web.Response:
        seen.append((request.path, request.headers.get("Authorization", "")))
        body = await request.json()
        n = body["sampling_params"]["max_tokens"]
        return web.json_response({"choices": [{"token_ids": [300] * min(n, 4)}]})

    app = web.Application()
    app.router.add_post("/x/{eid}/v1/chat/completions", chat)
    app.router.add_post("/inference/v1/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def _ctx(i: int, url: str, tmp: Path) -> AgentContext:
    eid = f"g{i % 3}-e{i}"
    return AgentContext(
        execution_id=eid,
        group_id=f"g{i % 3}",
        row=TaskRow(index=i, prompt="2*21?"),
        workspace=tmp / eid,
        base_url=f"{url}/x/{eid}/v1",
        api_key=f"key-{eid}",
        proxy_url=url,
        model="m",
        timeout_s=30.0,
        max_tokens=8,
        max_turns=1,
        temperature=1.0,
        seed=i,
    )


@pytest.mark.parametrize("which", ["chat", "emulated"])
def test_n_executions_share_one_transport_and_keep_their_own_url_and_key(
    which, tmp_path, monkeypatch
):
    made: list[object] = []
    init = httpx.AsyncHTTPTransport.__init__

    def counting(self, *args, **kwargs):
        made.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(httpx.AsyncHTTPTransport, "__init__", counting)
    monkeypatch.setattr(shared_http, "SHARDS", 4)  # N executions, 4 pools: never N
    if which == "chat":
        kind = ChatKind(AgentConfig(kind="chat"))
    else:
        spec = AgentConfig(kind="emulated", args={"scenario": "dapo-math-32gpu", "k": 1e9})
        kind = EmulatedKind(spec)
    seen: list[tuple[str, str]] = []

    async def main() -> list:
        runner, url = await _serve(seen)
        made.clear()  # the server's own set-up is not counted
        try:
            return await asyncio.gather(*[kind.run(_ctx(i, url, tmp_path)) for i in range(N)])
        finally:
            await runner.cleanup()

    outcomes = asyncio.run(main())
    assert len(outcomes) == N
    assert len(made) == 4, f"{len(made)} HTTP transports (4 pools) for {N} executions"
    keys = {auth for _, auth in seen}
    assert keys == {f"Bearer key-g{i % 3}-e{i}" for i in range(N)}
    if which == "chat":
        assert {path for path, _ in seen} == {
            f"/x/g{i % 3}-e{i}/v1/chat/completions" for i in range(N)
        }


AGENT = """
async def agent(client, model):
    msgs = [{"role": "user", "content": "q"}]
    r = await client.chat.completions.create(model=model, messages=msgs)
    return {"reward": 1.0, "answer": r.choices[0].message.content}
"""


def test_a_python_agents_openai_clients_share_one_transport_in_their_worker(tmp_path, monkeypatch):
    from tidal.agents.python_workers import _agent

    (tmp_path / "ag.py").write_text(AGENT)
    made: list[object] = []
    init = httpx.AsyncHTTPTransport.__init__

    def counting(self, *args, **kwargs):
        made.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(httpx.AsyncHTTPTransport, "__init__", counting)
    monkeypatch.setattr(shared_http, "SHARDS", 4)  # N executions, 4 pools: never N
    seen: list[tuple[str, str]] = []

    async def main() -> list:
        runner, url = await _serve(seen)
        made.clear()
        try:
            msgs = [
                {
                    "ctx": _ctx(i, url, tmp_path),
                    "fn": f"{tmp_path}/ag.py:agent",
                    "names": ["client", "model"],
                }
                for i in range(N)
            ]
            return await asyncio.gather(*[_agent(m) for m in msgs])
        finally:
            await runner.cleanup()

    outcomes = asyncio.run(main())
    assert [o["answer"] for o in outcomes] == ["42"] * N
    assert len(made) == 4, f"{len(made)} HTTP transports (4 pools) for {N} executions"
    assert {auth for _, auth in seen} == {f"Bearer key-g{i % 3}-e{i}" for i in range(N)}
    assert {p for p, _ in seen} == {f"/x/g{i % 3}-e{i}/v1/chat/completions" for i in range(N)}


def test_the_emulated_agent_continues_from_each_answer_and_decodes_no_last_one(tmp_path):
    """A turn's prompt is the last prompt + that answer's ids + the tool's ids; the last answer
    is not decoded (nothing sends its ids) but a body that is no JSON object still fails."""
    from types import SimpleNamespace

    spec = AgentConfig(kind="emulated", args={"scenario": "dapo-math-32gpu", "k": 1e9})
    kind = EmulatedKind(spec)
    turns = [(3, 0.0, 2), (2, 0.0, 2), (4, 0.0, 0)]
    kind.spec_for = lambda _g: SimpleNamespace(prompt_tokens=5, turns=turns, reward=1.0)
    prompts: list[list[int]] = []
    last_body = {"text": b'{"choices":[{"token_ids":[9,9,9,9]}]}'}

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        prompts.append(body["token_ids"])
        if len(prompts) % 3 == 0:
            return web.Response(body=last_body["text"], content_type="application/json")
        return web.json_response({"choices": [{"token_ids": [1000 + len(prompts)] * 3}]})

    async def main() -> object:
        app = web.Application()
        app.router.add_post("/inference/v1/generate", generate)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        try:
            out = await kind.run(_ctx(0, url, tmp_path))
            last_body["text"] = b"<html>bad gateway</html>"
            with pytest.raises(ValueError, match="non-JSON"):
                await kind.run(_ctx(1, url, tmp_path))
            return out
        finally:
            await runner.cleanup()

    outcome = asyncio.run(main())
    assert len(outcome.transcript) == 3
    first, second, third = prompts[:3]
    assert len(first) == 5
    assert second[:5] == first and second[5:8] == [1001] * 3 and len(second) == 10
    assert third[:10] == second and third[10:13] == [1002] * 3 and len(third) == 15


def test_an_idempotent_admin_request_is_sent_again_after_a_connection_failure():
    """Two connection failures, then an answer: three sends, waits 0.5 then 1 s; a fourth
    failure in a row (attempts=3) is raised; an HTTP error answer is not repeated."""
    sends: list[int] = []
    waits: list[float] = []

    async def sleep(s: float) -> None:
        waits.append(s)

    def sender(failures: int, status: int = 200):
        async def send() -> httpx.Response:
            sends.append(1)
            if len(sends) <= failures:
                raise httpx.ReadError("")
            return httpx.Response(status)

        return send

    resp = asyncio.run(shared_http.idempotent(sender(2), sleep=sleep))
    assert resp.status_code == 200 and len(sends) == 3 and waits == [0.5, 1.0]
    sends.clear()
    with pytest.raises(httpx.ReadError):
        asyncio.run(shared_http.idempotent(sender(3), sleep=sleep))
    assert len(sends) == 3
    sends.clear()
    assert asyncio.run(shared_http.idempotent(sender(0, 503), sleep=sleep)).status_code == 503
    assert len(sends) == 1
    assert shared_http.why(httpx.ReadError("")) == "ReadError"
