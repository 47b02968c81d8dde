"""The proxy's admission queue: calls waiting for an engine slot, served first come, first
served, each for as long as its own deadline allows.

In: a call that found no engine with room (``acquire``) and every event that may free or add a
slot (``notify``: an attempt ended, an engine joined, came back or was undrained). Out: an
engine for the call at the head of the queue as soon as one has room, or ``Overloaded`` at the
call's deadline. Invariant kept: a call never overtakes one that waited longer (a new call with
a queue ahead joins its end), and the head is woken by every freed slot, never by polling.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from tidal.serving.protocol import Overloaded

T = TypeVar("T")
RECHECK_S = 1.0  # a woken head re-picks at once; this only bounds a missed notification


class AdmissionQueue:
    def __init__(self) -> None:
        self._queue: deque[asyncio.Event] = deque()
        self.admitted_after_wait = 0
        self.max_wait_s = 0.0
        self.timed_out = 0

    def __len__(self) -> int:
        return len(self._queue)

    def notify(self) -> None:
        """A slot may be free: the head of the queue tries again."""
        if self._queue:
            self._queue[0].set()

    async def acquire(self, pick: Callable[[], T | None], deadline: float) -> T:
        """``pick()``'s first non-None answer, taken in queue order; ``deadline`` is on the
        running loop's clock."""
        if not self._queue:
            got = pick()
            if got is not None:
                return got
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        me = asyncio.Event()
        self._queue.append(me)
        try:
            while True:
                if self._queue[0] is me and (got := pick()) is not None:
                    self.admitted_after_wait += 1
                    self.max_wait_s = max(self.max_wait_s, loop.time() - t0)
                    return got
                left = deadline - loop.time()
                if left <= 0:
                    self.timed_out += 1
                    raise Overloaded(f"no engine slot came free in {loop.time() - t0:.1f} s "
                                     f"(the call's timeout; {len(self._queue) - 1} calls "
                                     f"queued with it)")
                me.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(me.wait(), min(left, RECHECK_S))
        finally:
            head = self._queue[0] is me
            self._queue.remove(me)
            if head:
                self.notify()  # the next call gets its turn (a slot may be left)

    def stats(self) -> dict:
        return {"queued": len(self._queue), "admitted_after_wait": self.admitted_after_wait,
                "queue_max_wait_s": round(self.max_wait_s, 3),
                "queue_timeouts": self.timed_out}
