"""Publication: each new weight version the core wrote is loaded by the engines that serve.

In: ``publish(version)`` from the trainer loop after the final step of a burst (the core's
``FilePublisher`` already wrote the file); ``load_published`` once at the start of a resumed run.
Out: every standalone engine and every awake cell loads the version in place (no restart; vLLM
engines out of routing meanwhile), by the transport its placement gives it (the
driver's file on the driver's node, Ray's object store across nodes; ``Engines.transport``,
logged per publication in the decision log), ``Weights`` names it (a cell that wakes later, or a
replaced engine, loads it from there), and one ``WeightSyncDone`` goes to the controller.
Invariant 6 is kept by the engines (each later token carries the new label); an engine lost during
a load is the cell supervisor's to replace, with this version.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from tidal.clock import Clock
from tidal.errors import ConfigError
from tidal.runtime import vllm_host
from tidal.runtime.actuator import Weights
from tidal.runtime.engines import EngineId, Engines
from tidal.runtime.supervisor import CellView
from tidal.runtime.tasks import remote
from tidal.types import Event, WeightSyncDone

if TYPE_CHECKING:
    from tidal.runtime.ray_types import ActorHandle, ObjectRef

log = logging.getLogger(__name__)


class Publisher:
    def __init__(self, engines: Engines, cells: CellView, admin: httpx.AsyncClient,
                 weights: Weights, path_of: Callable[[int], str],
                 handle: Callable[[Event], None], clock: Clock,
                 call_timeout_s: float = 180.0) -> None:
        self.engines, self.cells, self.admin, self.weights = engines, cells, admin, weights
        self.path_of, self.handle, self.clock = path_of, handle, clock
        self.call_timeout_s = call_timeout_s

    def restore(self, version: int, path: str | None) -> None:
        """A resumed run serves what was published before its interruption."""
        if path is not None and not Path(path).is_file():
            raise ConfigError("--resume", f"published weights {path} are gone")
        self.weights.version, self.weights.path = version, path

    async def load_published(self) -> None:
        """Every engine loads the restored version (a resumed run, before its first dispatch)."""
        w = self.weights
        if w.path is not None:
            await asyncio.gather(*[
                remote(self.engines.load(eid, a, w.path, w.label), f"{eid} load {w.label}",
                       self.call_timeout_s) for eid, a in self.engines.actors.items()])

    def _readmit(self, eid: EngineId) -> Callable[[], bool]:
        """Whether a vLLM engine drained for its load goes back into routing afterwards: not
        a cell that a transition plan took out meanwhile (it leaves for training)."""
        held = getattr(self.cells, "is_held_out", None)
        if eid.standalone or held is None:
            return lambda: True
        return lambda: not held(eid.index)

    async def publish(self, version: int) -> None:
        """Awake engines load ``version``; a failed load is logged (its engine is replaced)."""
        t0 = self.clock.now()
        w = self.weights
        async with w.lock:
            w.version, w.path = version, self.path_of(version)
            targets = [(eid, a) for eid, a in self.engines.actors.items()
                       if eid.standalone or not self.cells.is_asleep(eid.index)]
            routes = {str(eid): self.engines.transport(eid) for eid, _ in targets}
            if "object" in routes.values():  # engines on other nodes pull it from Ray
                await asyncio.to_thread(self.engines.blob, w.path)
            outs = await asyncio.gather(*[remote(self._load(eid, a, w.path, w.label),
                                                 f"{eid} load {w.label}", self.call_timeout_s)
                                          for eid, a in targets], return_exceptions=True)
        for out in outs:  # a lost engine is replaced by the supervisor with this version
            if isinstance(out, BaseException):
                log.warning("publishing %s: an engine did not load it: %s", w.label,
                            str(out).splitlines()[0])
        self.handle(WeightSyncDone(self.clock.now(), w.version, self.clock.now() - t0,
                                   transports=tuple(sorted(routes.items()))))

    def _load(self, eid: EngineId, actor: ActorHandle, path: str, label: str) -> ObjectRef:
        """One engine's load by its transport; a vLLM engine (standalone or cell) or an
        SGLang cell is out of routing meanwhile (``vllm_host.load_weights``)."""
        if not self.engines.is_server(eid):
            return self.engines.load(eid, actor, path, label)
        return vllm_host.load_weights(self.admin, str(eid),
                                      lambda: self.engines.load(eid, actor, path, label),
                                      label, readmit=self._readmit(eid))
