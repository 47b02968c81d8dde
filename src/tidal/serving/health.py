"""Background health of the proxy's engines: a member that stops answering leaves routing, an
engine that answers again on its address comes back.

In: the proxy's admitting members (probed every ``interval_s``; drained ones are their owner's)
and the engines it lost (address, backend, kind, cap, model, admitting). Out: ``mark_down`` (the
member leaves; its calls retry elsewhere, invariant 4) after ``probes`` failed probes in a row,
and re-admission through ``Proxy.join`` of a lost engine whose ``/health`` answers, drained
again if it was drained. Invariant kept: an engine is either a member or lost, never
both, and an engine that stops answering (dead, or hung: SIGSTOP, a wedged loop) leaves within
``probes x max(interval_s, timeout_s)`` plus one interval, called or not (3-4 s by default).
Sweeps start every ``interval_s`` whatever one probe takes, each probe bounded by
``timeout_s``, so a hung engine delays nobody's detection. A member that leaves has its
connections aborted (``HTTPPool.close``): a call waiting on a hung engine fails at once and
continues elsewhere with the tokens it streamed (the path a dead engine's calls take).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tidal.serving.adapters import make_adapter
from tidal.serving.protocol import ServingError

if TYPE_CHECKING:
    from tidal.serving.proxy import Proxy
    from tidal.serving.router import Member

log = logging.getLogger(__name__)


@dataclass
class Lost:
    engine_id: str
    url: str
    backend: str
    kind: str
    cell_index: int
    cap: int
    model: str
    admitting: bool  # a drained engine comes back drained: its owner undrains it


class HealthMonitor:
    def __init__(self, proxy: Proxy, interval_s: float = 1.0, probes: int = 3,
                 timeout_s: float = 1.0) -> None:
        self.proxy, self.interval_s, self.probes = proxy, interval_s, probes
        self.timeout_s = timeout_s
        self.lost: dict[str, Lost] = {}
        self._misses: dict[str, int] = {}
        self.readmitted = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="proxy-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            try:
                await self.sweep()
            except Exception:  # a probe bug must not end health checking silently
                log.exception("health sweep failed")
            await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - t0)))

    async def sweep(self) -> None:
        """Probe every admitting member and every lost engine once (concurrently). A drained
        member is left alone: it holds no calls, and its owner (the runtime puts drained
        engines to sleep, which can hold their loop for seconds) undrains or removes it."""
        members = [m for m in self.proxy.router.members.values() if m.admitting]
        await asyncio.gather(*[self._probe(m) for m in members],
                             *[self._retry(lost) for lost in list(self.lost.values())])

    async def _probe(self, member: Member) -> None:
        if await member.adapter.health(self.timeout_s):
            self._misses.pop(member.engine_id, None)
            return
        n = self._misses[member.engine_id] = self._misses.get(member.engine_id, 0) + 1
        if n >= self.probes:
            self.mark_down(member, f"{n} health probes failed")

    async def check(self, member: Member, exc: Exception) -> None:
        """A call failed to reach ``member``: down (it leaves at once) only if ``probes``
        probes 0.5 s apart fail too, as a loaded engine may miss one; else a short pause."""
        if member.alive:
            for probe in range(self.probes):
                if await member.adapter.health(self.timeout_s):
                    await asyncio.sleep(0.05)
                    return
                if probe + 1 < self.probes:
                    await asyncio.sleep(0.5)
            self.mark_down(member, str(exc))

    def mark_down(self, member: Member, reason: str) -> None:
        """The member leaves routing (if it still is one) and is remembered as lost."""
        router = self.proxy.router
        if router.members.get(member.engine_id) is not member:
            return
        lost = Lost(member.engine_id, member.adapter.url, member.backend, member.kind,
                    member.cell_index, member.cap, member.model, member.admitting)
        router.leave(member.engine_id)  # (which clears ``admitting``)
        self._misses.pop(member.engine_id, None)
        self.proxy.totals["engine_failures"] += 1
        self.lost[member.engine_id] = lost
        log.warning("engine %s at %s is down (%s): it leaves routing, its calls retry "
                    "elsewhere", member.engine_id, member.adapter.url, reason)
        asyncio.get_running_loop().create_task(member.adapter.close())

    def forget(self, engine_id: str) -> bool:
        return self.lost.pop(engine_id, None) is not None

    async def _retry(self, lost: Lost) -> None:
        adapter = make_adapter(lost.backend, lost.url, api_key=self.proxy.engine_token)
        try:
            healthy = await adapter.health(self.timeout_s)
        finally:
            await adapter.close()
        if not healthy or self.lost.get(lost.engine_id) is not lost:
            return
        del self.lost[lost.engine_id]
        try:
            member = await self.proxy.join(lost.engine_id, lost.url, lost.backend,
                                           lost.kind, lost.cell_index, lost.cap,  # type: ignore[arg-type]
                                           lost.model or None)
            member.admitting = lost.admitting
        except ServingError as exc:  # e.g. joined meanwhile under its id
            log.info("engine %s answers again but was not re-admitted: %s",
                     lost.engine_id, exc)
            return
        self.readmitted += 1
        log.warning("engine %s at %s answers again: re-admitted", lost.engine_id, lost.url)
