"""Emulated engines (a test double at scale) behind the real ``tidal proxy``: one ``tidal emulate``
process serves the four engines of the dapo-math-32gpu scenario, each on its own port; the
proxy (backend ``emulated``) routes chat and token-in calls to them, and a drain of an engine
with calls in flight moves them (KV handoff) so that each still gets its whole token budget.
Every duration of the scenario is divided by k."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tidal.serving.emulated_farm import start_farm
from tidal.serving.launch import start_proxy

TOKEN = "emulated-engines"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
K = 50.0
CALLS, BUDGET = 8, 20000


@pytest.fixture(scope="module")
def farm_and_proxy(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("emulated")
    farm = start_farm("dapo-math-32gpu", K, token=TOKEN, log_path=tmp / "farm.log")
    proxy = None
    try:
        u = farm.urls
        proxy = start_proxy(
            [u["s0"], u["s1"]],
            [u["c0"], u["c1"]],
            TOKEN,
            engine_token=TOKEN,
            backend="emulated",
            cap=128,
            request_timeout_s=60,
            log_path=tmp / "proxy.log",
        ).wait_healthy(60)
        yield farm, proxy
    finally:
        if proxy is not None:
            proxy.stop()
        farm.stop()


def test_one_process_serves_the_scenarios_engines_with_the_builtin_routes(farm_and_proxy):
    farm, proxy = farm_and_proxy
    assert sorted(farm.urls) == ["c0", "c1", "s0", "s1"]
    assert len({u.rsplit(":", 1)[1] for u in farm.urls.values()}) == 4  # a port each
    stats = httpx.get(f"{farm.urls['c1']}/stats", headers=ADMIN, timeout=5).json()
    assert stats["emulated"] is True and stats["k"] == K and stats["capacity"] == 128
    assert httpx.get(f"{farm.urls['s0']}/stats", timeout=5).status_code == 401  # guarded
    r = httpx.post(
        f"{proxy.url}/v1/chat/completions",
        headers=ADMIN,
        json={"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 40},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and r.json()["usage"]["completion_tokens"] == 40


def test_calls_in_flight_survive_a_drain_with_their_whole_budget(farm_and_proxy):
    farm, proxy = farm_and_proxy

    async def main():
        async with httpx.AsyncClient(base_url=proxy.url, headers=ADMIN, timeout=120) as c:

            async def call(i: int) -> dict:
                r = await c.post(
                    "/inference/v1/generate",
                    headers={"X-Tidal-Execution": f"x{i}"},
                    json={
                        "model": "qwen3.5-35b-a3b",
                        "token_ids": [5 + i, 17, 42, 9, 33],
                        "sampling_params": {"max_tokens": BUDGET, "ignore_eos": True},
                    },
                )
                assert r.status_code == 200, r.text
                return r.json()

            tasks = [asyncio.create_task(call(i)) for i in range(CALLS)]
            deadline = time.monotonic() + 30
            victim = None
            while victim is None and time.monotonic() < deadline:
                members = (await c.get("/tidal/engines")).json()["engines"]
                busy = [m for m in members if m["inflight"] >= 1]
                victim = busy[0]["id"] if busy else None
                await asyncio.sleep(0.05)
            assert victim is not None
            await asyncio.sleep(0.5)  # tokens decoded there before the drain
            d = await c.post(f"/tidal/engines/{victim}/drain")
            assert d.status_code == 200, d.text
            answers = await asyncio.gather(*tasks)
            await c.post(f"/tidal/engines/{victim}/undrain")
            return victim, answers

    victim, answers = asyncio.run(main())
    for a in answers:
        assert len(a["choices"][0]["token_ids"]) == BUDGET
    moved = httpx.get(f"{farm.urls[victim]}/stats", headers=ADMIN, timeout=5).json()
    assert moved["aborted"] >= 1
