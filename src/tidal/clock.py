"""Clocks. Core code never reads the wall clock: it is handed a ``Clock``.

``WallClock`` is for production, ``ManualClock`` for tests and the simulator's virtual time.
Both return seconds as floats; only differences are meaningful.
"""

from __future__ import annotations

import time
from typing import Protocol, runtime_checkable

from tidal.errors import TidalError


@runtime_checkable
class Clock(Protocol):
    def now(self) -> float:
        """Seconds on this clock's time line."""
        ...


class WallClock:
    """Monotonic wall time (``time.monotonic``)."""

    def now(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock that moves only when told to; time never goes backwards."""

    def __init__(self, start_s: float = 0.0) -> None:
        self._now = float(start_s)

    def now(self) -> float:
        return self._now

    def advance(self, dt_s: float) -> float:
        if dt_s < 0:
            raise TidalError(f"ManualClock.advance: negative step {dt_s}")
        self._now += dt_s
        return self._now

    def set(self, t_s: float) -> float:
        if t_s < self._now:
            raise TidalError(f"ManualClock.set: {t_s} is before now ({self._now})")
        self._now = float(t_s)
        return self._now
