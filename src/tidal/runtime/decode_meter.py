"""The decode meter of a real run: the proxy's cumulative (tokens the engines decoded,
sequence-seconds calls were held at them), read from its ``/tidal/stats`` for the controller.

In: the run's admin client to the proxy and the controller. Out: from the first answer on,
``ctl.decode_meter`` returns the latest pair (a cached read: the controller calls it on the loop
for every observation; before the first answer it stays None, not metered). ``run`` is a part of
the run (``tasks.Parts``): it polls every ``every_s``, each poll bounded by ``timeout_s``; a
failed poll is logged and the last pair kept; ``missed_polls`` failing in a row raise
``RuntimeFailure`` (a dead proxy is named as the cause instead, by ``Parts``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, NoReturn

import httpx

from tidal.clock import Clock
from tidal.runtime.cell import RuntimeFailure

if TYPE_CHECKING:
    from tidal.control.controller import Controller

log = logging.getLogger(__name__)


class DecodeMeter:
    def __init__(
        self,
        admin: httpx.AsyncClient,
        ctl: Controller,
        clock: Clock,
        every_s: float = 2.0,
        timeout_s: float = 5.0,
        missed_polls: int = 12,
    ) -> None:
        self.admin, self.ctl, self.clock = admin, ctl, clock
        self.every_s, self.timeout_s, self.missed_polls = every_s, timeout_s, missed_polls
        self.last: tuple[float, float] | None = None
        self.missed = 0  # polls failed in a row

    def read(self) -> tuple[float, float]:
        """The latest (tokens, sequence-seconds); set as the controller's meter only once one
        was read."""
        assert self.last is not None, "no reading yet"
        return self.last

    async def poll(self) -> None:
        """One bounded read of ``/tidal/stats``; a failure is counted (and raised once
        ``missed_polls`` failed in a row), the last reading kept."""
        try:
            resp = await asyncio.wait_for(
                self.admin.get("/tidal/stats", timeout=self.timeout_s), self.timeout_s
            )
            resp.raise_for_status()
            meter = resp.json()["decode_meter"]
            reading = (float(meter["tokens"]), float(meter["inflight_s"]))
        except (TimeoutError, httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            self.missed += 1
            why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if self.missed >= self.missed_polls:
                raise RuntimeFailure(
                    f"decode meter: the proxy's /tidal/stats failed "
                    f"{self.missed} times in a row; last: {why}"
                ) from exc
            log.warning(
                "decode meter: /tidal/stats failed (%s), keeping the last reading (%d of %d)",
                why,
                self.missed,
                self.missed_polls,
            )
            return
        self.missed = 0
        first = self.last is None
        self.last = reading
        if first:
            self.ctl.decode_meter = self.read
            log.info("decode meter: reading the proxy's counts every %.1f s", self.every_s)

    async def run(self) -> NoReturn:
        while True:
            await self.poll()
            await self.clock.asleep(self.every_s)
