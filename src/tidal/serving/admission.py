"""The proxy's admission queue: calls waiting for an engine slot, served in the fair order of
``tidal.control.admission.FairQueue`` (the one the simulator's engines use), each for as long
as its own deadline allows.

In: a call that found no engine with room (``acquire``) and every event that may free or add a
slot (``notify``: an attempt ended, an engine joined, came back or was undrained). Out: an
engine for the call at the head of the queue as soon as one has room, or ``Overloaded`` at the
call's deadline. Invariant kept: a call never overtakes one ahead of it in the fair order
(``longest_waiting``: its group, by default the call's execution, waited longer; a new call with
a queue ahead is placed in that order, never picked past it), and the head is woken by every
freed slot, never by polling. With one call per execution ``longest_waiting`` is first come,
first served. How many calls an engine runs at once (its cap) is the router's; with admission
control on, the proxy caps each engine at ``control.admission``'s concurrency target.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Hashable
from typing import TypeVar

from tidal.control.admission import FairQueue
from tidal.serving.protocol import Overloaded

T = TypeVar("T")
RECHECK_S = 1.0  # a woken head re-picks at once; this only bounds a missed notification


class AdmissionQueue:
    def __init__(self, order: str = "longest_waiting") -> None:
        self._queue = FairQueue(order)
        self.admitted_after_wait = 0
        self.max_wait_s = 0.0
        self.timed_out = 0

    def __len__(self) -> int:
        return len(self._queue)

    def notify(self) -> None:
        """A slot may be free: the head of the queue tries again."""
        head = self._queue.peek()
        if head is not None:
            head.set()  # type: ignore[attr-defined]

    async def acquire(
        self,
        pick: Callable[[], T | None],
        deadline: float,
        group: Hashable | None = None,
        remaining: float | None = None,
        on_wait: Callable[[float], None] | None = None,
    ) -> T:
        """``pick()``'s first non-None answer, taken in the fair order (``group``: whose wait
        counts, default the call itself; ``remaining``: its work, for ``shortest_remaining``);
        ``deadline`` is on the running loop's clock. ``on_wait`` gets the seconds the call
        waited in the queue, once it is admitted after waiting (never on the fast path)."""
        if not len(self._queue):
            got = pick()
            if got is not None:
                return got
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        me = asyncio.Event()
        self._queue.push(me, me if group is None else group, t0, remaining)
        try:
            while True:
                if self._queue.peek() is me and (got := pick()) is not None:
                    waited = loop.time() - t0
                    self.admitted_after_wait += 1
                    self.max_wait_s = max(self.max_wait_s, waited)
                    if on_wait is not None:
                        on_wait(waited)
                    return got
                left = deadline - loop.time()
                if left <= 0:
                    self.timed_out += 1
                    raise Overloaded(
                        f"no engine slot came free in {loop.time() - t0:.1f} s "
                        f"(the call's timeout; {len(self._queue) - 1} calls "
                        f"queued with it)"
                    )
                me.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(me.wait(), min(left, RECHECK_S))
        finally:
            head = self._queue.peek() is me
            self._queue.discard(me)
            if head:
                self.notify()  # the next call gets its turn (a slot may be left)

    def stats(self) -> dict:
        return {
            "queued": len(self._queue),
            "admitted_after_wait": self.admitted_after_wait,
            "queue_max_wait_s": round(self.max_wait_s, 3),
            "queue_timeouts": self.timed_out,
        }
