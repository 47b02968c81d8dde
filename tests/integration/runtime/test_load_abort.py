"""A cell whose engine does not take a weight version never rejoins routing: the real plan
(the controller's waterlevel policy returns the core cell to rollout at a burst's end) runs its
steps on the real actuator until the load (the built-in engine's wake loads the current
version), which the cell's real engine refuses (the published
version holds NaN weights: a 400 naming the file); the controller retries, then aborts, and
the actuator's abort puts the cell back in training (out of routing, engine asleep, trainer
active), while the engine keeps the version it had.

Real parts: a ``tidal proxy`` process, a standalone built-in engine, the cell's ``EngineHost``
with its own built-in engine process, the ``Controller`` and the ``RayActuator``. Not Ray
itself: the host is called the way Ray calls an actor (``.method.remote(...)``, run in a
thread), and ``engines`` gives the actuator the one cell (``Engines`` needs a placement group
and a started Ray; the Ray path is what ``tidal run`` tests cover, on 2 cores a Ray start here
would double this test's time).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest
import torch
from safetensors.torch import save_file

from tidal.clock import ManualClock
from tidal.control.cells import Cell, CellSet, Standalone
from tidal.control.controller import Controller, ControllerSettings
from tidal.control.plans import StepKind
from tidal.control.policy import make_policy
from tidal.runtime.actuator import CoreLink, RayActuator, Weights
from tidal.runtime.cell import EngineHost
from tidal.runtime.tasks import Parts
from tidal.serving.launch import start_engine, start_proxy
from tidal.types import BurstStarted, Role, TrainerStepDone

TOKEN = "load-abort"


class AsActor:
    """``host.method.remote(*args)`` -> an awaitable, as on a Ray actor handle."""

    def __init__(self, host: EngineHost) -> None:
        self.host = host

    def __getattr__(self, name: str):
        method = getattr(self.host, name)
        return SimpleNamespace(remote=lambda *a: asyncio.to_thread(method, *a))


def _poisoned_version(model_dir, path) -> str:
    """v2 as the publisher writes it, every value NaN (a diverged update)."""
    from tidal.models import load_model

    model, _ = load_model(model_dir)
    save_file({k: torch.full_like(v, float("nan")) for k, v in model.named_parameters()}, str(path))
    return str(path)


@pytest.mark.timeout(300)
def test_a_refused_load_aborts_the_plan_back_to_training(tmp_path, monkeypatch):
    from tidal.models import create_tiny

    monkeypatch.setenv("TIDAL_ENGINE_TOKEN", TOKEN)
    model = create_tiny(tmp_path / "tiny", seed=3)
    v2 = _poisoned_version(model, tmp_path / "v2.safetensors")
    host = EngineHost("c0", str(model), 4, str(tmp_path))
    proxy = start_proxy([], [], TOKEN, kv_handoff=False, log_path=tmp_path / "proxy.log")
    s0 = start_engine(model, log_path=tmp_path / "s0.log", token=TOKEN)

    async def main():
        async with httpx.AsyncClient(
            base_url=proxy.url, timeout=60, headers={"Authorization": f"Bearer {TOKEN}"}
        ) as admin:
            for body in (
                {"id": "s0", "url": s0.url},
                {"id": "c0", "url": url, "kind": "cell", "cell_index": 0},
            ):
                (await admin.post("/tidal/engines", json=body)).raise_for_status()
            engines = SimpleNamespace(  # one node: every load is the driver's file
                cell=lambda i: actor,
                transport=lambda eid: "file",
                is_server=lambda eid: False,
                load=lambda eid, a, path, label: a.load_weights.remote(path, label),
            )
            clock, parts = ManualClock(), Parts()
            act = RayActuator(
                clock, admin, engines, Weights(version=2, path=v2), False, parts, CoreLink()
            )
            ctl = Controller(
                CellSet([Cell(0, 4, 8)], [Standalone("s0", 4, 8)]),
                make_policy("waterlevel"),
                clock,
                act,
                ControllerSettings(batch_groups=1, updates_per_burst=1, max_step_retries=1),
                initial_prefix=1,
            )
            act.bind(ctl.handle)
            await act.begin_in_training(0)
            ctl.handle(BurstStarted(clock.now(), 0, 4))
            ctl.handle(TrainerStepDone(clock.now(), 1, final_of_burst=True))  # core returns
            for _ in range(1200):  # the plan's steps run as tasks; its abort restores
                if ctl.plans_aborted and 0 in act.training and act.is_asleep(0):
                    break
                parts.check()
                await asyncio.sleep(0.05)
            engines = {e["id"]: e for e in (await admin.get("/tidal/engines")).json()["engines"]}
            held = (await admin.get(f"{url}/weight_info")).json()["weight_version"]
            return engines["c0"], act, ctl, held

    try:
        url = host.start(120)
        actor = AsActor(host)
        proxy.wait_healthy(60)
        s0.wait_healthy(120)
        c0, act, ctl, held = asyncio.run(main())
        served = host.describe()
    finally:
        host.stop()
        s0.stop()
        proxy.stop()
    # the built-in engine wakes straight into the current version: its wake is the load
    loads = [s for s in act.step_log if s["step"] == StepKind.WAKE_ENGINE.value]
    assert ctl.plans_aborted == 1 and len(loads) == 2 and not any(s["ok"] for s in loads)
    assert not [s for s in act.step_log if s["step"] == StepKind.LOAD_WEIGHTS.value]
    assert "HTTP 400" in loads[0]["error"] and "v2.safetensors" in loads[0]["error"]
    assert "NaN" in loads[0]["error"], loads[0]["error"]
    assert not [s for s in act.step_log if s["step"] == StepKind.RESUME_ADMISSION.value]
    assert not c0["admitting"]  # never rejoined with weights it does not hold
    assert ctl.cells.roles() == (Role.TRAINING,)
    assert served["state"] == "asleep" and act.is_asleep(0) and 0 in act.training
    assert act.is_held_out(0)
    assert held == served["version"] == "v0"  # the engine kept the version it had
