"""Cell supervision: a lost cell actor or engine process is replaced while the run goes on.

In: the run's engine actors (``Engines``), polled every ``interval_s`` (``describe``, bounded).
Out: for a dead actor or a dead engine: the old actor killed and its engine process ended by
pid (it would otherwise outlive its actor), the engine gone from the proxy (which retries its
live requests on other engines: invariant 4, and drops it), a new actor + engine that
loads the current weight version, rejoins the proxy under the same id, and, if its cell is on
the training side, is drained and put to sleep again. The controller's view of the cell does
not change: a replaced cell keeps its role and its place in the order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from typing import TYPE_CHECKING, Any, Protocol

import httpx

from tidal.clock import Clock
from tidal.runtime.engines import EngineId, Engines
from tidal.runtime.tasks import remote

if TYPE_CHECKING:
    from tidal.runtime.actuator import Weights

log = logging.getLogger(__name__)


class CellView(Protocol):
    """What the supervisor reads of the actuator's view of the cells."""

    def is_asleep(self, cell: int) -> bool: ...

    def forget_satellite(self, cell: int) -> int | None: ...


class CellSupervisor:
    def __init__(
        self,
        engines: Engines,
        cells: CellView,
        admin: httpx.AsyncClient,
        weights: Weights,
        clock: Clock,
        start_timeout_s: float,
        interval_s: float = 0.5,
        probe_timeout_s: float = 10.0,
        missed_probes: int = 6,
    ) -> None:
        self.engines, self.cells, self.admin = engines, cells, admin
        self.weights, self.clock, self.start_timeout_s = weights, clock, start_timeout_s
        self.interval_s, self.probe_timeout_s = interval_s, probe_timeout_s
        # An actor that answers no probe for missed_probes x probe_timeout_s is lost; one slow
        # answer is not (a loaded machine, a long call ahead of the probe).
        self.missed_probes = missed_probes
        self._missed: dict[EngineId, int] = {}
        self.replaced: list[dict[str, Any]] = []
        self.failures = 0
        self.busy = False

    async def run(self) -> None:
        while True:
            await self.clock.asleep(self.interval_s)
            for eid in list(self.engines.actors):
                try:
                    if not await self._healthy(eid):
                        self.busy = True
                        await self.replace(eid)
                except Exception:
                    log.exception("replacing %s failed; trying again", eid)
                    self.failures += 1
                finally:
                    self.busy = False

    async def _healthy(self, eid: EngineId) -> bool:
        import ray

        try:
            info = await asyncio.wait_for(
                self.engines.actors[eid].describe.remote(), self.probe_timeout_s
            )
        except ray.exceptions.RayError as exc:  # died, killed by Ray's memory monitor, ...
            log.warning("cell actor %s lost: %s", eid, type(exc).__name__)
            return False
        except TimeoutError:
            self._missed[eid] = self._missed.get(eid, 0) + 1
            log.warning(
                "cell actor %s: no answer within %.0f s (%d of %d)",
                eid,
                self.probe_timeout_s,
                self._missed[eid],
                self.missed_probes,
            )
            return self._missed[eid] < self.missed_probes
        self._missed[eid] = 0
        if not info["alive"] and info["state"] != "stopped":
            log.warning("engine of %s is down (state %s)", eid, info["state"])
            return False
        return True

    async def _leave_proxy(self, eid: EngineId, grace_s: float = 5.0) -> None:
        """Let the proxy notice the failure through the calls it had there (it retries them
        and drops the engine); only an engine it still lists after ``grace_s`` (no traffic
        showed the failure) is removed here. Removing it at once would close its client
        under the proxy's own health probes of those calls."""
        end = self.clock.now() + grace_s
        while self.clock.now() < end:
            engines = (await self.admin.get("/tidal/engines")).json()["engines"]
            if not any(e["id"] == str(eid) for e in engines):
                return
            await self.clock.asleep(0.2)
        resp = await self.admin.delete(f"/tidal/engines/{eid}", params={"drain": "false"})
        if resp.status_code not in (200, 404):  # 404: the proxy dropped it meanwhile
            log.warning("proxy leave %s: HTTP %s", eid, resp.status_code)

    def _end_old(self, eid: EngineId) -> None:
        """The old actor killed, its engine (and a cell's satellite) ended by pid."""
        import ray

        with contextlib.suppress(Exception):
            ray.kill(self.engines.actors[eid], no_restart=True)
        if not self.engines.on_this_host(eid):
            return  # another machine's pids: its actor's end (or its node's loss) ends them
        pids = [self.engines.pids.get(eid)]
        if not eid.standalone:
            pids.append(self.cells.forget_satellite(eid.index))
        for pid in pids:
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)  # a process this runtime started

    async def replace(self, eid: EngineId) -> None:
        self._end_old(eid)
        await self._leave_proxy(eid)
        new = self.engines.new_actor(eid)
        t = self.start_timeout_s
        url = await remote(self.engines.start_call(new), f"{eid} start", t + 30)
        self.engines.actors[eid] = new
        info = await remote(new.describe.remote(), f"{eid} describe", t)
        self.engines.pids[eid], self.engines.nodes[eid] = info["pid"], info.get("node_id")
        self.engines.hosts[eid] = info.get("host")
        w = self.weights
        async with w.lock:
            if w.path is not None:
                if self.engines.transport(eid) == "object":
                    await asyncio.to_thread(self.engines.blob, w.path)
                await remote(self.engines.load(eid, new, w.path, w.label), f"{eid} load", t)
            resp = await self.admin.post("/tidal/engines", json=self.engines.join_body(eid, url))
            resp.raise_for_status()
            if not eid.standalone and self.cells.is_asleep(eid.index):
                await self.admin.post(f"/tidal/engines/{eid}/drain")
                await remote(new.sleep.remote(), f"{eid} sleep", t)
        self.replaced.append({"name": str(eid), "t": self.clock.now(), "version": w.label})
        log.warning("cell actor %s replaced (engine at %s, weights %s)", eid, url, w.label)
