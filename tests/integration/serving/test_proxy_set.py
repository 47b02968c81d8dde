"""Two ``tidal proxy`` processes as one proxy (``runtime.proxy_processes: 2``,
``tidal.serving.proxy_set``), real HTTP on loopback, two built-in engine processes: executions
are partitioned by id (each execution's base URL names its process), both processes see both
engines (a join through ``FanOut`` reaches each, the cap split between them), and a drain
through ``FanOut`` moves the calls of both processes with 0 failed calls; the moved calls
are retried elsewhere by their own process; every record comes back from its owner."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tidal.serving.execution_keys import execution_key, execution_url
from tidal.serving.launch import start_engine
from tidal.serving.proxy_set import owner, start_proxies

TOKEN = "proxy-set"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
PER_PROXY, BUDGET, CAP = 4, 80, 8


def _ids() -> list[str]:
    """``PER_PROXY`` executions owned by each of the 2 processes."""
    got: dict[int, list[str]] = {0: [], 1: []}
    i = 0
    while min(len(v) for v in got.values()) < PER_PROXY:
        eid, i = f"ex{i}", i + 1
        if len(got[owner(eid, 2)]) < PER_PROXY:
            got[owner(eid, 2)].append(eid)
    return got[0] + got[1]


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("proxy-set")
    engines = [start_engine(tiny_model, log_path=tmp / f"e{i}.log", token=TOKEN) for i in range(2)]
    proxies = None
    try:
        for e in engines:
            e.wait_healthy(120)
        proxies = start_proxies(
            2, TOKEN, log_path=tmp / "proxy.log", request_timeout_s=120
        ).wait_healthy(60)
        yield engines, proxies
    finally:
        if proxies is not None:
            proxies.stop()
        for e in engines:
            e.stop()


async def _call(eid: str, url: str, turn: int) -> dict:
    headers = {"Authorization": f"Bearer {execution_key(TOKEN, eid)}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as c:
        r = await c.post(
            "/completions",
            json={
                "model": "tiny",
                "prompt": [5 + turn, 17, 42, 9, 33],
                "max_tokens": BUDGET,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
    assert r.status_code == 200, r.text
    return r.json()


async def _view(plain: httpx.AsyncClient, url: str, what: str = "engines") -> dict:
    """One process's own answer (not through ``FanOut``)."""
    r = await plain.get(f"{url}/tidal/{what}")
    assert r.status_code == 200, r.text
    return r.json()


async def _busy(plain: httpx.AsyncClient, urls: list[str]) -> str:
    """An engine holding calls of both processes (read from each process's own view)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        views = [{e["id"]: e["inflight"] for e in (await _view(plain, u))["engines"]} for u in urls]
        for eid in ("e0", "e1"):
            if all(v.get(eid, 0) >= 1 for v in views) and sum(v[eid] for v in views) >= 3:
                return eid
        await asyncio.sleep(0.02)
    raise AssertionError("no engine got calls of both proxy processes")


def test_two_proxy_processes_drain_with_no_failed_call(setup):
    engines, proxies = setup
    ids = _ids()

    async def main() -> None:
        async with (
            httpx.AsyncClient(
                base_url=proxies.url, headers=ADMIN, timeout=120, transport=proxies.transport()
            ) as admin,
            httpx.AsyncClient(headers=ADMIN, timeout=30) as plain,
        ):
            for i, e in enumerate(engines):
                r = await admin.post(
                    "/tidal/engines", json={"id": f"e{i}", "url": e.url, "cap": CAP}
                )
                assert r.status_code == 200 and r.json()["cap"] == CAP, r.text
            for u in proxies.urls:  # one engine view, the cap split
                own = (await _view(plain, u))["engines"]
                assert sorted((e["id"], e["cap"]) for e in own) == [("e0", 4), ("e1", 4)]
            for eid in ids:
                r = await admin.post(
                    "/tidal/executions", json={"execution_id": eid, "group_id": "g"}
                )
                assert r.status_code == 200, r.text
            urls = {eid: execution_url(proxies.url_for(eid), eid) for eid in ids}
            first = [asyncio.create_task(_call(eid, urls[eid], 0)) for eid in ids]
            victim = await _busy(plain, proxies.urls)
            r = await admin.post(f"/tidal/engines/{victim}/drain")
            assert r.status_code == 200 and r.json()["moved"] >= 3, r.text
            answers = await asyncio.gather(*first)
            second = await asyncio.gather(*[_call(eid, urls[eid], 1) for eid in ids])
            r = await admin.post(f"/tidal/engines/{victim}/undrain")
            assert r.status_code == 200 and r.json()["admitting"], r.text
            for ans in answers + second:
                assert len(ans["choices"][0]["token_ids"]) == BUDGET
            for eid, ans in zip(ids, answers, strict=True):  # each record at its owner
                calls = (await admin.get(f"/tidal/executions/{eid}/records")).json()["calls"]
                assert len(calls) == 2
                tokens = [t for s in calls[0]["segments"] for t in s["token_ids"]]
                assert tokens == ans["choices"][0]["token_ids"]
            stats = (await admin.get("/tidal/stats")).json()
            assert stats["failed_calls"] == 0 and stats["calls"] == 2 * len(ids)
            assert [p["pid"] for p in stats["process"]] == [s.proc.pid for s in proxies.servers]
            per = [await _view(plain, u, "stats") for u in proxies.urls]
            assert [p["drains"] for p in per] == [1, 1]  # the drain reached both
            assert all(p["calls"] == 2 * PER_PROXY for p in per)  # partitioned by id
            assert all(p["retries"] >= 1 for p in per), [p["retries"] for p in per]
            r = await admin.delete("/tidal/engines/e1")  # a leave reaches both
            assert r.status_code == 200, r.text
            for u in proxies.urls:
                own = (await _view(plain, u))["engines"]
                assert [e["id"] for e in own] == ["e0"]

    asyncio.run(main())
