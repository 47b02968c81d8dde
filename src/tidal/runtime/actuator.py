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
trainer worker (cell 0: the core in the driver; cells 1..K-1: the cell's satellite process, started
at its first stint and kept for the run, joins the core's steps). Training -> rollout:
OFFLOAD_TRAINING_STATE waits for a running optimizer step and deactivates the worker (a satellite
delivers what it computed, leaves its step and parks with its model off the device; on a GPU the
core's model and optimizer state move to CPU memory, and back on activation); WAKE_ENGINE,
LOAD_WEIGHTS (the current published version, not the one at plan time), RESUME_ADMISSION (undrain).
Invariant 4 is the proxy's; this module keeps the ordering: an engine sleeps only after its drain
returned, and rejoins routing only after it loaded the current weights. verl plan styles run
through the same operations under verl's step names (REMOVE_FROM_LOAD_BALANCER drains,
ABORT_INFLIGHT checks the drain emptied the cell, SLEEP_ENGINE, SYNC_WEIGHTS loads,
ADD_TO_LOAD_BALANCER undrains, RESUME_GENERATION checks the cell serves); a step kind without an
operation here (``rebalance``) fails the step with a one-line error."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from tidal.clock import Clock
from tidal.control.plans import PlanStep, StepKind, TransitionPlan
from tidal.errors import TimeoutExpired
from tidal.runtime.cell import RuntimeFailure
from tidal.runtime.engines import EngineId, Engines
from tidal.runtime.tasks import Parts, remote
from tidal.types import Direction, Event, TransitionStepDone

if TYPE_CHECKING:
    from tidal.runtime.ray_types import ActorHandle

log = logging.getLogger(__name__)


@dataclass
class Weights:
    """The latest version published to engines (path on local disk, label ``v<n>``) and the
    handoff that carries it to an engine (``runtime.handoff``; None: ``Engines.load``)."""

    version: int = 0
    path: str | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    handoff: Any = None

    @property
    def label(self) -> str:
        return f"v{self.version}"


@dataclass(frozen=True)
class CoreLink:
    """How training cells reach the core trainer: satellites connect to ``address`` (None: no
    satellites); ``memory`` is the core when it shares cell 0's GPU (offloaded while it serves)."""

    address: dict | None = None
    memory: Any = None
    satellite_timeout_s: float = 120.0
    expect_departure: Callable[[int], None] | None = None  # the core's coordinator, told first
    # the core's coordinator: parks a leaving cell's satellite and lets it join again
    membership: Any = None
    park_timeout_s: float = 60.0  # a satellite not parked by then is stopped instead


class RayActuator:
    def __init__(
        self,
        clock: Clock,
        admin: httpx.AsyncClient,
        engines: Engines,
        weights: Weights,
        kv_handoff: bool,
        parts: Parts,
        core: CoreLink,
        call_timeout_s: float = 180.0,
    ) -> None:
        self.clock = clock
        self.admin = admin  # base_url = proxy, bearer header set
        self.engines = engines  # the actors, by id (the cell supervisor replaces them)
        self.weights = weights
        self.kv_handoff = kv_handoff
        self.parts = parts  # owns every step task: a failure there stops the run
        self.core = core
        self.call_timeout_s = call_timeout_s  # bound on each Ray call (engine ops are 60 s)
        self._handle: Callable[[Event], None] | None = None
        self.satellite_starts = 0
        self.satellite_pids: dict[int, int] = {}  # cell -> pid (ended by pid if its actor dies)
        self.training: set[int] = set()  # cells whose trainer worker is active
        self.asleep: set[int] = set()
        # cells whose wake in the running plan loaded this label (LOAD_WEIGHTS then skips it)
        self._woken_into: dict[int, str] = {}
        self.trainer_lock = asyncio.Lock()  # held by the trainer during an optimizer step
        self.training_changed = asyncio.Event()
        self.drains: list[dict] = []
        self.held_out: set[int] = set()  # cells a plan took out of routing (not yet back)
        self.step_log: list[dict] = []

    def bind(self, handle: Callable[[Event], None]) -> RayActuator:
        """Where step results go: the controller's (guarded) ``handle``."""
        self._handle = handle
        return self

    def _cell(self, cell: int) -> ActorHandle:
        return self.engines.cell(cell)

    async def _call(self, cell: int, method: str, *args: object) -> object:
        """``method`` of cell ``cell``'s actor, bounded, with a one-line error."""
        ref = getattr(self._cell(cell), method).remote(*args)
        return await remote(ref, f"cell {cell} {method}", self.call_timeout_s)

    # -- cell state the supervisor reads ----------------------------------------------------
    def is_asleep(self, cell: int) -> bool:
        return cell in self.asleep

    def forget_satellite(self, cell: int) -> int | None:
        """The satellite pid of a cell whose actor is being replaced (ended by the caller)."""
        return self.satellite_pids.pop(cell, None)

    # -- Actuator protocol ----------------------------------------------------------------
    def execute(self, plan: TransitionPlan, step: PlanStep) -> None:
        self.parts.spawn(f"plan {plan.plan_id} step {step.kind.value}", self._run(plan, step))

    def abort(self, plan: TransitionPlan, failed: PlanStep, error: str) -> None:
        log.warning(
            "plan %d aborted at %s: %s; restoring the source role",
            plan.plan_id,
            failed.kind.value,
            error,
        )
        if plan.direction is Direction.TO_TRAINING:
            self.parts.spawn(f"plan {plan.plan_id} restore", self._back_to_rollout(plan.cells))
        else:  # e.g. a load that served the wrong version: the cell trains on, out of routing
            self.parts.spawn(f"plan {plan.plan_id} restore", self._back_to_training(plan.cells))

    async def _back_to_training(self, cells: tuple[int, ...]) -> None:
        for i in cells:
            try:
                self.held_out.add(i)
                await self._admin("post", f"/tidal/engines/{EngineId.cell(i)}/drain")
                if i not in self.asleep:
                    await self._sleep(i, StepKind.SLEEP_ENGINE)
                if i not in self.training:
                    await self.activate(i)
            except Exception as exc:  # one line: a dead proxy must not print a traceback a tick
                log.warning(
                    "cell %d: could not restore training after an abort: %s: %s",
                    i,
                    type(exc).__name__,
                    exc,
                )

    async def _back_to_rollout(self, cells: tuple[int, ...]) -> None:
        for i in cells:
            try:
                await self._deactivate(i)
                await self._wake(i)
                await self._load(i)
                await self._undrain(i, StepKind.RESUME_ADMISSION)
            except Exception as exc:  # one line: a dead proxy must not print a traceback a tick
                log.warning(
                    "cell %d: could not restore rollout after an abort: %s: %s",
                    i,
                    type(exc).__name__,
                    exc,
                )

    async def _run(self, plan: TransitionPlan, step: PlanStep) -> None:
        t0 = time.perf_counter()
        ok, error, details = True, "", []
        try:
            for cell in step.cells:
                out = await self._do(step.kind, cell)
                if isinstance(out, dict):
                    details.append(out)
        except Exception as exc:
            ok, error = False, f"{type(exc).__name__}: {exc}"
            log.warning(
                "plan %d step %s on %s failed: %s",
                plan.plan_id,
                step.kind.value,
                list(step.cells),
                error,
            )
        took = time.perf_counter() - t0
        self.step_log.append(
            {
                "plan_id": plan.plan_id,
                "step": step.kind.value,
                "cells": list(step.cells),
                "ok": ok,
                "duration_s": round(took, 4),
                "error": error,
            }
        )
        assert self._handle is not None, "bind() before execute()"
        self._handle(
            TransitionStepDone(
                self.clock.now(),
                plan.plan_id,
                step.index,
                ok=ok,
                duration_s=took,
                error=error,
                detail={"moves": details} if details else None,
            )
        )

    # -- steps ------------------------------------------------------------------------------
    async def _do(self, kind: StepKind, cell: int) -> dict | None:
        op = self._ops().get(kind)
        if op is None:
            raise RuntimeFailure(f"step {kind.value} is not supported by this runtime")
        return await op(cell, kind)

    def _ops(self) -> dict[StepKind, Callable[[int, StepKind], Any]]:
        """Each plan step kind (QwenGyre's and verl's names for the same act) -> its op."""
        return {
            StepKind.STOP_ADMISSION: self._drain,
            StepKind.REMOVE_FROM_LOAD_BALANCER: self._drain,
            StepKind.RESERVE_AND_REROUTE: self._check_rerouted,
            StepKind.CANCEL_AND_RETRY: self._check_empty,
            StepKind.ABORT_INFLIGHT: self._check_empty,
            StepKind.KV_HANDOFF: self._check_handoff,
            StepKind.RELEASE_ROLLOUT_MEMORY: self._sleep,
            StepKind.SLEEP_ENGINE: self._sleep,
            StepKind.RESTORE_TRAINING_STATE: lambda c, _: self.activate(c),
            StepKind.OFFLOAD_TRAINING_STATE: lambda c, _: self._deactivate(c),
            StepKind.WAKE_ENGINE: lambda c, _: self._wake(c),
            StepKind.LOAD_WEIGHTS: lambda c, _: self._load(c),
            StepKind.SYNC_WEIGHTS: lambda c, _: self._load(c),
            StepKind.RESUME_ADMISSION: self._undrain,
            StepKind.ADD_TO_LOAD_BALANCER: self._undrain,
            StepKind.RESUME_GENERATION: self._check_serving,
        }

    async def _drain(self, cell: int, kind: StepKind) -> dict:
        # verl's remove-from-load-balancer is followed by its abort of in-flight requests
        # (retried elsewhere with prompt + tokens so far, re-prefilled: no KV handoff); the
        # proxy's drain does both, so ABORT_INFLIGHT then checks that it happened.
        handoff = self.kv_handoff and kind is StepKind.STOP_ADMISSION
        self.held_out.add(cell)  # before the call: a weight load's undrain must not undo it
        out = await self._admin(
            "post",
            f"/tidal/engines/{EngineId.cell(cell)}/drain",
            params={"handoff": str(handoff).lower()},
        )
        self.drains.append({"cell": cell, **out})
        log.info(
            "cell %d drained: %d requests moved in %.3f s", cell, out["moved"], out["duration_s"]
        )
        # each move's choice and cost, for the decision log (never silent)
        return {
            "cell": cell,
            "moved": out["moved"],
            "choice": "kv_handoff" if out["kv_handoff"] else "reprefill",
            "reprefill_tokens": out.get("reprefill_tokens", 0),
        }

    async def _undrain(self, cell: int, kind: StepKind) -> None:
        await self._admin("post", f"/tidal/engines/{EngineId.cell(cell)}/undrain")
        self.held_out.discard(cell)

    def is_held_out(self, cell: int) -> bool:
        return cell in self.held_out

    async def _check_rerouted(self, cell: int, kind: StepKind) -> None:
        eid, engines = str(EngineId.cell(cell)), await self._engines()
        if engines[eid]["admitting"]:
            raise RuntimeFailure(f"{eid} still admits requests after its drain")
        if not any(e["admitting"] and e["alive"] for k, e in engines.items() if k != eid):
            raise RuntimeFailure(f"no routable engine left to take {eid}'s requests")

    async def _check_empty(self, cell: int, kind: StepKind) -> None:
        eid, engines = str(EngineId.cell(cell)), await self._engines()
        if engines[eid]["inflight"]:
            raise RuntimeFailure(f"{eid} still holds {engines[eid]['inflight']} requests")

    async def _check_handoff(self, cell: int, kind: StepKind) -> dict:
        """The drain handed KV over where its engine can (built-in); an engine that cannot
        export KV over HTTP (vLLM, SGLang) re-prefilled instead, and the step says so."""
        last = next((d for d in reversed(self.drains) if d["cell"] == cell), None)
        want = self.kv_handoff and (last or {}).get("kv_capable", True)
        if last is None or last["kv_handoff"] != want:
            raise RuntimeFailure(f"{EngineId.cell(cell)}: the drain did not use the KV handoff")
        return {
            "cell": cell,
            "choice": "kv_handoff" if want else "reprefill",
            "why": "" if want else "its engine cannot export KV (no KV connector wired)",
            "reprefill_tokens": last.get("reprefill_tokens", 0),
        }

    async def _check_serving(self, cell: int, kind: StepKind) -> None:
        eid, engines = str(EngineId.cell(cell)), await self._engines()
        # engines are never paused here: check it serves
        if not (engines[eid]["admitting"] and engines[eid]["alive"]):
            raise RuntimeFailure(f"{eid} does not serve after its activation")

    async def _sleep(self, cell: int, kind: StepKind) -> None:
        async with self.weights.lock:  # never interleave with a publication's loads
            await self._call(cell, "sleep")
            self.asleep.add(cell)
            self._woken_into.pop(cell, None)

    async def begin_in_training(self, cell: int) -> None:
        """A cell the policy starts in training (e.g. static): out of routing (its drain
        moves nothing yet), engine asleep, trainer worker active."""
        self.held_out.add(cell)
        await self._admin("post", f"/tidal/engines/{EngineId.cell(cell)}/drain")
        await self._sleep(cell, StepKind.SLEEP_ENGINE)
        await self.activate(cell)

    async def activate(self, cell: int) -> None:
        """The cell's trainer worker joins training: the core, or the cell's satellite (parked
        since its last stint; started the first time)."""
        if cell > 0 and self.core.address is not None:
            if self.core.membership is not None:
                self.core.membership.activate(cell)
            await self._start_satellite(cell)
        if cell == 0 and self.core.memory is not None:
            async with self.trainer_lock:
                await asyncio.to_thread(self.core.memory.onload)
        self.training.add(cell)
        self.training_changed.set()

    async def revive_satellites(self) -> int:
        """Restart the satellite of any training cell whose process ended (a crash, or a join
        that timed out during a long rollout phase); returns how many were restarted."""
        n = 0
        for cell in sorted(self.training - {0}):
            if self.core.address is None:
                continue
            try:
                if await self._call(cell, "satellite_alive"):
                    continue
                log.warning("cell %d: satellite process ended while training; restarting it", cell)
                await self._start_satellite(cell)
                n += 1
            except (RuntimeFailure, TimeoutExpired) as exc:  # its actor is lost: the cell
                # supervisor replaces it, and the next step restarts the satellite there
                log.warning("cell %d: satellite not revived now: %s", cell, exc)
        return n

    async def _start_satellite(self, cell: int) -> None:
        """The cell's satellite process running (started only if none runs)."""
        pid, started = await self._call(
            cell, "ensure_satellite", cell, self.core.address, self.core.satellite_timeout_s
        )
        self.satellite_pids[cell] = pid
        self.satellite_starts += int(started)

    async def _deactivate(self, cell: int) -> None:
        if cell > 0 and self.core.membership is not None:
            # no need to wait for the core's step: the satellite delivers what it computed
            # and leaves the step; the core does the rest of the batch
            self.training.discard(cell)
            await self._park_satellite(cell)
        else:
            async with self.trainer_lock:  # a running step finishes first: leave between steps
                self.training.discard(cell)
                if cell > 0:
                    await self._stop_satellite(cell)
                elif self.core.memory is not None:  # the engine wakes on this GPU next
                    await asyncio.to_thread(self.core.memory.offload)
        self.training_changed.set()

    async def _park_satellite(self, cell: int) -> None:
        """The cell's satellite leaves training and parks (its process, model and groups
        stay); one that does not park within ``park_timeout_s`` is stopped (started again at
        the cell's next stint)."""
        m = self.core.membership
        m.deactivate(cell)
        if await asyncio.to_thread(m.wait_parked, cell, self.core.park_timeout_s):
            return
        log.warning(
            "cell %d: satellite did not park within %.0f s; stopping it",
            cell,
            self.core.park_timeout_s,
        )
        async with self.trainer_lock:  # killed between steps, as a satellite without parking
            await self._stop_satellite(cell)

    async def _stop_satellite(self, cell: int) -> None:
        if self.core.expect_departure is not None:
            self.core.expect_departure(cell)
        await self._call(cell, "stop_satellite")
        self.satellite_pids.pop(cell, None)

    async def _wake(self, cell: int) -> None:
        """The cell's engine awake. A built-in engine wakes straight into the current published
        version (its load materialises the weights): reading the version it slept with first,
        only for LOAD_WEIGHTS to overwrite it, would read the weights twice per move back.
        vLLM and SGLang wake their own way (sleep mode keeps what they need) and load after."""
        async with self.weights.lock:
            if self.weights.path is not None and not self.engines.is_server(EngineId.cell(cell)):
                await self._load_current(cell)
                self._woken_into[cell] = self.weights.label
            else:
                await self._call(cell, "wake")
            self.asleep.discard(cell)

    async def _load(self, cell: int) -> None:
        async with self.weights.lock:
            if self._woken_into.pop(cell, None) == self.weights.label:
                return  # this plan's wake loaded it (and read it back); nothing published since
            await self._load_current(cell)

    async def _load_current(self, cell: int) -> None:
        """The current published version loaded into the cell's engine and read back (under
        ``weights.lock``); nothing while no version was published (the engine serves v0)."""
        if self.weights.path is None:
            return
        eid = EngineId.cell(cell)
        if self.weights.handoff is not None:  # its carrier (shared memory, a broadcast, ...)
            d = await self.weights.handoff.deliver(
                eid, self._cell(cell), self.weights.version, self.weights.label
            )
            if d.label != self.weights.label:
                raise RuntimeFailure(
                    f"cell {cell} serves {d.label!r} after loading {self.weights.label!r}"
                )
            return
        if self.engines.transport(eid) == "object":
            await asyncio.to_thread(self.engines.blob, self.weights.path)
        served = await remote(
            self.engines.load(eid, self._cell(cell), self.weights.path, self.weights.label),
            f"cell {cell} load_weights",
            self.call_timeout_s,
        )
        if served != self.weights.label:  # never rejoin with other weights
            raise RuntimeFailure(
                f"cell {cell} serves {served!r} after loading {self.weights.label!r}"
            )

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
