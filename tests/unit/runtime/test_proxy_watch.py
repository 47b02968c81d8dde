"""A dead proxy is the run's one-line stop (issue 29, item 3), without Ray: ``proxy_watch``
sees a real process's death and names it with the resume command, and ``Parts`` reports a
failure that only follows from it (a refused connection) as the dead proxy, logged without a
traceback, whether a background part or the run's main coroutine hit it."""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tidal.clock import WallClock
from tidal.runtime import proxy_watch
from tidal.runtime.proxy_watch import ProxyLost
from tidal.runtime.tasks import PartFailed, Parts

RUN = Path("runs/x")


@pytest.fixture
def proc():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p
    if p.poll() is None:
        p.kill()
        p.wait(10)


def test_lost_names_the_signal_and_the_resume_command(proc):
    assert proxy_watch.lost(proc, RUN) is None
    proc.send_signal(signal.SIGKILL)
    gone = proxy_watch.lost(proc, RUN, grace_s=10)
    assert isinstance(gone, ProxyLost) and gone.exit_code == 4
    line = str(gone)
    assert "\n" not in line and f"(pid {proc.pid}) killed by SIGKILL" in line
    # no checkpoint in runs/x: resuming would refuse, so the line says to start again
    assert line.endswith(
        "It stopped before its first checkpoint, so it cannot be resumed; "
        "start it again with: tidal run runs/x/config.yaml --out runs/x"
    )
    assert "--resume" not in line


def test_a_run_with_a_checkpoint_is_told_to_resume(proc, tmp_path):
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "state.json").write_text("{}")
    proc.send_signal(signal.SIGKILL)
    line = str(proxy_watch.lost(proc, tmp_path, grace_s=10))
    assert line.endswith(
        f"(see {tmp_path}/logs/proxy.log). Continue the run with: tidal run --resume {tmp_path}"
    )


def test_the_watch_ends_the_run_within_a_poll(proc):
    async def main():
        parts = Parts()
        parts.spawn("proxy", proxy_watch.watch(proc, RUN, WallClock(), every_s=0.05))
        asyncio.get_running_loop().call_later(0.2, proc.kill)
        await parts.run(asyncio.sleep(30), 30)

    with pytest.raises(ProxyLost, match="killed by SIGKILL"):
        asyncio.run(main())


def test_a_consequence_of_the_dead_proxy_is_reported_as_the_dead_proxy(proc, caplog):
    def refused() -> None:
        raise httpx.ConnectError("All connection attempts failed")

    async def part() -> None:
        refused()

    async def background():
        parts = Parts(root_cause=lambda: proxy_watch.lost(proc, RUN, grace_s=5))
        parts.spawn("bridge", part())
        await parts.run(asyncio.sleep(30), 30)

    async def main_itself():  # the run's own coroutine (the summary's last calls)
        parts = Parts(root_cause=lambda: proxy_watch.lost(proc, RUN, grace_s=5))
        await parts.run(part(), 30)

    proc.kill()
    for run in (background, main_itself):
        with caplog.at_level(logging.ERROR), pytest.raises(ProxyLost):
            asyncio.run(run())
    assert not any(r.exc_info for r in caplog.records)  # one line, no traceback


def test_with_the_proxy_alive_a_failure_is_its_own(proc):
    async def part() -> None:
        raise RuntimeError("a bug")

    async def main():
        parts = Parts(root_cause=lambda: proxy_watch.lost(proc, RUN))
        parts.spawn("bridge", part())
        await parts.run(asyncio.sleep(30), 30)

    with pytest.raises(PartFailed, match="bridge failed: RuntimeError: a bug"):
        asyncio.run(main())
