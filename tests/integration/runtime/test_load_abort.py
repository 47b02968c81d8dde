"""A cell whose engine serves another version after its load never rejoins routing: the load
step fails with one line, and the aborted training -> rollout plan puts the cell back in
training (out of routing, engine asleep, trainer active).

Real parts: a ``tidal proxy`` process, a standalone built-in engine, and the cell's
``EngineHost`` with its own built-in engine process; the cell's host is called the way the
actuator calls a Ray actor (``.method.remote(...)``, here run in a thread). The fault is injected
in the host: its load reports the version the engine held before (a server that did not take
the new weights).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest

from tidal.clock import ManualClock
from tidal.runtime.actuator import CoreLink, RayActuator, Weights
from tidal.runtime.cell import EngineHost, RuntimeFailure
from tidal.runtime.tasks import Parts
from tidal.serving.launch import start_engine, start_proxy

TOKEN = "load-abort"


class StaleHost(EngineHost):
    """An engine host whose engine keeps serving what it served: a load that did not land."""

    def load_weights(self, path: str, version: str) -> str:
        return self.loaded_version


class AsActor:
    """``host.method.remote(*args)`` -> an awaitable, as on a Ray actor handle."""

    def __init__(self, host: EngineHost) -> None:
        self.host = host

    def __getattr__(self, name: str):
        method = getattr(self.host, name)
        return SimpleNamespace(remote=lambda *a: asyncio.to_thread(method, *a))


@pytest.mark.timeout(300)
def test_a_load_that_serves_another_version_aborts_back_to_training(tmp_path, monkeypatch):
    from tidal.models import create_tiny

    monkeypatch.setenv("TIDAL_ENGINE_TOKEN", TOKEN)
    model = create_tiny(tmp_path / "tiny", seed=3)
    host = StaleHost("c0", str(model), 4, str(tmp_path))
    proxy = start_proxy([], [], TOKEN, kv_handoff=False, log_path=tmp_path / "proxy.log")
    s0 = start_engine(model, log_path=tmp_path / "s0.log", token=TOKEN)

    async def main() -> tuple[dict, RayActuator, str, str]:
        async with httpx.AsyncClient(base_url=proxy.url, timeout=60, headers={
                "Authorization": f"Bearer {TOKEN}"}) as admin:
            for body in ({"id": "s0", "url": s0.url},
                         {"id": "c0", "url": url, "kind": "cell", "cell_index": 0}):
                (await admin.post("/tidal/engines", json=body)).raise_for_status()
            engines = SimpleNamespace(  # one node: every load is the driver's file
                cell=lambda i: actor, transport=lambda eid: "file",
                load=lambda eid, a, path, label: a.load_weights.remote(path, label))
            act = RayActuator(ManualClock(), admin, engines,
                              Weights(version=2, path=str(tmp_path / "v2.safetensors")),
                              False, Parts(), CoreLink())
            await act.begin_in_training(0)
            # training -> rollout, as the plan's steps run it, until the load
            await act._deactivate(0)
            await act._wake(0)
            with pytest.raises(RuntimeFailure) as info:
                await act._load(0)
            await act._back_to_training((0,))  # what the plan's abort runs
            engines = {e["id"]: e for e in (await admin.get("/tidal/engines")).json()["engines"]}
            return engines["c0"], act, str(info.value), host.describe()["state"]

    try:
        url = host.start(120)
        actor = AsActor(host)
        proxy.wait_healthy(60)
        s0.wait_healthy(120)
        c0, act, error, state = asyncio.run(main())
    finally:
        host.stop()
        s0.stop()
        proxy.stop()
    assert error == "cell 0 serves 'v0' after loading 'v2'"
    assert not c0["admitting"]  # never rejoined with other weights
    assert state == "asleep" and act.is_asleep(0) and 0 in act.training
    assert act.is_held_out(0)
