"""Live progress of ``tidal run``: the heartbeat line, its ETA from the run's own rate, and a
fixed-width terminal panel whose last frame is the final state (``tidal.viz.progress``)."""

from rich.console import Console

from tidal.clock import ManualClock
from tidal.viz.progress import Heartbeat, RunProgress, clock_text

STATE = {
    "burst": 0,
    "step": 1,
    "version": 1,
    "reward": 0.25,
    "waterlevel": 7,
    "queued": 1,
    "running": 6,
    "ready_groups": 0,
    "roles": ["training", "rollout"],
    "switches": 2,
    "replaced": 0,
    "closed": 12,
}


def test_heartbeat_speaks_after_every_s_of_silence_only():
    clock, lines = ManualClock(start_s=100.0), []
    progress = RunProgress(total_steps=4, total_executions=48, now=clock.now)
    beat = Heartbeat(progress, lines.append, every_s=10.0)
    clock.advance(9.9)
    assert not beat.beat_if_due() and lines == []
    clock.advance(0.2)
    assert beat.beat_if_due()
    assert lines == ["[0:00:10] starting: Ray, engines, proxy, model (no dispatch yet)"]
    clock.advance(5.0)
    beat.printed()  # a step line was printed
    clock.advance(9.0)
    assert not beat.beat_if_due()


def test_line_has_burst_step_waterlevel_roles_executions_elapsed_and_eta():
    clock = ManualClock(start_s=100.0)
    progress = RunProgress(total_steps=4, total_executions=48, now=clock.now)
    clock.advance(60.0)
    progress.on_state({**STATE, "step": 0, "closed": 0})  # the first dispatch
    clock.advance(30.0)
    progress.on_state(STATE)
    progress.on_step({"step": 1})
    # progress: (12/48 + 2/4) / 2 = 0.375 after 30 s since the first dispatch: 50 s left
    assert progress.fraction() == 0.375
    assert progress.line() == (
        "[0:01:30] burst 0 step 2/4 w 7 roles training rollout executions 12/48 38% ETA 0:00:50"
    )
    progress.finish({"trainer_steps": 4, "closed": 48, "version": 4})
    assert progress.line().endswith(
        "step 4/4 w 7 roles training rollout executions 48/48 100% ETA 0:00:00"
    )


def test_panel_has_fixed_widths_and_its_last_frame_is_the_final_state():
    clock = ManualClock(start_s=100.0)
    progress = RunProgress(total_steps=4, total_executions=48, now=clock.now)

    def frame() -> list[str]:
        console = Console(width=120, record=True, color_system=None)
        console.print(progress.panel())
        return console.export_text().splitlines()

    progress.on_state({**STATE, "roles": ["rollout", "rollout"], "waterlevel": 1})
    first = frame()
    progress.on_state({**STATE, "roles": ["moving_to_training", "rollout"], "waterlevel": 1234})
    second = frame()
    assert [len(x) for x in first] == [len(x) for x in second]
    progress.finish({"trainer_steps": 4, "closed": 48, "version": 4})
    last = "\n".join(frame())
    assert "4 of 4" in last and "48 of 48" in last and "100.0%" in last and "ETA 0:00:00" in last


def test_clock_text():
    assert clock_text(None) == "-:--:--"
    assert clock_text(3725.4) == "1:02:05"
