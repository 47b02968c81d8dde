"""Publication: each new weight version the core wrote is loaded by the engines that serve.

In: ``publish(version)`` from the trainer loop after the final step of a burst (the core's
``VersionWriter`` already wrote it: a shared-memory segment, or the file); ``load_published``
once at the start of a resumed run. Out: every standalone engine and every awake cell loads the
version in place (no restart; vLLM engines out of routing meanwhile), by the carrier its
placement gives it (``handoff.Handoff``: shared memory on the driver's node, a broadcast
across nodes, the file and Ray's object store as fallbacks), then the run directory's file is
written from the segment (the checkpoint's; off the engines' pause); ``Weights`` names it (a
cell that wakes later, or a replaced engine, loads it through the same handoff), and one
``WeightSyncDone`` goes to the controller with each engine's carrier, bytes, seconds and pause
(the decision log's ``weights_published``), the version's write time and the publication's
GB/s: its bytes over the span from the core's first written byte to the last engine's reply
that it serves the version (``span_s``). ``report`` sums them up for the summary, beside the
machine's memcpy GB/s measured at the publisher's start (the same bytes-over-seconds of one
``copy_`` between two buffers already in memory).
Invariant 6 is kept by the engines (each later token carries the new label); an engine lost during
a load is the cell supervisor's to replace, with this version.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from tidal.clock import Clock
from tidal.errors import ConfigError
from tidal.runtime import vllm_host
from tidal.runtime.actuator import Weights
from tidal.runtime.engines import EngineId, Engines
from tidal.runtime.handoff import Handoff
from tidal.runtime.supervisor import CellView
from tidal.runtime.tasks import remote
from tidal.types import Event, WeightSyncDone

if TYPE_CHECKING:
    from tidal.runtime.ray_types import ActorHandle, ObjectRef

log = logging.getLogger(__name__)


class Publisher:
    def __init__(
        self,
        engines: Engines,
        cells: CellView,
        admin: httpx.AsyncClient,
        weights: Weights,
        path_of: Callable[[int], str],
        handle: Callable[[Event], None],
        clock: Clock,
        call_timeout_s: float = 180.0,
        handoff: Handoff | None = None,
    ) -> None:
        self.engines, self.cells, self.admin, self.weights = engines, cells, admin, weights
        self.path_of, self.handle, self.clock = path_of, handle, clock
        self.call_timeout_s = call_timeout_s
        self.handoff = handoff  # None: every engine by Engines.transport (the file or Ray)
        weights.handoff = handoff  # the actuator's loads (a wake, a move back) use it too
        self.records: list[dict] = []  # one per publication (``report``)
        self.memcpy_gbps = memcpy_gbps() if handoff is not None else None

    def restore(self, version: int, path: str | None) -> None:
        """A resumed run serves what was published before its interruption."""
        if path is not None and not Path(path).is_file():
            raise ConfigError("--resume", f"published weights {path} are gone")
        self.weights.version, self.weights.path = version, path

    async def load_published(self) -> None:
        """Every engine loads the restored version (a resumed run, before its first dispatch)."""
        w = self.weights
        if w.path is not None:
            await asyncio.gather(
                *[
                    remote(
                        self.engines.load(eid, a, w.path, w.label),
                        f"{eid} load {w.label}",
                        self.call_timeout_s,
                    )
                    for eid, a in self.engines.actors.items()
                ]
            )

    def _readmit(self, eid: EngineId) -> Callable[[], bool]:
        """Whether a vLLM engine drained for its load goes back into routing afterwards: not
        a cell that a transition plan took out meanwhile (it leaves for training)."""
        held = getattr(self.cells, "is_held_out", None)
        if eid.standalone or held is None:
            return lambda: True
        return lambda: not held(eid.index)

    async def publish(self, version: int) -> None:
        """Awake engines load ``version``; a failed load is logged (its engine is replaced)."""
        if self.handoff is None:
            return await self._publish_by_transport(version)
        t0 = self.clock.now()
        w, h = self.weights, self.handoff
        async with w.lock:
            w.version, w.path = version, self.path_of(version)
            targets = [
                (eid, a)
                for eid, a in self.engines.actors.items()
                if eid.standalone or not self.cells.is_asleep(eid.index)
            ]
            outs = await asyncio.gather(
                *[
                    h.deliver(eid, a, version, w.label, self._wrap(eid, w.label))
                    for eid, a in targets
                ],
                return_exceptions=True,
            )
        loaded_s = self.clock.now() - t0
        ready = time.perf_counter()  # every engine that took it serves it from its next step
        done = {}
        for (eid, _), out in zip(targets, outs, strict=True):
            if isinstance(out, BaseException):  # its engine is replaced with this version
                log.warning(
                    "publishing %s: %s did not load it: %s", w.label, eid, str(out).splitlines()[0]
                )
            else:
                done[str(eid)] = out
        await asyncio.to_thread(h.writer.ensure_file, version)  # the checkpoint's file
        nbytes = max((d.bytes for d in done.values()), default=0)
        # the span: from the first byte the core wrote to the last engine ready to serve it
        # (its reply after the load; a built-in engine's, after the step in flight)
        span = ready - h.writer.started if h.writer.version == version else 0.0
        # the copy speed now, beside this publication (after it: not on its path), as the
        # machine's load at this moment, not only at the run's start, is what it competed with
        beside = await asyncio.to_thread(memcpy_gbps)
        detail = {
            "write_s": round(h.writer.write_s, 4),
            "span_s": round(span, 4),
            "bytes": nbytes,
            "gbps": round(nbytes / span / 1e9, 3) if span > 0 and nbytes else None,
            "memcpy_gbps": beside,
            "engines": {e: d.record() for e, d in sorted(done.items())},
        }
        self.records.append(detail)
        self.handle(
            WeightSyncDone(
                self.clock.now(),
                version,
                loaded_s,
                transports=tuple(sorted((e, d.carrier) for e, d in done.items())),
                detail=detail,
            )
        )

    def _wrap(self, eid: EngineId, label: str):
        """A vLLM or SGLang engine's load runs out of routing (``vllm_host.load_weights``)."""
        if not self.engines.is_server(eid):
            return None
        return lambda call: vllm_host.load_weights(
            self.admin, str(eid), call, label, readmit=self._readmit(eid)
        )

    def report(self) -> dict | None:
        """``summary.json``'s ``publication``: per version the write, each engine's carrier
        and the GB/s, as p50 / max, beside the memcpy GB/s of this machine."""
        if self.handoff is None:
            return None
        recs = self.records
        loads = [d for r in recs for d in r["engines"].values()]
        carriers: dict[str, int] = {}
        for d in loads:
            carriers[d["carrier"]] = carriers.get(d["carrier"], 0) + 1
        return {
            "versions": len(recs),
            "bytes_per_version": recs[-1]["bytes"] if recs else 0,
            "memcpy_gbps": self.memcpy_gbps,
            "gbps": _p50_max([r["gbps"] for r in recs if r["gbps"]]),
            # memcpy measured right after each publication, and each version's GB/s over it
            "memcpy_beside_gbps": _p50_max([r["memcpy_gbps"] for r in recs]),
            "share_of_memcpy_beside": _p50_max(
                [r["gbps"] / r["memcpy_gbps"] for r in recs if r["gbps"] and r["memcpy_gbps"]]
            ),
            "write_s": _p50_max([r["write_s"] for r in recs]),
            "span_s": _p50_max([r["span_s"] for r in recs if r["gbps"]]),
            "engine_load_s": _p50_max([d["seconds"] for d in loads]),
            "engine_pause_s": _p50_max([d["pause_s"] for d in loads]),
            # of the engine load: opened and checked, then waiting for the step in flight
            "engine_prepare_s": _p50_max([d["prepare_s"] for d in loads if "prepare_s" in d]),
            "engine_step_wait_s": _p50_max([d["step_wait_s"] for d in loads if "step_wait_s" in d]),
            "carriers": dict(sorted(carriers.items())),
            "fallbacks": sum(len(d.get("fell_back_from", [])) for d in loads),
        }

    async def _publish_by_transport(self, version: int) -> None:
        t0 = self.clock.now()
        w = self.weights
        async with w.lock:
            w.version, w.path = version, self.path_of(version)
            targets = [
                (eid, a)
                for eid, a in self.engines.actors.items()
                if eid.standalone or not self.cells.is_asleep(eid.index)
            ]
            routes = {str(eid): self.engines.transport(eid) for eid, _ in targets}
            if "object" in routes.values():  # engines on other nodes pull it from Ray
                await asyncio.to_thread(self.engines.blob, w.path)
            outs = await asyncio.gather(
                *[
                    remote(
                        self._load(eid, a, w.path, w.label),
                        f"{eid} load {w.label}",
                        self.call_timeout_s,
                    )
                    for eid, a in targets
                ],
                return_exceptions=True,
            )
        for out in outs:  # a lost engine is replaced by the supervisor with this version
            if isinstance(out, BaseException):
                log.warning(
                    "publishing %s: an engine did not load it: %s",
                    w.label,
                    str(out).splitlines()[0],
                )
        self.handle(
            WeightSyncDone(
                self.clock.now(),
                w.version,
                self.clock.now() - t0,
                transports=tuple(sorted(routes.items())),
            )
        )

    def _load(self, eid: EngineId, actor: ActorHandle, path: str, label: str) -> ObjectRef:
        """One engine's load by its transport; a vLLM engine (standalone or cell) or an
        SGLang cell is out of routing meanwhile (``vllm_host.load_weights``)."""
        if not self.engines.is_server(eid):
            return self.engines.load(eid, actor, path, label)
        return vllm_host.load_weights(
            self.admin,
            str(eid),
            lambda: self.engines.load(eid, actor, path, label),
            label,
            readmit=self._readmit(eid),
        )


def _p50_max(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    xs = sorted(xs)
    return {"p50": round(xs[(len(xs) - 1) // 2], 4), "max": round(xs[-1], 4)}


def memcpy_gbps(nbytes: int = 128 * 2**20, repeats: int = 3) -> float:
    """This machine's copy speed (GB/s, best of ``repeats``) between two buffers already in
    memory: what a publication is compared against."""
    import time

    import torch

    src = torch.ones(nbytes // 4)
    dst = torch.zeros_like(src)  # both touched: page faults are not the copy's
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return round(nbytes / best / 1e9, 2)
