"""How a run's process stops on Ctrl-C or SIGTERM: promptly, whatever is stuck.

A stop first ends the run's own work (``run_loop``: every task of the run's event loop
cancelled, given at most ``cancel_s`` to end) and then its parts (the driver's
``_stop_parts``: engines, proxy, Ray). What may still hold the process after that is no part of
the run: a worker thread blocked in a call that does not return (an agent's blocking call in
``asyncio.to_thread``, a Ray call with its own long timeout; Python joins every executor thread
at exit, so one stuck thread held the exit for as long as its call), or native teardown. So an
interrupted ``tidal`` process (``exit_soon``) leaves at most ``grace_s`` after its last line,
with its exit status, without waiting for them.

In: the run's main coroutine; an exit status. Out: its result (``run_loop``), an exit within
``grace_s`` (``exit_soon``). Invariant kept: a SIGTERM ends the run within a few seconds plus the
time its parts take to stop, exit status 130.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
CANCEL_S = 5.0  # what the run's tasks get to end after an interrupt
EXIT_GRACE_S = 2.0  # what the interpreter's teardown gets after an interrupted run's last line


def run_loop(main: Coroutine[Any, Any, T], cancel_s: float = CANCEL_S) -> T:
    """``asyncio.run(main)``, except that on the way out (an interrupt, an error) the tasks
    still running get at most ``cancel_s`` to end and the loop's thread pool is not waited for
    (``asyncio.run`` waits for both without a bound)."""
    loop = asyncio.new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        try:
            _cancel_all(loop, cancel_s)
            loop.run_until_complete(asyncio.wait_for(loop.shutdown_asyncgens(), cancel_s))
        except (TimeoutError, RuntimeError) as exc:  # a second interrupt lands as it is
            log.warning("stopping the run's event loop: %s", type(exc).__name__)
        finally:
            asyncio.set_event_loop(None)
            loop.close()  # its default executor shut down without waiting for its threads


def _cancel_all(loop: asyncio.AbstractEventLoop, cancel_s: float) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in tasks:
        task.cancel()
    if not tasks:
        return
    _, pending = loop.run_until_complete(asyncio.wait(tasks, timeout=cancel_s))
    if pending:
        log.warning(
            "%d tasks did not end within %.0f s of the stop (left behind): %s",
            len(pending),
            cancel_s,
            ", ".join(sorted(t.get_name() for t in pending))[:300],
        )
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            log.debug("task %s ended with %r", task.get_name(), task.exception())


def exit_soon(code: int, grace_s: float = EXIT_GRACE_S) -> None:
    """Arm a daemon timer that ends the process with ``code`` in ``grace_s`` unless it has
    exited by then (only for a process that is ``tidal`` itself: never inside a test runner)."""

    def leave() -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)

    timer = threading.Timer(grace_s, leave)
    timer.daemon = True
    timer.start()
