"""Registration (``POST /tidal/executions``, open on loopback) stays small and bounded: metadata
over 4 KiB is a 400 naming ``metadata``; a closed execution keeps no metadata and only the newest
``max_closed`` ids; one idle past its bound is closed (``timeout``) and forgotten in turn."""

from __future__ import annotations

import asyncio

import httpx

from tidal.agents.events import EventLog, ExecutionRegistry
from tidal.clock import ManualClock
from tidal.serving.proxy import Proxy, ProxyConfig
from tidal.serving.proxy_app import build_proxy_app

TOKEN = "reg-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
MAX_METADATA_BYTES = 4096  # the documented cap (docs/serving.md, proxy_app.MAX_METADATA_BYTES)


def test_registration_metadata_is_capped_and_dropped_at_close(serve_asgi):
    """300 registrations of (nearly) the largest metadata allowed, then their closes: the
    registry holds none of it afterwards (before: 1 MiB each, kept for ever)."""
    blob = "a" * (MAX_METADATA_BYTES - 20)

    async def main():
        proxy = Proxy(ProxyConfig(admin_token=TOKEN))
        app = build_proxy_app(proxy)
        registry = app.state.registry
        # registering is the driver's (the admin token); naming by header with it too
        async with (
            serve_asgi(app) as url,
            httpx.AsyncClient(base_url=url, timeout=30, headers=ADMIN) as c,
        ):
            big = await c.post("/tidal/executions", json={"metadata": {"b": "a" * 5000}})
            ids = [
                (await c.post("/tidal/executions", json={"metadata": {"b": blob}})).json()[
                    "execution_id"
                ]
                for _ in range(300)
            ]
            held_open = (await c.get("/tidal/stats", headers=ADMIN)).json()
            for eid in ids:
                await c.post(f"/tidal/executions/{eid}/close", json={}, headers=ADMIN)
            closed = await c.post(
                "/v1/completions",
                headers={"X-Tidal-Execution": ids[0]},
                json={"prompt": [1], "max_tokens": 1},
            )
            held_closed = (await c.get("/tidal/stats", headers=ADMIN)).json()
        return big, held_open, held_closed, closed, registry

    big, held_open, held_closed, closed, registry = asyncio.run(main())
    msg = big.json()["error"]["message"]
    assert big.status_code == 400 and msg.startswith("metadata:"), big.text
    assert str(MAX_METADATA_BYTES) in msg
    assert held_open["open_executions"] == 300 and held_closed["open_executions"] == 0
    assert closed.status_code == 409  # a closed id is still refused
    assert len(registry) == 300 and all(not s.metadata for s in registry._by_id.values())
    assert registry.max_open == registry.max_closed == 10_000


def test_the_registry_stays_bounded_over_many_registrations():
    clock = ManualClock()
    events = EventLog(max_events=1000)
    reg = ExecutionRegistry(events, max_open=100, max_closed=200, idle_s=60.0, clock=clock)
    for i in range(10_000):
        reg.dispatch("g", f"x{i}", {"n": i})
        reg.launch(f"x{i}")
        reg.close(f"x{i}", "completed", 1.0)
        assert len(reg) <= 200 and len(events.events) <= 1000
    assert reg.close("x9999") is False and reg.duplicate_closes == 1  # recent: remembered
    assert not reg.is_open("x0") and "x0" not in reg._by_id  # old: forgotten

    # idle ones: 50 never called, 10 with a long call timeout of their own, 1 still busy
    for i in range(50):
        reg.dispatch("g", f"idle{i}")
    for i in range(10):
        reg.dispatch("g", f"slow{i}", {"timeout_s": 600.0})
    reg.dispatch("g", "busy")
    clock.advance(59.0)
    reg.launch("busy")  # a call starts: it is not idle
    clock.advance(2.0)
    reg.dispatch("g", "trigger")  # registrations sweep (at most once a second)
    assert reg.expired == 50 and reg.open_count() == 12
    assert all(not reg.is_open(f"idle{i}") for i in range(50))
    assert reg.is_open("busy") and reg.is_open("slow0")
    assert ("closed", "idle0", "g", "timeout", None) in events.events
    clock.advance(600.0)
    reg.dispatch("g", "trigger2")
    assert reg.open_count() == 1 and reg.expired == 62  # the slow ones' bound passed too
