"""Cell supervision: a lost cell actor or engine process is replaced while the run goes on.

In: the runtime's actor handles, polled every ``interval_s`` (``describe`` with a timeout).
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
from typing import Any

log = logging.getLogger(__name__)


class CellSupervisor:
    def __init__(self, runtime: Any, interval_s: float = 0.5, probe_timeout_s: float = 10.0,
                 missed_probes: int = 6):
        self.rt = runtime
        self.interval_s, self.probe_timeout_s = interval_s, probe_timeout_s
        # An actor that answers no probe for missed_probes x probe_timeout_s is lost; one slow
        # answer is not (a loaded machine, a long call ahead of the probe).
        self.missed_probes = missed_probes
        self._missed: dict[str, int] = {}
        self.replaced: list[dict[str, Any]] = []
        self.failures = 0
        self.busy = False

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            for name in list(self.rt.actors):
                try:
                    if not await self._healthy(name):
                        self.busy = True
                        await self.replace(name)
                except Exception:
                    log.exception("replacing %s failed; trying again", name)
                    self.failures += 1
                finally:
                    self.busy = False

    async def _healthy(self, name: str) -> bool:
        import ray

        try:
            info = await asyncio.wait_for(self.rt.actors[name].describe.remote(),
                                          self.probe_timeout_s)
        except ray.exceptions.RayError as exc:  # died, killed by Ray's memory monitor, ...
            log.warning("cell actor %s lost: %s", name, type(exc).__name__)
            return False
        except TimeoutError:
            self._missed[name] = self._missed.get(name, 0) + 1
            log.warning("cell actor %s: no answer within %.0f s (%d of %d)", name,
                        self.probe_timeout_s, self._missed[name], self.missed_probes)
            return self._missed[name] < self.missed_probes
        self._missed[name] = 0
        if not info["alive"] and info["state"] != "stopped":
            log.warning("engine of %s is down (state %s)", name, info["state"])
            return False
        return True

    async def _leave_proxy(self, name: str, grace_s: float = 5.0) -> None:
        """Let the proxy notice the failure through the calls it had there (it retries them
        and drops the engine); only an engine it still lists after ``grace_s`` (no traffic
        showed the failure) is removed here. Removing it at once would close its client
        under the proxy's own health probes of those calls."""
        loop = asyncio.get_running_loop()
        end = loop.time() + grace_s
        while loop.time() < end:
            engines = (await self.rt.admin.get("/tidal/engines")).json()["engines"]
            if not any(e["id"] == name for e in engines):
                return
            await asyncio.sleep(0.2)
        resp = await self.rt.admin.delete(f"/tidal/engines/{name}", params={"drain": "false"})
        if resp.status_code not in (200, 404):  # 404: the proxy dropped it meanwhile
            log.warning("proxy leave %s: HTTP %s", name, resp.status_code)

    async def replace(self, name: str) -> None:
        import ray

        rt, old = self.rt, self.rt.actors[name]
        with contextlib.suppress(Exception):
            ray.kill(old, no_restart=True)
        cell = int(name[1:]) if name.startswith("c") else None
        pids = [rt.pids.get(name)]
        if cell is not None:  # and its satellite trainer, if it had one
            pids.append(rt.actuator.satellite_pids.pop(cell, None))
        for pid in pids:
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)  # a process this runtime started
        await self._leave_proxy(name)
        new = rt.new_actor(name)
        url = await new.start.remote(rt.rt.start_timeout_s)
        rt.actors[name] = new
        rt.pids[name] = (await new.describe.remote())["pid"]
        if cell is not None:
            rt.actuator.cells[cell] = new
        w = rt.weights
        async with w.lock:
            if w.path is not None:
                await new.load_weights.remote(w.path, w.label)
            resp = await rt.admin.post("/tidal/engines", json=rt.join_body(name, url))
            resp.raise_for_status()
            if cell is not None and cell in rt.actuator.asleep:
                await rt.admin.post(f"/tidal/engines/{name}/drain")
                await new.sleep.remote()
        self.replaced.append({"name": name, "t": rt.clock.now(), "version": w.label})
        log.warning("cell actor %s replaced (engine at %s, weights %s)", name, url, w.label)
