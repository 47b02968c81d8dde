"""Background health of the proxy's engines: a member that stops answering leaves routing, an
engine that answers again on its address comes back.

In: the proxy's admitting members (probed every ``interval_s``; drained ones are their owner's)
and the engines it lost (address, backend, kind, cap, model, admitting). Out: ``mark_down`` (the
member leaves; its calls retry elsewhere, invariant 4) after ``probes x interval_s`` of silence,
and re-admission through ``Proxy.join`` of a lost engine whose ``/health`` answers, drained
again if it was drained. Invariant kept: an engine is either a member or lost, never
both, and an engine that stops answering (dead, or hung: SIGSTOP, a wedged loop: no answer to
``/health`` and no token streamed to any call meanwhile) leaves within
``probes x interval_s`` plus one interval, called or not (3-4 s by default).
Sweeps start every ``interval_s`` and never wait for a probe (one in flight per engine, each
bounded by ``timeout_s``), so a hung engine delays nobody's detection. A member that leaves has
its connections aborted (``HTTPPool.close``): a call waiting on a hung engine fails at once and
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
from tidal.serving.router import engine_view

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

    def describe(self) -> dict:
        """As ``Member.describe`` says it, for an engine out of routing (down, not left)."""
        return engine_view(self, self.url, alive=False, lost=True)


class HealthMonitor:
    def __init__(
        self, proxy: Proxy, interval_s: float = 1.0, probes: int = 3, timeout_s: float = 5.0
    ) -> None:
        self.proxy, self.interval_s, self.probes = proxy, interval_s, probes
        self.timeout_s = timeout_s
        self.silence_s = probes * interval_s  # no answer for this long: down
        self.lost: dict[str, Lost] = {}
        self._since: dict[str, float] = {}  # watched since (joined, or undrained)
        self._answered: dict[str, float] = {}  # its last /health answer
        self._probing: dict[str, asyncio.Task] = {}  # one probe in flight per engine
        self.readmitted = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="proxy-health")

    async def stop(self) -> None:
        tasks = [t for t in [self._task, *self._probing.values()] if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._task = None
        self._probing.clear()

    async def _run(self) -> None:
        while True:
            try:
                await self.sweep()
            except Exception:  # a probe bug must not end health checking silently
                log.exception("health sweep failed")
            await asyncio.sleep(self.interval_s)

    async def sweep(self) -> None:
        """Start a probe of every admitting member and every lost engine that has none in
        flight, and mark down a member silent for ``silence_s``: no ``/health`` answer and no
        answer to any call (``Member.progress_s``) in that time. An answer counts when it
        arrives, however late, so a slow probe of a loaded engine (or a proxy whose loop
        lagged) is no silence; a hung engine answers nothing. A drained member is left
        alone: it holds no calls, and its owner (the runtime puts drained engines to sleep,
        which can hold their loop for seconds) undrains or removes it."""
        now = asyncio.get_running_loop().time()
        for member in list(self.proxy.router.members.values()):
            eid = member.engine_id
            if not member.admitting:
                self._since.pop(eid, None)
                continue
            last = max(
                self._since.setdefault(eid, now),
                self._answered.get(eid, now - 1e9),
                member.progress_s,
            )
            if now - last > self.silence_s:
                self.mark_down(member, f"no answer for {now - last:.1f} s")
            else:
                self._start(eid, self._probe(member))
        for lost in list(self.lost.values()):
            self._start(lost.engine_id, self._retry(lost))

    def _start(self, engine_id: str, probe) -> None:
        if engine_id in self._probing:
            probe.close()  # the previous one is still waiting for its answer
            return
        task = asyncio.create_task(probe, name=f"health-{engine_id}")
        self._probing[engine_id] = task
        task.add_done_callback(
            lambda t: (
                self._probing.pop(engine_id, None) if self._probing.get(engine_id) is t else None
            )
        )

    async def _probe(self, member: Member) -> None:
        if await member.adapter.health(self.timeout_s):
            self._answered[member.engine_id] = asyncio.get_running_loop().time()

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
        lost = Lost(
            member.engine_id,
            member.adapter.url,
            member.backend,
            member.kind,
            member.cell_index,
            member.cap,
            member.model,
            member.admitting,
        )
        router.leave(member.engine_id)  # (which clears ``admitting``)
        self._since.pop(member.engine_id, None)
        self._answered.pop(member.engine_id, None)
        self.proxy.totals["engine_failures"] += 1
        self.lost[member.engine_id] = lost
        log.warning(
            "engine %s at %s is down (%s): it leaves routing, its calls retry elsewhere",
            member.engine_id,
            member.adapter.url,
            reason,
        )
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
            member = await self.proxy.join(
                lost.engine_id,
                lost.url,
                lost.backend,
                lost.kind,
                lost.cell_index,
                lost.cap,  # type: ignore[arg-type]
                lost.model or None,
            )
            member.admitting = lost.admitting
        except ServingError as exc:  # e.g. joined meanwhile under its id
            log.info("engine %s answers again but was not re-admitted: %s", lost.engine_id, exc)
            return
        self.readmitted += 1
        log.warning("engine %s at %s answers again: re-admitted", lost.engine_id, lost.url)
