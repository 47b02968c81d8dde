"""The decode meter of a real run: the proxy's cumulative (tokens the engines decoded,
sequence-seconds calls were held at them), read from its ``/tidal/stats`` for the controller.

In: the run's admin client to the proxy and the controller. Out: from the first answer on,
``ctl.decode_meter`` returns the latest pair (a cached read: the controller calls it on the loop
for every observation; before the first answer it stays None, not metered); ``figures()`` for
``summary.json``'s ``control_plane.decode_meter`` (polls, polls missed, the longest time without
a reading, the slowest answer). ``run`` is a part of the run (``tasks.Parts``): it polls every
``every_s``.

Each poll is bounded, and the bound follows the load (a proxy and a driver loop busy with
10,000 executions answer in seconds, not milliseconds): after an answer it is ``4 x`` that
answer's time (at least ``timeout_s``), after a poll that timed out twice the last bound, never
more than ``max_timeout_s``. A missed poll loses nothing: the pair is cumulative, so the next
answer carries what the missed one would have, and every miss is logged and counted in the
figures. ``missed_polls`` failing in a row (with the bound grown to ``max_timeout_s``: minutes
without a reading) raise ``RuntimeFailure`` naming the polls, the bound and the time since the
last reading (a dead proxy is named as the cause instead, by ``Parts``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, NoReturn

import httpx

from tidal.clock import Clock
from tidal.runtime.cell import RuntimeFailure

if TYPE_CHECKING:
    from tidal.control.controller import Controller

log = logging.getLogger(__name__)

LOAD_FACTOR = 4.0  # a poll's bound after an answer: this many times that answer's time


class DecodeMeter:
    def __init__(
        self,
        admin: httpx.AsyncClient,
        ctl: Controller,
        clock: Clock,
        every_s: float = 2.0,
        timeout_s: float = 5.0,
        missed_polls: int = 12,
        max_timeout_s: float = 60.0,
    ) -> None:
        self.admin, self.ctl, self.clock = admin, ctl, clock
        self.every_s, self.timeout_s, self.missed_polls = every_s, timeout_s, missed_polls
        self.max_timeout_s = max(max_timeout_s, timeout_s)
        self.bound_s = timeout_s  # the next poll's bound
        self.last: tuple[float, float] | None = None
        self.missed = 0  # polls failed in a row
        self.polls = self.missed_total = 0
        self.last_read_at = clock.now()  # a reading's time (the start, before the first)
        self.longest_gap_s = 0.0
        self.slowest_answer_s = 0.0

    def read(self) -> tuple[float, float]:
        """The latest (tokens, sequence-seconds); set as the controller's meter only once one
        was read."""
        assert self.last is not None, "no reading yet"
        return self.last

    def figures(self) -> dict[str, float | int]:
        """Polls, polls missed (in all), the longest time without a reading (up to now) and
        the slowest answer: what the controller's meter lagged behind the proxy's counts."""
        gap = max(self.longest_gap_s, self.clock.now() - self.last_read_at)
        return {
            "polls": self.polls,
            "missed": self.missed_total,
            "longest_gap_s": round(gap, 3),
            "slowest_answer_ms": round(1e3 * self.slowest_answer_s, 1),
            "bound_s": round(self.bound_s, 3),
        }

    async def poll(self) -> None:
        """One read of ``/tidal/stats`` bounded by ``bound_s``; a failure is counted (and
        raised once ``missed_polls`` failed in a row), the last reading kept."""
        bound = self.bound_s
        self.polls += 1
        t0 = time.perf_counter()
        try:
            resp = await asyncio.wait_for(self.admin.get("/tidal/stats", timeout=bound), bound)
            resp.raise_for_status()
            meter = resp.json()["decode_meter"]
            reading = (float(meter["tokens"]), float(meter["inflight_s"]))
        except (TimeoutError, httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            self._missed(exc, bound)
            return
        took = time.perf_counter() - t0
        self.slowest_answer_s = max(self.slowest_answer_s, took)
        self.bound_s = min(self.max_timeout_s, max(self.timeout_s, LOAD_FACTOR * took))
        now = self.clock.now()
        self.longest_gap_s = max(self.longest_gap_s, now - self.last_read_at)
        self.missed, self.last_read_at = 0, now
        first = self.last is None
        self.last = reading
        if first:
            self.ctl.decode_meter = self.read
            log.info("decode meter: reading the proxy's counts every %.1f s", self.every_s)

    def _missed(self, exc: BaseException, bound: float) -> None:
        self.missed += 1
        self.missed_total += 1
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if isinstance(exc, (TimeoutError, httpx.TimeoutException)):
            why = f"no answer within {bound:.1f} s"
            self.bound_s = min(self.max_timeout_s, 2 * bound)
        since = self.clock.now() - self.last_read_at
        if self.missed >= self.missed_polls:
            raise RuntimeFailure(
                f"decode meter: the proxy's /tidal/stats failed {self.missed} times in a row "
                f"({since:.0f} s without a reading; each poll bounded by up to "
                f"{self.max_timeout_s:.0f} s); last: {why}"
            ) from exc
        log.warning(
            "decode meter: /tidal/stats failed (%s), keeping the last reading (%d of %d in a "
            "row, %.0f s since the last; the counts are cumulative: nothing is lost); next "
            "bound %.1f s",
            why,
            self.missed,
            self.missed_polls,
            since,
            self.bound_s,
        )

    async def run(self) -> NoReturn:
        while True:
            await self.poll()
            await self.clock.asleep(self.every_s)
