"""Clocks. Core code never reads the wall clock nor waits on it directly: it is handed a ``Clock``.

``WallClock`` is for production, ``ManualClock`` for tests and the simulator's virtual time.
Both return seconds as floats; only differences are meaningful. Waits are injected like time:
``sleep`` (a thread), ``asleep`` (the event loop), ``wait`` (on a ``threading.Condition`` the
caller holds), and ``wait_until`` / ``await_until`` (poll a condition until a deadline; a
``TimeoutExpired`` naming what was awaited when it passes). On a ``ManualClock`` a wait moves
virtual time forward by its length instead of blocking, so a loop bounded by a deadline on that
clock ends in tests without wall time passing.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from tidal.errors import TidalError, TimeoutExpired


@runtime_checkable
class Clock(Protocol):
    def now(self) -> float:
        """Seconds on this clock's time line."""
        ...

    def sleep(self, dt_s: float) -> None:
        """Block this thread for ``dt_s`` on this clock."""
        ...

    async def asleep(self, dt_s: float) -> None:
        """Let ``dt_s`` pass on this clock (other tasks run meanwhile)."""
        ...

    def wait(self, cv: threading.Condition, dt_s: float) -> None:
        """Wait on ``cv`` (held by the caller) until notified or ``dt_s`` passed."""
        ...


class WallClock:
    """Monotonic wall time (``time.monotonic``)."""

    def now(self) -> float:
        return time.monotonic()

    def sleep(self, dt_s: float) -> None:
        time.sleep(max(0.0, dt_s))

    async def asleep(self, dt_s: float) -> None:
        await asyncio.sleep(max(0.0, dt_s))

    def wait(self, cv: threading.Condition, dt_s: float) -> None:
        cv.wait(max(0.0, dt_s))


class ManualClock:
    """A clock that moves only when told to, or by the length of a wait; never backwards."""

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

    def sleep(self, dt_s: float) -> None:
        self.advance(max(0.0, dt_s))

    async def asleep(self, dt_s: float) -> None:
        start = self._now
        await asyncio.sleep(0)  # other tasks run first, as they would during a real wait
        self.set(max(self._now, start + max(0.0, dt_s)))

    def wait(self, cv: threading.Condition, dt_s: float) -> None:
        cv.wait(0)  # lets a notifier that holds no lock yet in, without wall time passing
        self.advance(max(0.0, dt_s))


def wait_until(
    clock: Clock, cond: Callable[[], bool], timeout_s: float, what: str, every_s: float = 0.05
) -> None:
    """Block until ``cond()`` holds; ``TimeoutExpired`` (naming ``what``) after ``timeout_s``
    on ``clock``. ``cond`` is checked every ``every_s``."""
    deadline = clock.now() + timeout_s
    while not cond():
        if clock.now() > deadline:
            raise TimeoutExpired(f"{what}: not within {timeout_s:g} s")
        clock.sleep(min(every_s, max(0.0, deadline - clock.now()) + 1e-6))


async def await_until(
    clock: Clock, cond: Callable[[], bool], timeout_s: float, what: str, every_s: float = 0.05
) -> None:
    """``wait_until`` on the event loop."""
    deadline = clock.now() + timeout_s
    while not cond():
        if clock.now() > deadline:
            raise TimeoutExpired(f"{what}: not within {timeout_s:g} s")
        await clock.asleep(min(every_s, max(0.0, deadline - clock.now()) + 1e-6))
