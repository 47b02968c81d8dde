"""The runtime side of the deterministic hold (``tidal.runtime.deterministic.Boundaries``):
at a boundary the burst's groups go to the buffer's training order, dispatch waits while an
engine in routing serves an older version (one out of routing is not waited for), the wait is
reported, and an engine that never loads the version ends the run in one line naming it."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tidal.clock import ManualClock
from tidal.errors import TimeoutExpired
from tidal.runtime.deterministic import Boundaries


class Actor:
    """An engine actor whose ``describe`` reports the version it serves."""

    def __init__(self, version: str) -> None:
        self.version = version
        self.describe = self  # actor.describe.remote()

    def remote(self):
        async def answer():
            return {"version": self.version}

        return answer()


class Engines:
    def __init__(self, **versions: str) -> None:
        self.actors = {eid: Actor(v) for eid, v in versions.items()}


class Buffer:
    def __init__(self) -> None:
        self.expected: list[str] = []

    def expect(self, ids: list[str]) -> None:
        self.expected += ids


def _admin(routed: dict[str, bool]) -> httpx.AsyncClient:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/tidal/engines"
        return httpx.Response(
            200,
            json={
                "engines": [
                    {"id": eid, "admitting": ok, "alive": True} for eid, ok in routed.items()
                ]
            },
        )

    return httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://proxy")


def test_dispatch_waits_for_routed_engines_to_serve_the_version():
    clock, engines, buffer = ManualClock(), Engines(s0="v2", c0="v0", c1="v0"), Buffer()
    gate = Boundaries(
        clock,
        _admin({"s0": True, "c0": False, "c1": True}),
        engines,
        buffer,
        timeout_s=60.0,
        poll_s=0.5,
    )

    async def main():
        waiting = asyncio.ensure_future(gate.at(1, "v2", ["b1-g0", "b1-g1"]))
        while clock.now() < 3.0:  # c1 still loads; c0 (asleep, out of routing) never matters
            await asyncio.sleep(0)
            assert not waiting.done()
        engines.actors["c1"].version = "v2"
        await waiting

    asyncio.run(main())
    assert buffer.expected == ["b1-g0", "b1-g1"]
    report = gate.hold.report()
    assert report["deterministic_boundaries"] == 1
    assert report["deterministic_held_boundaries"] == 1
    assert 3.0 <= report["deterministic_hold_s"] <= 4.0


def test_an_engine_that_never_serves_the_version_ends_the_run_naming_it():
    clock = ManualClock()
    gate = Boundaries(clock, _admin({"s0": True}), Engines(s0="v0"), Buffer(), timeout_s=5.0)
    with pytest.raises(TimeoutExpired, match=r"burst 2: engines s0 do not serve v4 after 5 s"):
        asyncio.run(gate.at(2, "v4", []))
