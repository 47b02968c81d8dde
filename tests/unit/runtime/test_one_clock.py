"""One clock: ``decisions.jsonl`` stamps seconds since the run's first dispatch, like every other
file of a run directory, and ``t0_utc`` names that instant once (``tidal.runtime.outputs``)."""

import json
from datetime import UTC, datetime

from tidal.clock import ManualClock
from tidal.control.decision_log import DecisionLog, jsonl_file_sink
from tidal.runtime.outputs import RunOutputs


def test_decisions_count_from_the_first_dispatch_over_a_resume(tmp_path):
    clock = ManualClock(start_s=620.0)  # a monotonic clock far from zero
    out = RunOutputs(tmp_path, clock, resumed_elapsed_s=30.0, append=False)
    with open(tmp_path / "decisions.jsonl", "w") as fh:
        log = DecisionLog(out.since_first_dispatch(jsonl_file_sink(fh)), keep=True)
        clock.advance(4.0)
        log.write({"type": "plan_start", "t": clock.now(), "plan_id": 1})  # before dispatch
        clock.advance(1.0)
        out.start_clock()  # the first dispatch of this incarnation, 30 s into the run
        clock.advance(2.5)
        log.write({"type": "plan_done", "t": clock.now(), "plan_id": 1})
        log.write({"type": "note"})  # a record without a time passes unchanged
    lines = [json.loads(x) for x in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    assert [x.get("t") for x in lines] == [29.0, 32.5, None]
    assert log.records[1]["t"] == 627.5  # the controller's own record keeps its clock
    assert out.elapsed() == 32.5


def test_t0_utc_is_now_minus_the_elapsed_run_time(tmp_path):
    clock = ManualClock(start_s=100.0)
    out = RunOutputs(tmp_path, clock, resumed_elapsed_s=0.0, append=True)
    out.start_clock()
    clock.advance(3600.0)
    t0 = datetime.fromisoformat(out.t0_utc())
    assert t0.tzinfo is not None
    assert abs((datetime.now(UTC) - t0).total_seconds() - 3600.0) < 5.0
