"""Live progress of ``tidal run`` that a person can follow: a heartbeat line when output is
piped, a fixed-width panel with percentage, elapsed time and ETA in a terminal.

In: the run's size (optimizer steps and executions in all), the live-state samples
(``on_state``: burst, step, waterlevel, roles, closed executions) and the optimizer steps
(``on_step``). Out: ``line()`` (one heartbeat line), ``panel()`` (a ``rich`` renderable), and
with ``Heartbeat`` a line printed at least every ``every_s`` seconds of silence.
Progress is the mean of two fractions: executions closed of all, optimizer steps done of all
(rollout and training both count). ETA is from the run's own rate: time since its first
dispatch (the first state sample) × (1 - progress) / progress; unknown before any progress.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Group


def clock_text(s: float | None) -> str:
    """``h:mm:ss`` (``-:--:--`` when unknown)."""
    if s is None:
        return "-:--:--"
    n = max(0, round(s))
    return f"{n // 3600}:{n % 3600 // 60:02d}:{n % 60:02d}"


class RunProgress:
    def __init__(
        self, total_steps: int, total_executions: int, now: Callable[[], float] = time.monotonic
    ) -> None:
        self.total_steps, self.total_executions = max(1, total_steps), max(1, total_executions)
        self.now = now
        self.started = now()
        self.first_dispatch: float | None = None
        self.state: dict[str, Any] = {}
        self.steps = 0
        self.lock = threading.Lock()

    def on_state(self, st: dict[str, Any]) -> None:
        with self.lock:
            if self.first_dispatch is None:
                self.first_dispatch = self.now()
            self.state = dict(st)
            self.steps = max(self.steps, int(st.get("step", 0)))

    def on_step(self, line: dict[str, Any]) -> None:
        with self.lock:
            self.steps = max(self.steps, int(line["step"]) + 1)

    def finish(self, summary: dict[str, Any]) -> None:
        """The final frame is the final state: every step done, every execution closed."""
        with self.lock:
            self.steps = int(summary.get("trainer_steps", self.steps))
            self.state = {
                **self.state,
                "step": self.steps,
                "closed": summary.get("closed", self.state.get("closed")),
                "version": summary.get("version", self.state.get("version")),
            }

    def fraction(self) -> float:
        closed = self.state.get("closed")
        f_steps = min(1.0, self.steps / self.total_steps)
        if closed is None:
            return f_steps
        return (min(1.0, closed / self.total_executions) + f_steps) / 2

    def elapsed(self) -> float:
        return self.now() - self.started

    def eta(self) -> float | None:
        f = self.fraction()
        if self.first_dispatch is None or f <= 0.0:
            return None
        if f >= 1.0:
            return 0.0
        ran = self.now() - self.first_dispatch
        return ran * (1.0 - f) / f

    def line(self) -> str:
        """One heartbeat line: where the run is and how long it has left."""
        with self.lock:
            st = self.state
            head = f"[{clock_text(self.elapsed())}]"
            if not st:
                return f"{head} starting: Ray, engines, proxy, model (no dispatch yet)"
            closed = st.get("closed")
            execs = "-" if closed is None else str(closed)
            return (
                f"{head} burst {st.get('burst', '-')} step {self.steps}/{self.total_steps} "
                f"w {st.get('waterlevel', '-')} roles {' '.join(st.get('roles', []))} "
                f"executions {execs}/{self.total_executions} "
                f"{100 * self.fraction():.0f}% ETA {clock_text(self.eta())}"
            )

    def panel(self) -> Group:
        """The terminal panel: a fixed-width table and a progress line."""
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        with self.lock:
            st, f, eta = dict(self.state), self.fraction(), self.eta()
        table = Table(title="tidal run", show_header=False, width=78)
        table.add_column("what", width=30, no_wrap=True)
        table.add_column("value", width=44, no_wrap=True)
        if not st:
            table.add_row("starting", "Ray, engines, proxy, model")
        else:
            reward = "-" if st.get("reward") is None else f"{st['reward']:.3f}"
            colour = {
                "rollout": "blue",
                "training": "dark_orange",
                "moving_to_training": "red",
                "moving_to_rollout": "magenta",
            }
            cells = " ".join(
                f"[{colour.get(r, 'white')}]{i}:{r[:8]}[/]"
                for i, r in enumerate(st.get("roles", []))
            )
            closed = st.get("closed")
            for key, val in (
                (
                    "burst / step / version",
                    f"{st.get('burst')} / {self.steps} of "
                    f"{self.total_steps} / v{st.get('version')}",
                ),
                (
                    "executions closed",
                    f"{'-' if closed is None else closed} of {self.total_executions}",
                ),
                ("mean reward (last step)", reward),
                (
                    "waterlevel (queued + running)",
                    f"{st.get('waterlevel')} ({st.get('queued')} + {st.get('running')})",
                ),
                ("calls queued at the proxy", str(st.get("proxy_queued", "-"))),
                ("cells", cells),
                ("transitions / replaced", f"{st.get('switches')} / {st.get('replaced')}"),
            ):
                table.add_row(key, val)
        bar = ProgressBar(total=1000, completed=int(1000 * f), width=40)
        text = Text(
            f" {100 * f:5.1f}%  elapsed {clock_text(self.elapsed())}  ETA {clock_text(eta)}"
        )
        grid = Table.grid()
        grid.add_row(bar, text)
        return Group(table, grid)


class Heartbeat:
    """Prints ``progress.line()`` through ``echo`` whenever nothing was printed for
    ``every_s`` seconds (``printed()`` marks other output); a daemon thread, until ``stop()``."""

    def __init__(
        self, progress: RunProgress, echo: Callable[[str], None], every_s: float = 10.0
    ) -> None:
        self.progress, self.echo, self.every_s = progress, echo, every_s
        self.last = progress.now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tidal-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def printed(self) -> None:
        self.last = self.progress.now()

    def beat_if_due(self) -> bool:
        if self.progress.now() - self.last < self.every_s:
            return False
        self.echo(self.progress.line())
        self.printed()
        return True

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, self.every_s / 4)):
            self.beat_if_due()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
