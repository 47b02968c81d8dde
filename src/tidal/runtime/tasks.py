"""One owner for every background task and remote call of a run (an ``asyncio.TaskGroup``-style
supervisor): nothing the run starts can die unseen (DESIGN.md: loops never die silently).

In: coroutines started with ``Parts.spawn(part, coro)``; synchronous handlers wrapped with
``Parts.guard_handler`` (the controller's ``handle``, called from callbacks and tasks); Ray
calls awaited through ``remote``. Out: ``Parts.run(main)`` returns ``main``'s result, or raises
``PartFailed`` naming the part and the cause of the first failure (``main`` is then cancelled and
the run stops cleanly through its ``finally`` blocks); ``Parts.aclose`` cancels what is left and
awaits it (bounded), so no task outlives the run. ``remote`` bounds a Ray call and turns its
errors into one readable line (``RuntimeFailure`` / ``TimeoutExpired``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from tidal.errors import TidalError, TimeoutExpired
from tidal.runtime.cell import RuntimeFailure

if TYPE_CHECKING:
    from tidal.types import Event

log = logging.getLogger(__name__)
T = TypeVar("T")


class PartFailed(TidalError):
    """A part of the run (a background task, the controller handling an event) failed: the run
    stops and this names the part and the cause."""

    exit_code = 3

    def __init__(self, part: str, cause: BaseException) -> None:
        self.part, self.cause = part, cause
        first = (str(cause).splitlines() or [""])[0]
        super().__init__(f"run stopped: {part} failed: {type(cause).__name__}: {first}")


class RunStopped(TidalError):
    """An error that is itself the reason the run stops (one line, e.g. its proxy died), not
    a part's failure: raised by a part, it is the run's failure as it is."""


class Parts:
    """Owns the run's background tasks; the first failure is raised into the run.

    ``root_cause``: asked on every failure for a ``TidalError`` that explains it (the run's
    proxy has died, say); when it gives one, that error is the run's failure (one line, no
    traceback) instead of its consequence."""

    def __init__(self, root_cause: Callable[[], TidalError | None] | None = None) -> None:
        self._tasks: dict[asyncio.Task, str] = {}
        self._failure: TidalError | None = None
        self._failed = asyncio.Event()
        self.root_cause = root_cause

    @property
    def failure(self) -> TidalError | None:
        return self._failure

    def _root(self) -> TidalError | None:
        return self.root_cause() if self.root_cause is not None else None

    def fail(self, part: str, exc: BaseException) -> TidalError:
        """Record a failure (the first one wins: later ones are consequences) and wake ``run``."""
        if self._failure is not None:
            return self._failure
        root = exc if isinstance(exc, PartFailed | RunStopped) else self._root()
        if root is not None:  # one line, which the run's caller prints (the CLI does)
            self._failure = root
            log.info("%s", root)
        else:
            failed = PartFailed(part, exc)
            failed.__cause__ = exc
            self._failure = failed
            log.error("%s", failed, exc_info=(type(exc), exc, exc.__traceback__))
        self._failed.set()
        return self._failure

    def check(self) -> None:
        """Raise the recorded failure, if any (for loops that poll between awaits)."""
        if self._failure is not None:
            raise self._failure

    def spawn(self, part: str, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Start ``coro`` as a task owned here; if it raises, the run fails with its cause."""
        task = asyncio.get_running_loop().create_task(coro, name=part)
        self._tasks[task] = part
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        part = self._tasks.pop(task, task.get_name())
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.fail(part, exc)

    def guard_handler(self, handle: Callable[[Event], None]) -> Callable[[Event], None]:
        """The controller's ``handle`` whose exceptions become this run's failure, named
        ``controller handling <EventType>`` (and re-raised, so the caller does not go on as if
        the event had been handled)."""

        def guarded(event: Event) -> None:
            try:
                handle(event)
            except Exception as exc:
                raise self.fail(f"controller handling {type(event).__name__}", exc) from exc

        return guarded

    async def run(self, main: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """``main``'s result; ``PartFailed`` as soon as any owned part fails; ``TimeoutExpired``
        after ``timeout_s``. ``main`` is cancelled (and awaited) in both error cases."""
        task = asyncio.get_running_loop().create_task(main, name="run")
        failed = asyncio.get_running_loop().create_task(self._failed.wait())
        try:
            await asyncio.wait(
                {task, failed}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            failed.cancel()
        if task.done() and self._failure is None:
            if task.exception() is not None and (root := self._root()) is not None:
                raise root  # main failed as a consequence (e.g. of a dead proxy)
            return task.result()  # main's own error propagates as itself
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task  # its finally blocks run: files closed, clients shut
        if self._failure is not None:
            raise self._failure
        raise TimeoutExpired(f"run not finished within {timeout_s} s (runtime.run_timeout_s)")

    async def aclose(self, timeout_s: float = 30.0) -> None:
        """Cancel every task still owned and wait (bounded) until each has ended."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout_s)
            for task in pending:
                log.error(
                    "task %s did not end within %.0f s of its cancellation",
                    task.get_name(),
                    timeout_s,
                )


async def remote(call: Awaitable[T], what: str, timeout_s: float) -> T:
    """Await a Ray call (an ``ObjectRef``) at most ``timeout_s``; its errors become one line:
    ``TimeoutExpired`` when no answer came, ``RuntimeFailure`` naming ``what`` and the cause
    (an actor's own ``RuntimeFailure`` keeps its message)."""
    import ray

    try:
        return await asyncio.wait_for(call, timeout_s)
    except TimeoutError:
        raise TimeoutExpired(f"{what}: no answer within {timeout_s:.0f} s") from None
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause if isinstance(exc.cause, Exception) else exc
        first = (str(cause).splitlines() or [""])[0]
        raise RuntimeFailure(f"{what}: {type(cause).__name__}: {first}") from None
    except ray.exceptions.RayError as exc:  # actor died, killed, unreachable
        first = (str(exc).splitlines() or [""])[0]
        raise RuntimeFailure(f"{what}: {type(exc).__name__}: {first}") from None
