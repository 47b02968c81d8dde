"""From the harness side to the control and training planes.

In: the harness pool's ledger callbacks (``dispatched`` / ``launched`` / ``closed``, on the
driver's event loop) and, for each closed execution, its token records from the proxy's admin
API. Out: ``ExecutionDispatched`` / ``ExecutionLaunched`` / ``ExecutionClosed`` events into the
controller, and one ``ExecutionRecord`` per closed execution into the trajectory buffer.
Invariant 7 is counted here: ``lost`` = executions dispatched whose record never reached the
trajectory buffer (it must end at 0).

A ``reward_error`` execution (reward None) reaches the ledger and the buffer as it is, with no
stand-in 0.0: its record is delivered (so it is not lost), and the ledger's rule decides what its
group trains (``tidal.control.ledger``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tidal.clock import Clock
from tidal.contracts import run_files as schema
from tidal.contracts.calls import CallRecord, ExecutionRecord
from tidal.contracts.close import CloseReason
from tidal.contracts.executions import ExecutionOutcome, Outcome
from tidal.runtime.executions_file import ExecutionsFile
from tidal.runtime.tasks import Parts
from tidal.serving.shared_http import idempotent, why
from tidal.training.records import record_from_proxy
from tidal.training.trajectory_buffer import TrajectoryBuffer
from tidal.types import (
    Event,
    ExecutionClosed,
    ExecutionDispatched,
    ExecutionLaunched,
)

log = logging.getLogger(__name__)


class LedgerBridge:
    """A ``tidal.agents.events.LedgerEvents`` feeding the controller and the buffer."""

    def __init__(
        self,
        handle: Callable[[Event], None],
        clock: Clock,
        admin: httpx.AsyncClient,
        buffer: TrajectoryBuffer,
        group_size: int,
        parts: Parts,
        tokens: bool = False,
    ) -> None:
        self.handle, self.clock, self.admin, self.parts = handle, clock, admin, parts
        # runtime.deterministic: each call's tokens, log-probs and weight versions go into
        # executions.jsonl too (what two seeded runs are compared on)
        self.tokens = tokens
        self.buffer, self.group_size = buffer, group_size
        self.burst = 0
        self.n_dispatched = 0
        self.close_counts: dict[str, int] = {}
        self.recorded = 0
        self.record_errors: list[str] = []
        self.rewards: list[float] = []
        self.restored: set[str] = set()
        # per execution, for executions.jsonl: burst, times, and a line per recorded call
        self.timing: dict[str, dict[str, Any]] = {}
        # engine id -> weight version -> output tokens it generated (what each engine served)
        self.tokens_by_engine_version: dict[str, dict[str, int]] = {}
        # "<from>-><to>" -> calls that continued on another engine (a drain, a lost engine)
        self.engine_handoffs: dict[str, int] = {}
        self._tasks: set[asyncio.Task] = set()
        self._record_of: dict[str, asyncio.Task] = {}  # execution id -> its record's fetch
        # executions.jsonl as the run goes (``wiring`` sets it; None: written at the end only)
        self.file: ExecutionsFile | None = None
        self.t0: Callable[[], float] = lambda: 0.0  # the run's time zero (``RunOutputs.t0``)

    def dispatched(self, execution_id: str, group_id: str) -> None:
        self.n_dispatched += 1
        self.timing[execution_id] = {"burst": self.burst, "dispatched": self.clock.now()}
        self.handle(
            ExecutionDispatched(
                self.clock.now(), execution_id, group_id, self.group_size, self.burst
            )
        )

    def launched(self, execution_id: str, group_id: str) -> None:
        self.timing.setdefault(execution_id, {})["launched"] = self.clock.now()
        self.handle(ExecutionLaunched(self.clock.now(), execution_id))

    def closed(self, execution_id: str, group_id: str, reason: str, reward: float | None) -> None:
        self.close_counts[reason] = self.close_counts.get(reason, 0) + 1
        if reward is not None:  # reward_error: no reward to add
            self.rewards.append(reward)
        self.timing.setdefault(execution_id, {})["closed"] = self.clock.now()
        self.handle(ExecutionClosed(self.clock.now(), execution_id, CloseReason(reason), reward))
        task = self.parts.spawn(
            f"record of {execution_id}", self._record(execution_id, group_id, reason, reward)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._record_of[execution_id] = task
        task.add_done_callback(lambda _: self._record_of.pop(execution_id, None))

    def restore(self, record: ExecutionRecord) -> None:
        """An execution closed before a resume (its record came from the checkpoint): the
        ledger sees it dispatched, launched and closed again, the buffer gets its record."""
        eid, gid = record.execution_id, record.group_id
        self.dispatched(eid, gid)
        self.launched(eid, gid)
        self.handle(ExecutionClosed(self.clock.now(), eid, record.reason, record.reward))
        self.buffer.add(record)
        self.recorded += 1
        self.restored.add(eid)
        if self.file is not None:  # closed before the resume: its line, if the file lacks it
            out = Outcome(reason=record.reason, reward=record.reward)  # no transcript kept
            self.file.add(
                [
                    self._line(
                        eid,
                        gid,
                        out,
                        [schema.CallLine.of(c, tokens=self.tokens) for c in record.calls],
                        self.t0(),
                    )
                ]
            )

    async def lines_after(self, run: Any) -> list[Any]:
        """``await run`` (a group's executions in the harness pool), then their lines into
        ``executions.jsonl`` once their records are in (at most 60 s): a run killed later
        keeps them."""
        results = await run
        pending = [t for r in results if (t := self._record_of.get(r.execution_id))]
        if pending:
            await asyncio.wait(pending, timeout=60.0)
        if self.file is not None:
            self.file.add(self.lines(results, self.t0()))
        return results

    async def _record(self, eid: str, gid: str, reason: str, reward: float | None) -> None:
        try:
            resp = await idempotent(
                lambda: self.admin.get(f"/tidal/executions/{eid}/records"),
                f"execution {eid}: records",
            )
            resp.raise_for_status()
            rec = record_from_proxy(eid, gid, resp.json()["calls"], reward, reason)
            self.timing.setdefault(eid, {})["calls"] = [
                schema.CallLine.of(c, tokens=self.tokens) for c in rec.calls
            ]
            self._count(rec.calls)
            await asyncio.to_thread(self.buffer.add, rec)
            self.recorded += 1
        except Exception as exc:
            log.error("execution %s: record not delivered to training: %s", eid, why(exc))
            self.record_errors.append(f"{eid}: {exc}")

    def write_executions(
        self, path: Path, results: list[ExecutionOutcome], t0: float, mode: str = "w"
    ) -> None:
        """One line per closed execution (``tidal calibrate`` fits the simulator on them):
        times in seconds since ``t0`` (the first dispatch), the proxy's token counts per model
        call joined with the harness's timings of that call and of the tool step after it, and
        the transcript (actions and observations). With ``file`` set, only the executions it
        lacks are added to it (the rest were written as their groups ended)."""
        if self.file is not None:
            self.file.add(self.lines(results, t0))
            return
        with open(path, mode) as fh:
            for line in self.lines(results, t0):
                fh.write(json.dumps(line) + "\n")

    def lines(self, results: list[ExecutionOutcome], t0: float) -> list[dict[str, Any]]:
        return [
            self._line(
                r.execution_id,
                r.group_id,
                r.outcome,
                self.timing.get(r.execution_id, {}).get("calls", []),
                t0,
            )
            for r in results
        ]

    def _line(
        self, eid: str, gid: str, out: Outcome, call_lines: list[Any], t0: float
    ) -> dict[str, Any]:
        t = self.timing.get(eid, {})
        calls = [c.model_dump(exclude_none=True) for c in call_lines]
        for c, turn in zip(calls, out.transcript, strict=False):
            if turn.t_call is None:  # an agent kind that does not time its calls
                break
            c.update(
                {
                    "start_s": round(turn.t_call - t0, 4),
                    "call_s": round(turn.call_s or 0.0, 4),
                    "tool_s": round(turn.tool_s or 0.0, 4),
                }
            )
        return schema.check(
            schema.ExecutionLine,
            {
                "execution": eid,
                "group": gid,
                "burst": t.get("burst"),
                "reason": out.reason,
                "reward": out.reward,
                **{
                    f"{k}_s": round(t[k] - t0, 4)
                    for k in ("dispatched", "launched", "closed")
                    if k in t
                },
                "calls": calls,
                # what the agent did: its text actions and what the tools answered
                "transcript": [
                    {"action": turn.action, "observation": turn.observation}
                    for turn in out.transcript
                ],
            },
            "executions.jsonl (written)",
        )

    def _count(self, calls: list[CallRecord]) -> None:
        for call in calls:
            for seg in call.segments:
                served = self.tokens_by_engine_version.setdefault(seg.engine_id, {})
                for v in seg.versions:
                    served[v] = served.get(v, 0) + 1
            path = [seg.engine_id for seg in call.segments]
            for a, b in itertools.pairwise(path):
                if a != b:
                    key = f"{a}->{b}"
                    self.engine_handoffs[key] = self.engine_handoffs.get(key, 0) + 1

    @property
    def pending(self) -> int:
        """Records of closed executions still on their way to the trajectory buffer."""
        return len(self._tasks)

    @property
    def lost(self) -> int:
        return self.n_dispatched - self.recorded

    async def flush(self, timeout_s: float) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)
