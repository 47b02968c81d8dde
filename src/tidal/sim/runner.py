"""Runs policies on a scenario and summarises each run.

In: a scenario and policy specs (``NAME[:k=v,...]``). Out: one ``RunResult`` per spec with the
summary (the fields of ``summary.json``), the decision-log records and the finished world (for
plots). Speed-ups between runs and the ratio to the oracle are added by ``compare``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tidal.control.decision_log import Sink
from tidal.control.policy import policy_mechanics
from tidal.sim import slot_waits
from tidal.sim.oracle import OracleBound, oracle_bound
from tidal.sim.scenario import Scenario
from tidal.sim.world import World
from tidal.types import Role

VERL_MEANS = (
    "dynamic_resource/train_resource_utilization",
    "dynamic_resource/rollout_resource_utilization",
    "dynamic_resource/resource_utilization",
    "dynamic_resource/mq_size",
    "fully_async/trainer/idle_ratio",
    "fully_async/rollouter/idle_ratio",
)


@dataclass
class RunResult:
    spec: str
    summary: dict[str, Any]
    world: World
    records: list[dict[str, Any]] = field(default_factory=list)


def run_policy(
    scenario: Scenario,
    spec: str,
    *,
    check: bool = False,
    oracle: OracleBound | None = None,
    log_sink: Sink | None = None,
    keep_log: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> RunResult:
    t0 = time.perf_counter()
    world = World(scenario, spec, check=check, log_sink=log_sink, keep_log=keep_log)
    world.run(progress)
    wall = time.perf_counter() - t0
    oracle = oracle or oracle_bound(scenario)
    return RunResult(spec, summarize(world, oracle, wall), world, world.log.records)


def summarize(world: World, oracle: OracleBound, wall_s: float) -> dict[str, Any]:
    c = world.controller
    t_end = world.makespan_s
    cells = c.cells.cells
    in_train = c.timeline.time_in(Role.TRAINING, t_end)
    in_roll = c.timeline.time_in(Role.ROLLOUT, t_end)
    train_role_gpu_s = sum(cell.gpus * t for cell, t in zip(cells, in_train, strict=True))
    roll_role_gpu_s = sum(cell.gpus * t for cell, t in zip(cells, in_roll, strict=True))
    roll_role_gpu_s += sum(s.gpus for s in c.cells.standalone.values()) * t_end
    roll_busy_gpu_s = 0.0
    for e in world.engines:
        e.advance(t_end)
        roll_busy_gpu_s += e.busy_work / e.throughput * e.gpus
    train_busy = world.trainer.busy_gpu_s
    total_gpus = c.cells.total_gpus
    ctl = c.summary()
    rows = c.metrics.rows
    verl = {}
    for key in VERL_MEANS:  # means over the rows that have them (verl's first may not)
        vals = [r[key] for r in rows if key in r]
        if vals:
            verl[key] = round(sum(vals) / len(vals), 4)
    return {
        "scenario": world.scenario.name,
        "policy": world.spec,
        "policy_name": c.policy.name,
        "profile": world.profile.model_dump(mode="json"),  # the mechanics it ran with
        "policy_mechanics": policy_mechanics(world.cfg.policy.name).model_dump(mode="json"),
        "makespan_s": round(t_end, 3),
        "makespan_h": round(t_end / 3600, 4),
        "oracle_makespan_s": round(oracle.makespan_s, 3),
        "oracle_ratio": round(t_end / oracle.makespan_s, 4) if oracle.makespan_s else None,
        "oracle": oracle.to_json(),
        "train_utilization": _ratio(train_busy, train_role_gpu_s),
        "rollout_utilization": _ratio(roll_busy_gpu_s, roll_role_gpu_s),
        "cluster_utilization": _ratio(train_busy + roll_busy_gpu_s, total_gpus * t_end),
        "switches": ctl["switches"],
        "switches_to_training": ctl["switches_to_training"],
        "switches_to_rollout": ctl["switches_to_rollout"],
        "plans_aborted": ctl["plans_aborted"],
        "step_failures": world.actuator.failures,
        "reroutes": world.reroutes,
        "request_retries": ctl["request_retries"],
        "reprefill_tokens": world.reprefill_tokens,
        "wasted_tokens": world.wasted_tokens,
        "mean_staleness": round(world.trainer.mean_staleness, 4),
        "trainer_steps": world.trainer.step,
        "version": ctl["version"],
        "dispatched": ctl["dispatched"],
        "finished": ctl["finished"],
        "timeouts": world.timeouts,
        **slot_waits.summary(world, t_end),  # executions that waited for a slot, measured
        "train_role_gpu_h": round(train_role_gpu_s / 3600, 3),
        "rollout_role_gpu_h": round(roll_role_gpu_s / 3600, 3),
        "verl_metrics": verl,
        "events": world.events,
        "controller_events": c.events_handled,
        "wall_s": round(wall_s, 3),
    }


def _ratio(a: float, b: float) -> float:
    return round(a / b, 4) if b > 0 else 0.0


def compare(
    scenario: Scenario,
    specs: list[str],
    *,
    check: bool = False,
    on_done: Callable[[RunResult], None] | None = None,
    log_sink_for: Callable[[str], Sink | None] | None = None,
    progress_for: Callable[[str], Callable[[int, int], None] | None] | None = None,
    keep_log: bool = True,
) -> list[RunResult]:
    """Runs every spec; adds ``speedup_vs`` (other makespan / this makespan) to each summary."""
    oracle = oracle_bound(scenario)
    results = []
    for spec in specs:
        sink = log_sink_for(spec) if log_sink_for else None
        res = run_policy(
            scenario,
            spec,
            check=check,
            oracle=oracle,
            log_sink=sink,
            keep_log=keep_log,
            progress=progress_for(spec) if progress_for else None,
        )
        results.append(res)
        if on_done:
            on_done(res)
    for r in results:
        r.summary["speedup_vs"] = {
            o.spec: round(o.summary["makespan_s"] / r.summary["makespan_s"], 4)
            for o in results
            if o is not r and r.summary["makespan_s"] > 0
        }
    return results
