"""Issue 38 item (15) without Ray: an interrupted ``tidal`` process stops promptly whatever is
stuck. The run's event loop gives its tasks a bounded time to end and does not wait for a
thread blocked in ``asyncio.to_thread`` (``asyncio.run`` waited for it, for as long as its call
took), and the process leaves within a moment of its last line though a thread is stuck."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

from tidal.runtime.stopping import run_loop

# the driver's SIGTERM handler and loop, over a coroutine stuck in a thread and one that
# swallows its cancellation: a command of its own, run as ``tidal stuck-test``
STUCK = textwrap.dedent("""
    import asyncio, time
    import click
    from tidal.runtime import ray_start
    from tidal.runtime.stopping import run_loop

    async def stubborn():
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass

    async def main():
        asyncio.get_running_loop().create_task(stubborn())
        print("ready", flush=True)
        await asyncio.to_thread(time.sleep, 600)

    @click.command("stuck-test")
    def command() -> None:
        ray_start.trap_sigterm()
        try:
            run_loop(main(), cancel_s=1.0)
        except KeyboardInterrupt:
            print("stopped", flush=True)
            raise SystemExit(130) from None
""")
MAIN = textwrap.dedent("""
    import sys
    from tidal import cli

    cli._command_modules = lambda: {"stuck-test": "stuck_cmd"}
    sys.argv = ["tidal", "stuck-test"]
    sys.exit(cli.main())
""")


def test_sigterm_stops_a_stuck_tidal_process_within_seconds(tmp_path):
    """The stuck thread would hold a plain interpreter's exit for its 600 s (as it held a run
    on main); ``tidal`` leaves with 130 within seconds of its last line."""
    (tmp_path / "stuck_cmd.py").write_text(STUCK)
    (tmp_path / "main.py").write_text(MAIN)
    path = f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "main.py")],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path},
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        assert proc.stdout.readline().strip() == "stopped"
        stopped_s = time.monotonic() - t0
        proc.wait(10)
        exited_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert stopped_s < 4, f"the loop took {stopped_s:.1f} s to stop"
    assert proc.returncode == 130 and exited_s < 6, (proc.returncode, exited_s)


def test_the_loop_returns_its_result_and_ends_leftover_tasks():
    ended = []

    async def leftover():
        try:
            await asyncio.sleep(3600)
        finally:
            ended.append(True)

    async def main():
        asyncio.get_running_loop().create_task(leftover())
        await asyncio.sleep(0)
        return 7

    assert run_loop(main()) == 7 and ended == [True]
