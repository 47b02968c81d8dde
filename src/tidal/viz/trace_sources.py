"""Where a trace's facts come from: a ``tidal run`` directory, or one simulated policy.

In: a run directory (``timeline.json``, ``decisions.jsonl``, ``steps.jsonl``,
``metrics.jsonl``, ``executions.jsonl``; read with ``tidal.rundir``), or a
``tidal.sim.runner.RunResult`` with the decision records of its run and the reroutes that
``recording_reroutes`` saw. Out: a ``tidal.viz.trace.TraceRun``, every time in seconds since the
first dispatch. Runs written before ``decisions.jsonl`` counted from the first dispatch (no
``t0_utc`` in the summary) are shifted by their first ``BurstStarted`` decision.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidal.contracts import run_files as schema
from tidal.rundir import UTIL_KEYS, RunData, load_run, read_jsonl, read_lines
from tidal.viz.run_figures import capacity_at, rollout_capacity
from tidal.viz.trace import Plan, TraceRun

if TYPE_CHECKING:
    from tidal.sim.dispatch import ExecRec
    from tidal.sim.runner import RunResult
    from tidal.sim.world import World


def from_run_dir(path: str | Path) -> TraceRun:
    """The trace of a finished run directory."""
    run = load_run(path)
    root = Path(path)
    decisions = read_jsonl(root / "decisions.jsonl", model=schema.DecisionLine) or []
    t0 = decisions_origin(run, decisions)
    decisions = [{**d, "t": float(d["t"]) - t0} for d in decisions]
    end = max(
        [float(run.summary.get("run_time_s") or 0.0)]
        + [b for segs in run.timeline or [] for _, b, _ in segs]
        + [float(d["t"]) for d in decisions]
    )
    steps = read_jsonl(root / "steps.jsonl", model=schema.StepLine) or []
    engines = list((run.summary.get("engines") or {}).keys())
    tr = TraceRun(
        name=f"{root.name} ({run.policy})",
        cells=run.cell_names(),
        segments=[list(s) for s in run.timeline or []],
        end_s=end,
        plans=plans_of(decisions, steps, end),
        trainer_steps=[
            (
                float(m["t"]) - float(m.get("step_s", 0.0)),
                float(m["t"]),
                {
                    "step": m["step"],
                    "burst": m["burst"],
                    "version": m.get("version"),
                    "mean_reward": m["mean_reward"],
                },
            )
            for m in run.metrics or []
        ],
        publications=publications_of(decisions, run),
        standalone=[e for e in engines if e.startswith("s")],
        engine_track={f"c{i}": i for i in range(len(run.cell_names()))},
    )
    tr.reroutes = run_reroutes(
        read_lines(root / "executions.jsonl", schema.ExecutionLine) or [], tr.plans
    )
    cap = rollout_capacity(run)
    tr.counters = [
        (
            float(s["t"]),
            {
                "waterlevel": s["waterlevel"],
                "running": s["running"],
                "queued": s["queued"],
                **({"capacity": capacity_at(cap, float(s["t"]))} if cap else {}),
            },
        )
        for s in run.states or []
    ]
    return tr


def decisions_origin(run: RunData, decisions: list[dict[str, Any]]) -> float:
    """What to subtract from ``decisions.jsonl``'s ``t``: 0 when the run stamps seconds since
    the first dispatch (its summary names ``t0_utc``), else the first ``BurstStarted``."""
    if "t0_utc" in run.summary:
        return 0.0
    return next((float(d["t"]) for d in decisions if d.get("trigger") == "BurstStarted"), 0.0)


def plans_of(
    decisions: list[dict[str, Any]], steps: list[dict[str, Any]], end_s: float
) -> list[Plan]:
    """Plans from their ``plan_start`` / ``plan_done`` / ``plan_aborted`` records; step durations
    from ``step_done`` records, else from ``steps.jsonl``."""
    plans: dict[int, Plan] = {}
    logged: dict[int, list[tuple[str, float | None, bool]]] = {}
    for d in decisions:
        kind, pid = d.get("type"), d.get("plan_id")
        if kind == "plan_start":
            plans[int(pid)] = Plan(
                int(pid),
                d["t"],
                end_s,
                str(d.get("direction")),
                list(d.get("cells", [])),
                str(d.get("reason", "")),
                "unfinished",
            )
        elif kind in ("plan_done", "plan_aborted") and int(pid) in plans:
            plans[int(pid)].end_s = d["t"]
            plans[int(pid)].outcome = "done" if kind == "plan_done" else "aborted"
        elif kind == "step_done":
            logged.setdefault(int(pid), []).append((str(d["step"]), float(d["duration_s"]), True))
    from_file: dict[int, list[tuple[str, float | None, bool]]] = {}
    for s in steps:
        from_file.setdefault(int(s["plan_id"]), []).append(
            (str(s["step"]), float(s["duration_s"]), bool(s["ok"]))
        )
    for pid, p in plans.items():
        p.steps = logged.get(pid) or from_file.get(pid, [])
    return list(plans.values())


def publications_of(
    decisions: list[dict[str, Any]], run: RunData
) -> list[tuple[float, float, int]]:
    """``weights_published`` records as (start, end, version); runs without them: an instant at
    each burst's final optimizer step (the line carrying verl's metrics)."""
    pubs = [
        (d["t"] - float(d.get("duration_s", 0.0)), d["t"], int(d["version"]))
        for d in decisions
        if d.get("type") == "weights_published"
    ]
    if pubs or not run.metrics:
        return pubs
    return [
        (float(m["t"]), float(m["t"]), int(m["version"]))
        for m in run.metrics
        if UTIL_KEYS["train"] in m
    ]


def run_reroutes(
    executions: list[schema.ExecutionLine], plans: list[Plan]
) -> list[tuple[float, str, str, str]]:
    """(t, from, to, execution) for every engine change of an execution: within a call (its
    in-flight request retried elsewhere; placed at the start of the move of the engine's cell
    during the call, else mid-call) and between calls (at the later call's start)."""
    out = []
    for ex in executions:
        prev: str | None = None
        for call in ex.calls:
            start = call.start_s
            engines = call.engines
            if prev is not None and engines and engines[0] != prev and start is not None:
                out.append((start, prev, engines[0], ex.execution))
            for a, b in itertools.pairwise(engines):
                if start is None:
                    continue
                out.append((_reroute_time(a, start, call.call_s or 0.0, plans), a, b, ex.execution))
            prev = engines[-1] if engines else prev
    return out


def _reroute_time(engine: str, start: float, dur: float, plans: list[Plan]) -> float:
    cell = int(engine[1:]) if engine.startswith("c") and engine[1:].isdigit() else None
    for p in plans:
        if cell in p.cells and p.direction == "to_training" and start <= p.start_s <= start + dur:
            return p.start_s
    return start + dur / 2


def from_sim(
    result: RunResult, records: list[dict[str, Any]], reroutes: list[tuple[float, str, str, str]]
) -> TraceRun:
    """The trace of one simulated policy (``RunResult``) and its decision records."""
    w = result.world
    ctl = w.controller
    end = float(w.makespan_s)
    sync_s = float(w.scenario.costs.sync_s)
    per_burst = int(w.scenario.control.updates_per_burst)
    trainer = [
        (
            float(s["t"]) - float(s["compute_s"]),
            float(s["t"]),
            {"step": s["step"], "wait_s": round(float(s["wait_s"]), 3), "gpus": s["gpus"]},
        )
        for s in w.trainer.steps_log
    ]
    pubs = [
        (d["t"] - float(d.get("duration_s", 0.0)), d["t"], int(d["version"]))
        for d in records
        if d.get("type") == "weights_published"
    ]
    if not pubs:  # the sync starts at each burst's final step and lasts costs.sync_s
        pubs = [
            (b, min(end, b + sync_s), (s["step"] + 1) // per_burst)
            for (_, b, s) in trainer
            if (s["step"] + 1) % per_burst == 0 and b < end
        ]
    segs = [[(a, b, r.value) for a, b, r in cell] for cell in ctl.timeline.close(end)]
    se = w.series
    counters = [
        (t, {"waterlevel": wl, "running": run, "queued": q, "capacity": cap})
        for t, wl, run, q, cap in zip(
            se.t, se.waterlevel, se.running, se.queued, se.capacity, strict=False
        )
    ]
    return TraceRun(
        counters=counters,
        name=f"simulate {result.spec}",
        cells=[c.name for c in ctl.cells.cells],
        segments=segs,
        end_s=end,
        plans=plans_of(records, [], end),
        trainer_steps=trainer,
        publications=pubs,
        standalone=[str(k) for k in ctl.cells.standalone],
        engine_track={str(c.name): c.index for c in ctl.cells.cells},
        reroutes=reroutes,
    )


@contextlib.contextmanager
def recording_reroutes() -> Iterator[dict[str, list[tuple[float, str, str, str]]]]:
    """While open, every execution a simulated world moves from one engine to another is
    recorded per policy spec as (t, from, to, execution) (the simulator keeps only a count)."""
    from tidal.sim.world import observing_moves

    seen: dict[str, list[tuple[float, str, str, str]]] = {}

    def moved(world: World, ex: ExecRec, src: str, dest: str) -> None:
        seen.setdefault(world.spec, []).append((world.now, src, dest, ex.eid))

    with observing_moves(moved):
        yield seen
