"""The proxy is a supervised part of a run: its death stops the run at once, in one line.

In: the proxy's process handle (``serving.launch.ServerProcess``) and the run directory. Out:
``watch`` (a part of the run, polled every ``every_s``, 0.2 s: one ``waitpid``) raises
``ProxyLost`` as soon as the process has exited; ``Parts`` asks ``lost`` for the root cause of
any other failure, so an error that is only a consequence (a ``ConnectError`` of the bridge, of
a plan step, of the summary calls at the end) is reported as the dead proxy instead.

Why stop rather than restart: the proxy holds the run's in-flight state that nothing else has
(the token records of calls being generated, the execution registry the harnesses use, the
drains in progress); a new proxy could not deliver those calls' records, so the run would train
on less than it dispatched. The checkpoint already holds a consistent cut (every closed
execution trained or held), so ``tidal run --resume DIR`` continues with nothing lost or trained
twice; the error names that command, or, with no checkpoint written yet, the command that
starts the run again (``checkpoint.how_to_continue``).
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from typing import NoReturn

from tidal.clock import Clock
from tidal.runtime.checkpoint import how_to_continue
from tidal.runtime.tasks import RunStopped


class ProxyLost(RunStopped):
    """The run's proxy process ended: the run stops; ``--resume`` continues it."""

    exit_code = 4


def _how(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with {returncode}"


def lost(proc: subprocess.Popen, run_dir: Path, grace_s: float = 0.0) -> ProxyLost | None:
    """``ProxyLost`` if the proxy process has ended (waiting at most ``grace_s`` for it: its
    socket closes a moment before its exit status can be read), else None."""
    try:
        code = proc.wait(grace_s) if grace_s > 0 else proc.poll()
    except subprocess.TimeoutExpired:
        code = None
    if code is None:
        return None
    return ProxyLost(
        f"run stopped: the proxy (pid {proc.pid}) {_how(code)} (see "
        f"{run_dir / 'logs' / 'proxy.log'}). {how_to_continue(run_dir)}"
    )


async def watch(
    proc: subprocess.Popen, run_dir: Path, clock: Clock, every_s: float = 0.2
) -> NoReturn:
    """Forever, until the proxy process ends: then ``ProxyLost`` (the run stops)."""
    while True:
        gone = lost(proc, run_dir)
        if gone is not None:
            raise gone
        await clock.asleep(every_s)
