"""``executions.jsonl``: the bridge joins its ledger times, the proxy's token counts and the
harness's call timings, one line per execution (what ``tidal calibrate`` fits on)."""

import json
from types import SimpleNamespace

from tidal.clock import ManualClock
from tidal.contracts.executions import ExecutionOutcome, Outcome, Turn
from tidal.contracts.run_files import CallLine
from tidal.runtime.bridge import LedgerBridge
from tidal.runtime.tasks import Parts


class _Controller:
    def __init__(self) -> None:
        self.events = []

    def handle(self, ev) -> None:
        self.events.append(ev)


def test_one_line_per_execution_with_times_tokens_and_timings(tmp_path):
    clock = ManualClock(100.0)
    bridge = LedgerBridge(
        _Controller().handle, clock, admin=None, buffer=None, group_size=2, parts=Parts()
    )
    bridge.burst = 1
    bridge.dispatched("b1-g0-e0", "b1-g0")
    clock.advance(0.5)
    bridge.launched("b1-g0-e0", "b1-g0")
    bridge.timing["b1-g0-e0"]["closed"] = 104.0  # closed() needs a running loop
    bridge.timing["b1-g0-e0"]["calls"] = [
        CallLine(prompt_tokens=20, output_tokens=8, engines=["s0"]),
        CallLine(prompt_tokens=40, output_tokens=5, engines=["c1", "s0"]),
    ]
    result = ExecutionOutcome(
        execution_id="b1-g0-e0",
        group_id="b1-g0",
        outcome=Outcome(
            reward=1.0,
            transcript=[
                Turn(action="read a", observation="a: 1", t_call=100.75, call_s=1.0, tool_s=0.25),
                Turn(action="done", t_call=102.25, call_s=1.25, tool_s=0.5),
            ],
        ),
    )
    path = tmp_path / "executions.jsonl"
    bridge.write_executions(path, [result], t0=100.0)
    (line,) = [json.loads(x) for x in path.read_text().splitlines()]
    assert line["burst"] == 1 and line["reason"] == "completed" and line["reward"] == 1.0
    assert (line["dispatched_s"], line["launched_s"], line["closed_s"]) == (0.0, 0.5, 4.0)
    assert [c["start_s"] for c in line["calls"]] == [0.75, 2.25]
    assert [(c["call_s"], c["tool_s"]) for c in line["calls"]] == [(1.0, 0.25), (1.25, 0.5)]
    assert line["calls"][1]["engines"] == ["c1", "s0"]
    assert line["transcript"][0] == {"action": "read a", "observation": "a: 1"}
    bridge.write_executions(path, [result], t0=100.0, mode="a")  # a resumed run appends
    assert len(path.read_text().splitlines()) == 2


def test_lines_are_written_as_groups_end_and_a_resume_keeps_those_of_its_checkpoint(tmp_path):
    """Issue 38 item (17): a run killed after its checkpoint keeps the lines of the executions
    it closed; the resumed run cuts the file back to the checkpoint's count, adds a restored
    (held) execution's line from its record and the re-run ones as they end: every execution
    once (on main the file was written only at the end: the killed run's were missing)."""
    import asyncio

    from tidal.contracts.calls import ExecutionRecord
    from tidal.runtime.executions_file import ExecutionsFile

    path = tmp_path / "executions.jsonl"

    def result(eid):
        return ExecutionOutcome(execution_id=eid, group_id=eid[:5], outcome=Outcome(reward=0.5))

    async def incarnation(append, n_lines, groups, restored=()):
        bridge = LedgerBridge(
            _Controller().handle,
            ManualClock(1.0),
            admin=None,
            buffer=SimpleNamespace(add=lambda rec: None),
            group_size=2,
            parts=Parts(),
        )
        bridge.file, bridge.t0 = ExecutionsFile(path, append), lambda: 0.0
        if append:
            bridge.file.restore(n_lines)
        for rec in restored:
            bridge.restore(rec)
        counts = []
        for group in groups:
            for eid in group:
                bridge.dispatched(eid, eid[:5])

            async def run(group=group):
                return [result(e) for e in group]

            await bridge.lines_after(run())
            counts.append(bridge.file.lines)
        return counts

    first = asyncio.run(incarnation(False, 0, [["b0-g0-e0", "b0-g0-e1"], ["b0-g1-e0", "b0-g1-e1"]]))
    assert first == [2, 4]  # the checkpoint after group 0 holds 2 lines; then the kill
    held = ExecutionRecord(execution_id="b0-g2-e0", group_id="b0-g2", calls=[], reward=1.0)
    asyncio.run(incarnation(True, 2, [["b0-g1-e0", "b0-g1-e1"]], restored=[held]))
    ids = [json.loads(x)["execution"] for x in path.read_text().splitlines()]
    assert ids == ["b0-g0-e0", "b0-g0-e1", "b0-g2-e0", "b0-g1-e0", "b0-g1-e1"]
