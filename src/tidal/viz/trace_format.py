"""A checker for the Chrome trace-event format (the "Trace Event Format" document that
``chrome://tracing`` and Perfetto read), for the events ``tidal.viz.trace`` writes.

In: a trace as parsed JSON (the object form ``{"traceEvents": [...]}`` or the bare array form).
Out: the list of problems (empty when the trace is valid), each naming the event's index.
Checked: every event is an object with a known phase (``ph``); the fields each phase requires
(``name``/``pid``/``tid``/``ts`` for all timed events, ``dur >= 0`` for complete events ``X``,
matching ``B``/``E`` pairs, ``id`` and ``cat`` for flow and async events, ``args.name`` for the
``process_name``/``thread_name`` metadata and ``args.sort_index`` for the sort-index metadata);
numbers are finite and non-negative; ``displayTimeUnit`` is ``ms`` or ``ns``; per track
(pid, tid) the timestamps never go back and complete events nest (a child ends by its parent's
end); every flow has one start (``s``), at most one step (``t``) at a time, and one finish
(``f``) no earlier than its start, each inside a complete event on its track (so the arrow binds).
"""

from __future__ import annotations

import math
from typing import Any

PHASES = set("BEXiIbneSTpFsftCMPOND(),")  # every phase the format defines
_TIMED = set("BEXiIbnesftCSTpFPOND")
_NEEDS_ID = set("bnesftSTpFND")
_META_ARG = {
    "process_name": "name",
    "thread_name": "name",
    "process_labels": "labels",
    "process_sort_index": "sort_index",
    "thread_sort_index": "sort_index",
}


def validate(trace: object) -> list[str]:
    """Every way ``trace`` breaks the format (empty: valid)."""
    if isinstance(trace, dict):
        events = trace.get("traceEvents")
        if not isinstance(events, list):
            return ["traceEvents: missing or not a list"]
        unit = trace.get("displayTimeUnit", "ms")
        if unit not in ("ms", "ns"):
            return [f"displayTimeUnit: {unit!r} is not ms or ns"]
    elif isinstance(trace, list):
        events = trace
    else:
        return ["a trace is a JSON object or array"]
    problems: list[str] = []
    for i, ev in enumerate(events):
        problems += [f"event {i}: {p}" for p in _check_event(ev)]
    if not problems:
        problems += _check_tracks(events) + _check_flows(events)
    return problems


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _check_event(ev: object) -> list[str]:
    if not isinstance(ev, dict):
        return ["not an object"]
    ph = ev.get("ph")
    if ph not in PHASES:
        return [f"ph {ph!r} is not a trace-event phase"]
    out = _check_identity(ev, ph) + _check_timing(ev, ph) + _check_phase(ev, ph)
    if "args" in ev and not isinstance(ev["args"], dict):
        out.append("args: not an object")
    return out


def _check_identity(ev: dict[str, Any], ph: str) -> list[str]:
    """The event's name, process and thread."""
    out = []
    if not isinstance(ev.get("name"), str) and ph not in "E":
        out.append("name: missing or not a string")
    for key in ("pid", "tid"):
        if key in ev and not isinstance(ev[key], int | str):
            out.append(f"{key}: not an integer or string")
    if "pid" not in ev and ph != "M":
        out.append("pid: missing")
    if ph in _TIMED and "tid" not in ev and ph not in "C":
        out.append("tid: missing")
    return out


def _check_timing(ev: dict[str, Any], ph: str) -> list[str]:
    """Timestamps and durations."""
    out = []
    if ph in _TIMED and (not _number(ev.get("ts")) or ev["ts"] < 0):
        out.append("ts: missing or not a non-negative number")
    if ph == "X" and (not _number(ev.get("dur")) or ev["dur"] < 0):
        out.append("dur: a complete event needs a non-negative duration")
    return out


def _check_phase(ev: dict[str, Any], ph: str) -> list[str]:
    """What the phase itself needs: ids and categories (flows, async), binding, scope, the
    argument a metadata event carries."""
    out = []
    if ph in _NEEDS_ID:
        if "id" not in ev and "id2" not in ev:
            out.append(f"id: phase {ph} needs an id")
        if not isinstance(ev.get("cat"), str):
            out.append(f"cat: phase {ph} needs a category")
    if ph == "f" and ev.get("bp", "e") not in ("e",):
        out.append("bp: a flow end binds with 'e' only")
    if ph in "iI" and ev.get("s", "t") not in ("g", "p", "t"):
        out.append("s: an instant's scope is g, p or t")
    if ph == "M":
        need = _META_ARG.get(ev.get("name"))
        if need is None:
            out.append(f"name: {ev.get('name')!r} is not a metadata event")
        elif need not in (ev.get("args") or {}):
            out.append(f"args.{need}: missing")
    return out


def _tracks(events: list[dict[str, Any]]) -> dict[tuple[Any, Any], list[dict[str, Any]]]:
    tracks: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for ev in events:
        if ev["ph"] in "BEXiIsft":
            tracks.setdefault((ev["pid"], ev["tid"]), []).append(ev)
    return tracks


def _check_tracks(events: list[dict[str, Any]]) -> list[str]:
    """Per (pid, tid): timestamps in file order never go back; B/E pair up; X events nest."""
    out = []
    for (pid, tid), evs in _tracks(events).items():
        where = f"track pid={pid} tid={tid}"
        last, opened = -1.0, 0
        stack: list[float] = []  # end times of the open complete events
        for ev in evs:
            ts = float(ev["ts"])
            if ts < last:
                out.append(f"{where}: ts {ts} after {last} (not monotonic)")
            last = ts
            while stack and stack[-1] <= ts + 1e-3:  # ts are µs with 3 decimals
                stack.pop()
            if ev["ph"] == "B":
                opened += 1
            elif ev["ph"] == "E":
                opened -= 1
                if opened < 0:
                    out.append(f"{where}: E at {ts} without a B")
                    opened = 0
            elif ev["ph"] == "X":
                end = ts + float(ev["dur"])
                if stack and end > stack[-1] + 1e-3:
                    out.append(
                        f"{where}: span {ev['name']!r} at {ts} ends at {end}, after "
                        f"its enclosing span's end {stack[-1]} (spans must nest)"
                    )
                stack.append(end)
        if opened:
            out.append(f"{where}: {opened} B event(s) never ended")
    return out


def _covered(evs: list[dict[str, Any]], ts: float) -> bool:
    return any(e["ph"] == "X" and e["ts"] <= ts <= e["ts"] + e["dur"] + 1e-3 for e in evs)


def _check_flows(events: list[dict[str, Any]]) -> list[str]:
    """Each flow id: one ``s``, one ``f`` not before it, each inside a span on its track."""
    tracks = _tracks(events)
    flows: dict[Any, dict[str, list[dict[str, Any]]]] = {}
    for ev in events:
        if ev["ph"] in "sft":
            parts = flows.setdefault((ev["cat"], ev["id"]), {"s": [], "t": [], "f": []})
            parts[ev["ph"]].append(ev)
    out = []
    for (cat, fid), parts in flows.items():
        where = f"flow {cat}:{fid}"
        if len(parts["s"]) != 1 or len(parts["f"]) != 1:
            out.append(
                f"{where}: {len(parts['s'])} start(s) and {len(parts['f'])} finish(es); "
                "a flow has one of each"
            )
            continue
        s, f = parts["s"][0], parts["f"][0]
        if f["ts"] < s["ts"]:
            out.append(f"{where}: finishes at {f['ts']} before it starts at {s['ts']}")
        for ev in (s, f, *parts["t"]):
            if not _covered(tracks[(ev["pid"], ev["tid"])], float(ev["ts"])):
                out.append(
                    f"{where}: {ev['ph']} at {ev['ts']} on pid={ev['pid']} "
                    f"tid={ev['tid']} lies in no slice (the arrow cannot bind)"
                )
    return out
