"""The Ray actuator: runs the controller's plan steps against the proxy and the cell actors.

In: ``execute(plan, step)`` calls from the controller (on the driver's event loop). Out: one
``TransitionStepDone`` per step, delivered back through ``controller.handle`` on the same loop;
engine state changes in the cell actors; drains and undrains in the proxy (admin HTTP API).

Rollout -> training (QwenGyre): STOP_ADMISSION runs the proxy's drain, which stops admission,
reserves destinations (standalone first, then rollout cells in descending order), cancels the
source's requests and waits until the proxy retried each of them elsewhere (optionally with a KV
handoff); RESERVE_AND_REROUTE, CANCEL_AND_RETRY and KV_HANDOFF check in the proxy's view that this
really happened (source not admitting, a routable destination, nothing in flight at the source);
RELEASE_ROLLOUT_MEMORY puts the engine to sleep; RESTORE_TRAINING_STATE activates the cell's
trainer worker (cell 0: the core in the driver; cells 1..K-1: a satellite process in the cell actor
that joins the core's steps). Training -> rollout: OFFLOAD_TRAINING_STATE waits for a running
trainer step to finish and deactivates the worker (a satellite process ends; on a GPU the core's
model and optimizer state move to CPU memory, and back on activation); WAKE_ENGINE,
LOAD_WEIGHTS (the current published version, not the one at plan time), RESUME_ADMISSION (undrain).
Invariant 4 is the proxy's; this module keeps the ordering: an engine sleeps only after its drain
returned, and rejoins routing only after it loaded the current weights. verl plan styles are not
executed by this slice: their steps fail with a clear error."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from tidal.clock import Clock
from tidal.control.plans import PlanStep, StepKind, TransitionPlan
from tidal.runtime.cell import RuntimeFailure
from tidal.types import Direction, TransitionStepDone

log = logging.getLogger(__name__)


@dataclass
class Weights:
    """The latest version published to engines (path on local disk, label ``v<n>``)."""

    version: int = 0
    path: str | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def label(self) -> str:
        return f"v{self.version}"


class RayActuator:
    def __init__(self, clock: Clock, admin: httpx.AsyncClient, cells: list[Any],
                 weights: Weights, kv_handoff: bool) -> None:
        self.clock = clock
        self.admin = admin  # base_url = proxy, bearer header set
        self.cells = cells  # Ray actor handles of EngineHost, by cell index
        self.weights = weights
        self.kv_handoff = kv_handoff
        self.controller = None
        self.core_address: dict | None = None  # set by the driver: satellites connect here
        self.core_memory: Any = None  # the core trainer when it shares cell 0's GPU
        self.satellite_timeout_s = 120.0
        self.satellite_starts = 0
        self.satellite_pids: dict[int, int] = {}  # cell -> pid (ended by pid if its actor dies)
        self.training: set[int] = set()  # cells whose trainer worker is active
        self.asleep: set[int] = set()
        self.trainer_lock = asyncio.Lock()  # held by the trainer during an optimizer step
        self.training_changed = asyncio.Event()
        self.drains: list[dict] = []
        self.step_log: list[dict] = []
        self._tasks: set[asyncio.Task] = set()

    def bind(self, controller) -> RayActuator:
        self.controller = controller
        return self

    @staticmethod
    def engine_id(cell: int) -> str:
        return f"c{cell}"

    # -- Actuator protocol ----------------------------------------------------------------
    def execute(self, plan: TransitionPlan, step: PlanStep) -> None:
        task = asyncio.get_running_loop().create_task(self._run(plan, step))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def abort(self, plan: TransitionPlan, failed: PlanStep, error: str) -> None:
        log.warning("plan %d aborted at %s: %s; restoring the source role", plan.plan_id,
                    failed.kind.value, error)
        if plan.direction is Direction.TO_TRAINING:
            task = asyncio.get_running_loop().create_task(self._back_to_rollout(plan.cells))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _back_to_rollout(self, cells: tuple[int, ...]) -> None:
        for i in cells:
            try:
                await self._deactivate(i)
                await self._wake(i)
                await self._load(i)
                await self._admin("post", f"/tidal/engines/{self.engine_id(i)}/undrain")
            except Exception:
                log.exception("cell %d: could not restore rollout after an abort", i)

    async def _run(self, plan: TransitionPlan, step: PlanStep) -> None:
        t0 = time.perf_counter()
        ok, error = True, ""
        try:
            for cell in step.cells:
                await self._do(step.kind, cell)
        except Exception as exc:
            ok, error = False, f"{type(exc).__name__}: {exc}"
            log.warning("plan %d step %s on %s failed: %s", plan.plan_id, step.kind.value,
                        list(step.cells), error)
        took = time.perf_counter() - t0
        self.step_log.append({"plan_id": plan.plan_id, "step": step.kind.value,
                              "cells": list(step.cells), "ok": ok, "duration_s": round(took, 4),
                              "error": error})
        self.controller.handle(TransitionStepDone(self.clock.now(), plan.plan_id, step.index,
                                                  ok=ok, duration_s=took, error=error))

    # -- steps ------------------------------------------------------------------------------
    async def _do(self, kind: StepKind, cell: int) -> None:
        eid = self.engine_id(cell)
        if kind in (StepKind.STOP_ADMISSION, StepKind.REMOVE_FROM_LOAD_BALANCER):
            # verl's remove-from-load-balancer is followed by its abort of in-flight requests
            # (retried elsewhere with prompt + tokens so far, re-prefilled: no KV handoff); the
            # proxy's drain does both, so ABORT_INFLIGHT then checks that it happened.
            handoff = self.kv_handoff and kind is StepKind.STOP_ADMISSION
            out = await self._admin("post", f"/tidal/engines/{eid}/drain",
                                    params={"handoff": str(handoff).lower()})
            self.drains.append({"cell": cell, **out})
            log.info("cell %d drained: %d requests moved in %.3f s", cell, out["moved"],
                     out["duration_s"])
        elif kind is StepKind.RESERVE_AND_REROUTE:
            engines = await self._engines()
            if engines[eid]["admitting"]:
                raise RuntimeFailure(f"{eid} still admits requests after its drain")
            if not any(e["admitting"] and e["alive"] for k, e in engines.items() if k != eid):
                raise RuntimeFailure(f"no routable engine left to take {eid}'s requests")
        elif kind in (StepKind.CANCEL_AND_RETRY, StepKind.ABORT_INFLIGHT):
            engines = await self._engines()
            if engines[eid]["inflight"]:
                raise RuntimeFailure(f"{eid} still holds {engines[eid]['inflight']} requests")
        elif kind is StepKind.KV_HANDOFF:
            last = next((d for d in reversed(self.drains) if d["cell"] == cell), None)
            if last is None or last["kv_handoff"] != self.kv_handoff:
                raise RuntimeFailure(f"{eid}: the drain did not use the KV handoff")
        elif kind in (StepKind.RELEASE_ROLLOUT_MEMORY, StepKind.SLEEP_ENGINE):
            async with self.weights.lock:  # never interleave with a publication's loads
                await self.cells[cell].sleep.remote()
                self.asleep.add(cell)
        elif kind is StepKind.RESTORE_TRAINING_STATE:
            await self.activate(cell)
        elif kind is StepKind.OFFLOAD_TRAINING_STATE:
            await self._deactivate(cell)
        elif kind is StepKind.WAKE_ENGINE:
            await self._wake(cell)
        elif kind in (StepKind.LOAD_WEIGHTS, StepKind.SYNC_WEIGHTS):
            await self._load(cell)
        elif kind in (StepKind.RESUME_ADMISSION, StepKind.ADD_TO_LOAD_BALANCER):
            await self._admin("post", f"/tidal/engines/{eid}/undrain")
        elif kind is StepKind.RESUME_GENERATION:
            engines = await self._engines()  # engines are never paused here: check it serves
            if not (engines[eid]["admitting"] and engines[eid]["alive"]):
                raise RuntimeFailure(f"{eid} does not serve after its activation")
        else:
            raise RuntimeFailure(f"step {kind.value} is not supported by this runtime")

    async def activate(self, cell: int) -> None:
        """The cell's trainer worker joins training: the core, or a satellite process."""
        if cell > 0 and self.core_address is not None:
            self.satellite_pids[cell] = await self.cells[cell].start_satellite.remote(
                cell, self.core_address, self.satellite_timeout_s)
            self.satellite_starts += 1
        if cell == 0 and self.core_memory is not None:
            async with self.trainer_lock:
                await asyncio.to_thread(self.core_memory.onload)
        self.training.add(cell)
        self.training_changed.set()

    async def revive_satellites(self) -> int:
        """Restart the satellite of any training cell whose process ended (a crash, or a join
        that timed out during a long rollout phase); returns how many were restarted."""
        n = 0
        for cell in sorted(self.training - {0}):
            if self.core_address is None or await self.cells[cell].satellite_alive.remote():
                continue
            log.warning("cell %d: satellite process ended while training; restarting it", cell)
            self.satellite_pids[cell] = await self.cells[cell].start_satellite.remote(
                cell, self.core_address, self.satellite_timeout_s)
            self.satellite_starts += 1
            n += 1
        return n

    async def _deactivate(self, cell: int) -> None:
        async with self.trainer_lock:  # a running step finishes first: leave between steps
            self.training.discard(cell)
            if cell > 0:
                await self.cells[cell].stop_satellite.remote()
                self.satellite_pids.pop(cell, None)
            elif self.core_memory is not None:  # the engine wakes on this GPU next
                await asyncio.to_thread(self.core_memory.offload)
        self.training_changed.set()

    async def _wake(self, cell: int) -> None:
        async with self.weights.lock:
            await self.cells[cell].wake.remote()
            self.asleep.discard(cell)

    async def _load(self, cell: int) -> None:
        async with self.weights.lock:
            if self.weights.path is not None:
                await self.cells[cell].load_weights.remote(self.weights.path,
                                                           self.weights.label)

    # -- proxy admin ------------------------------------------------------------------------
    async def _admin(self, method: str, path: str, **kw) -> dict:
        try:
            resp = await self.admin.request(method.upper(), path, **kw)
        except httpx.HTTPError as exc:
            raise RuntimeFailure(f"proxy {path}: {exc!r}") from None
        if resp.status_code != 200:
            raise RuntimeFailure(f"proxy {path}: HTTP {resp.status_code} {resp.text[:200]}")
        return resp.json()

    async def _engines(self) -> dict[str, dict]:
        out = await self._admin("get", "/tidal/engines")
        return {e["id"]: e for e in out["engines"]}

    async def wait_idle(self, timeout_s: float) -> None:
        """Bounded wait for step tasks still running (shutdown)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)
