"""A run or a simulation as a Chrome trace-event file (``trace.json``) that opens in Perfetto
(ui.perfetto.dev) or ``chrome://tracing``.

In: one ``TraceRun`` per run (a ``tidal run`` directory or one policy of ``tidal simulate``,
built by ``tidal.viz.trace_sources``), every time in seconds since the run's first dispatch.
Out: the JSON object format ``{"traceEvents": [...], "displayTimeUnit": "ms"}``: each run is a
process; each cell is a track (thread) with its role spans (rollout / moving / training), and
``moves`` (each plan with its steps nested inside), ``trainer`` (optimizer steps), ``weights``
(publications) and one track per standalone engine. A reroute (a request that left one engine
for another) is a flow arrow between the two engines' tracks; the ``executions`` counter track
draws the waterlevel, running and queued executions and the rollout capacity over time.
Invariant: on every track the events are in time order and complete spans nest (a child never
outlasts its parent, siblings never overlap), so ``tidal.viz.trace_format.validate`` accepts it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

US = 1e6  # trace-event timestamps are microseconds
MOVES, TRAINER, WEIGHTS, ENGINE0 = 1000, 1001, 1002, 2000


@dataclass
class Plan:
    """One move: ``[start_s, end_s]``, its cells and direction, its steps as
    ``(name, duration_s, ok)`` in order (durations may be unknown: ``None``)."""

    plan_id: int
    start_s: float
    end_s: float
    direction: str
    cells: list[int]
    reason: str
    outcome: str  # done | aborted | unfinished
    steps: list[tuple[str, float | None, bool]] = field(default_factory=list)


@dataclass
class TraceRun:
    name: str
    cells: list[str]
    segments: list[list[tuple[float, float, str]]]  # per cell: (start_s, end_s, role)
    end_s: float
    plans: list[Plan] = field(default_factory=list)
    trainer_steps: list[tuple[float, float, dict[str, Any]]] = field(default_factory=list)
    publications: list[tuple[float, float, int]] = field(default_factory=list)  # start, end, v
    standalone: list[str] = field(default_factory=list)
    engine_track: dict[str, int] = field(default_factory=dict)  # engine name -> cell index
    reroutes: list[tuple[float, str, str, str]] = field(default_factory=list)  # t, from, to, ex
    counters: list[tuple[float, dict[str, float]]] = field(default_factory=list)  # executions


def build(runs: list[TraceRun]) -> dict[str, Any]:
    """The trace-event JSON object of ``runs`` (one process each)."""
    events: list[dict[str, Any]] = []
    flow_id = 0
    for pid, run in enumerate(runs, start=1):
        events += _meta(pid, run)
        events += _role_spans(pid, run)
        events += _plans(pid, run.plans)
        events += _simple_spans(pid, TRAINER, "trainer", run.trainer_steps)
        events += _simple_spans(
            pid,
            WEIGHTS,
            "weights",
            [(a, b, {"version": v}) for a, b, v in run.publications],
            name_key="version",
            prefix="publish v",
        )
        for i, eng in enumerate(run.standalone):
            events.append(_span(pid, ENGINE0 + i, f"{eng} serving", "engine", 0.0, run.end_s, {}))
        for t, src, dst, ex in run.reroutes:
            a, b = _engine_tid(run, src), _engine_tid(run, dst)
            if a is None or b is None:
                continue
            flow_id += 1
            common = {
                "name": "reroute",
                "cat": "reroute",
                "id": flow_id,
                "pid": pid,
                "ts": _us(min(max(t, 0.0), run.end_s)),
                "args": {"execution": ex},
            }
            events.append({**common, "ph": "s", "tid": a})
            events.append({**common, "ph": "f", "bp": "e", "tid": b})
        events += [
            {
                "ph": "C",
                "name": "executions",
                "cat": "state",
                "pid": pid,
                "tid": 0,
                "ts": _us(max(0.0, t)),
                "args": vals,
            }
            for t, vals in run.counters
        ]
    order = {"M": 0, "X": 1, "s": 2, "f": 2, "C": 3}
    # stable: a parent span was added before its children, steps in their order
    events.sort(key=lambda e: (e["pid"], e.get("tid", 0), e.get("ts", -1), order[e["ph"]]))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write(runs: list[TraceRun], path: Path) -> Path:
    path.write_text(json.dumps(build(runs), separators=(",", ":")))
    return path


def _us(t_s: float) -> float:
    return round(t_s * US, 3)


def _span(
    pid: int, tid: int, name: str, cat: str, a: float, b: float, args: dict[str, Any]
) -> dict[str, Any]:
    return {
        "ph": "X",
        "name": name,
        "cat": cat,
        "pid": pid,
        "tid": tid,
        "ts": _us(a),
        "dur": max(0.0, round(_us(b) - _us(a), 3)),
        "args": args,
    }


def _meta(pid: int, run: TraceRun) -> list[dict[str, Any]]:
    tracks = [(i, f"cell {i} {name}") for i, name in enumerate(run.cells)]
    tracks += [(MOVES, "moves"), (TRAINER, "trainer"), (WEIGHTS, "weights")]
    tracks += [(ENGINE0 + i, f"standalone {e}") for i, e in enumerate(run.standalone)]
    out = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": run.name}}]
    for k, (tid, name) in enumerate(tracks):
        out.append(
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}
        )
        out.append(
            {
                "ph": "M",
                "name": "thread_sort_index",
                "pid": pid,
                "tid": tid,
                "args": {"sort_index": k},
            }
        )
    return out


def _role_spans(pid: int, run: TraceRun) -> list[dict[str, Any]]:
    out = []
    for tid, segs in enumerate(run.segments):
        prev = 0.0
        for a, b, role in segs:
            a = max(a, prev)  # a track's spans never overlap
            if b > a:
                out.append(_span(pid, tid, role, "role", a, b, {}))
                prev = b
    return out


def _plans(pid: int, plans: list[Plan]) -> list[dict[str, Any]]:
    """Each plan a span on the moves track, its steps laid end to end inside it."""
    out, prev = [], 0.0
    for p in sorted(plans, key=lambda p: p.start_s):
        a = max(p.start_s, prev)
        b = max(a, p.end_s)
        prev = b
        out.append(
            _span(
                pid,
                MOVES,
                f"plan {p.plan_id} {p.direction} {p.cells}",
                "move",
                a,
                b,
                {"reason": p.reason, "outcome": p.outcome, "cells": p.cells},
            )
        )
        t = a
        for name, dur, ok in p.steps:
            if dur is None or t >= b:
                break
            end = min(b, t + dur)
            out.append(_span(pid, MOVES, name, "step", t, end, {"ok": ok, "duration_s": dur}))
            t = end
    return out


def _simple_spans(
    pid: int,
    tid: int,
    cat: str,
    spans: list[tuple[float, float, dict]],
    name_key: str = "step",
    prefix: str = "step ",
) -> list[dict[str, Any]]:
    out, prev = [], 0.0
    for a, b, args in sorted(spans, key=lambda s: s[0]):
        a = max(a, prev)
        b = max(a, b)
        prev = b
        out.append(_span(pid, tid, f"{prefix}{args.get(name_key, '')}", cat, a, b, args))
    return out


def _engine_tid(run: TraceRun, engine: str) -> int | None:
    if engine in run.engine_track:
        return run.engine_track[engine]
    if engine in run.standalone:
        return ENGINE0 + run.standalone.index(engine)
    return None
