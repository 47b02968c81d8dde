"""The files a run writes while it runs, and its summary.

In: trainer steps (``step``), live-state samples (``sample_state``, every
``runtime.state_every_s``), the controller's timeline and the actuator's step log at the end,
and the figures of every part for ``summary``. Out, in the run directory: ``metrics.jsonl`` (one
line per optimizer step; the first step after a weight version closed also carries verl's
metrics of that version), ``state.jsonl``, ``timeline.json`` (per cell,
``[start_s, end_s, role]`` segments since the first dispatch), ``steps.jsonl`` and
``summary.json``. Times (here and in ``decisions.jsonl``, through ``since_first_dispatch``) are
seconds since the first dispatch over every incarnation of a resumed run (``elapsed``); the
summary's ``t0_utc`` names that instant as UTC, once. Invariant: a resumed run's
``metrics.jsonl`` holds exactly the lines of the steps its checkpoint covers, then the new ones
(no step twice).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidal.clock import Clock
from tidal.contracts import run_files as schema
from tidal.contracts.close import CloseReason
from tidal.contracts.executions import ExecutionOutcome
from tidal.control.queued_waits import KEYS as QUEUED_KEYS
from tidal.runtime.executions_file import ExecutionsFile
from tidal.types import Role

if TYPE_CHECKING:
    from tidal.control.controller import Controller
    from tidal.runtime.actuator import RayActuator
    from tidal.runtime.bridge import LedgerBridge
    from tidal.training.core import StepReport


class RunOutputs:
    def __init__(
        self,
        out: Path,
        clock: Clock,
        resumed_elapsed_s: float,
        append: bool,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        on_state: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.out, self.clock = out, clock
        self.mode = "a" if append else "w"  # a resumed run continues its logs
        self.on_step, self.on_state = on_step, on_state
        self.metrics: list[dict[str, Any]] = []
        self.executions = ExecutionsFile(out / "executions.jsonl", append)
        self.t_offset = resumed_elapsed_s
        self.t_first = clock.now()
        self._held: list[tuple[Callable[[dict[str, Any]], None], dict[str, Any]]] | None = []

    def start_clock(self) -> None:
        """The first dispatch of this incarnation: time zero of its lines (records stamped
        before it are written now, counted from it: negative times)."""
        self.t_first = self.clock.now()
        held, self._held = self._held or [], None
        for sink, rec in held:
            self._relative(sink, rec)

    def elapsed(self) -> float:
        """Run time since the first dispatch, over every incarnation of a resumed run."""
        return self.t_offset + self.clock.now() - self.t_first

    @property
    def t0(self) -> float:
        """The first dispatch of the first incarnation, on this incarnation's clock."""
        return self.t_first - self.t_offset

    def restore_metrics(self, n_lines: int) -> None:
        """Keep the first ``n_lines`` of ``metrics.jsonl`` (the steps the checkpoint covers)."""
        path = self.out / "metrics.jsonl"
        lines = path.read_text().splitlines()[:n_lines]
        path.write_text("".join(x + "\n" for x in lines))
        self.metrics = [json.loads(x) for x in lines]

    def step(self, line: dict[str, Any]) -> None:
        schema.check(schema.MetricsLine, line, "metrics.jsonl (written)")
        self.metrics.append(line)
        with open(self.out / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps(line) + "\n")
        if self.on_step is not None:
            self.on_step(line)

    async def sample_state(
        self,
        tick: Callable[[], None],
        state: Callable[[], dict[str, Any]],
        tick_s: float,
        every_s: float,
    ) -> None:
        """Forever: ``tick()`` every ``tick_s``, a ``state()`` line every ``every_s``."""
        n, every = 0, max(1, round(every_s / tick_s))
        with open(self.out / "state.jsonl", "a") as fh:
            while True:
                await self.clock.asleep(tick_s)
                tick()
                n += 1
                if n % every:
                    continue
                st = state()
                line = schema.check(
                    schema.StateLine, {"t": round(self.elapsed(), 3), **st}, "state.jsonl (written)"
                )
                fh.write(json.dumps(line) + "\n")
                fh.flush()
                if self.on_state is not None:
                    self.on_state(st)

    def write_timeline(self, segments: list[list[tuple[float, float, Role]]]) -> None:
        t0 = self.t0
        cells = [
            [[round(max(0.0, a - t0), 3), round(b - t0, 3), r.value] for a, b, r in cell]
            for cell in segments
        ]
        data = schema.check(schema.Timeline, {"cells": cells}, "timeline.json (written)")
        (self.out / "timeline.json").write_text(json.dumps(data))

    def write_steps(self, step_log: list[dict[str, Any]]) -> None:
        with open(self.out / "steps.jsonl", self.mode) as fh:
            fh.writelines(
                json.dumps(schema.check(schema.StepLine, s, "steps.jsonl (written)")) + "\n"
                for s in step_log
            )

    def since_first_dispatch(
        self, sink: Callable[[dict[str, Any]], None]
    ) -> Callable[[dict[str, Any]], None]:
        """``sink`` for records stamped on this incarnation's clock (the controller's
        ``decisions.jsonl``): their ``t`` becomes seconds since the run's first dispatch."""

        def relative(rec: dict[str, Any]) -> None:
            if self._held is not None:  # time zero is not known yet
                self._held.append((sink, rec))
            else:
                self._relative(sink, rec)

        return relative

    def _relative(self, sink: Callable[[dict[str, Any]], None], rec: dict[str, Any]) -> None:
        sink({**rec, "t": round(float(rec["t"]) - self.t0, 6)} if "t" in rec else rec)

    def t0_utc(self) -> str:
        """The run's first dispatch as ISO UTC: the one absolute time of the run directory
        (the summary's ``t0_utc``); every file counts seconds from this instant."""
        t0 = datetime.now(UTC) - timedelta(seconds=self.elapsed())
        return t0.isoformat(timespec="milliseconds")

    def write_summary(self, summary: dict[str, Any]) -> None:
        schema.check(schema.Summary, summary, "summary.json (written)")
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))


def step_line(
    ctl: Controller,
    burst: int,
    step: int,
    version: int,
    report: StepReport,
    dt: float,
    wait_s: float,
    elapsed_s: float,
) -> dict[str, Any]:
    """One ``metrics.jsonl`` line: the trainer's report and the controller's view at its end."""
    roles = ctl.cells.roles()
    line = {
        "t": round(elapsed_s, 3),
        "burst": burst,
        "step": step,
        "version": version,
        "mean_reward": report.mean_reward,
        "loss": report.loss,
        "grad_norm": report.grad_norm,
        "n_groups": report.n_groups,
        "n_executions": report.n_executions,
        "n_tokens": report.n_tokens,
        "max_staleness": report.max_staleness,
        "step_s": round(dt, 3),
        "compute_s": round(report.compute_s, 3),
        "update_s": round(report.update_s, 3),
        "core_compute_s": round(report.core_compute_s, 3),
        "core_tokens": report.core_tokens,
        "wait_s": round(wait_s, 3),
        "waterlevel": ctl.ledger.waterlevel,
        "ready_groups": ctl.ledger.ready_unassigned,
        "roles": [r.value for r in roles],
        "training_cells": sum(r is Role.TRAINING for r in roles),
        "satellites": list(report.members),
        "groups": list(report.group_ids),
        "micro_steps_by_cell": {str(k): v for k, v in sorted(report.micro_steps_by_cell.items())},
    }
    if report.device_peak_mb:  # GPU trainers only
        line["device_peak_mb"] = {str(k): v for k, v in sorted(report.device_peak_mb.items())}
    return line


def device_peaks(metrics: list[dict[str, Any]], engines: list[dict]) -> dict[str, float]:
    """``summary.json``'s ``device_peak_mb``: each trainer's GPU peak over the run (the last
    step it trained in reports its largest: the allocator's peak only grows) and each engine's
    from its end-of-run describe; empty on the CPU."""
    out: dict[str, float] = {}
    for m in metrics:
        for cell, mb in (m.get("device_peak_mb") or {}).items():
            out[f"trainer-c{cell}"] = max(mb, out.get(f"trainer-c{cell}", 0.0))
    for e in engines:
        if e.get("device_peak_mb") is not None:
            out[f"engine-{e['name']}"] = e["device_peak_mb"]
    return dict(sorted(out.items()))


def sum_by_cell(metrics: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in metrics:
        for cell, n in m["micro_steps_by_cell"].items():
            out[cell] = out.get(cell, 0) + n
    return dict(sorted(out.items()))


def mean_reward(results: list[ExecutionOutcome]) -> float | None:
    """The mean reward of the scored executions (``reward_error`` ones have none); None when
    none was scored. Each term divided first: no overflow for any finite rewards."""
    scored = [r.outcome.reward for r in results if r.outcome.reward is not None]
    return sum(x / len(scored) for x in scored) if scored else None


def close_reasons(results: list[ExecutionOutcome]) -> dict[str, int]:
    reasons: dict[str, int] = {}
    for r in results:
        reasons[r.outcome.reason] = reasons.get(r.outcome.reason, 0) + 1
    return reasons


def merge_counts(*counts: dict[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for k, n in c.items():
            out[k] = out.get(k, 0) + n
    return dict(sorted(out.items()))


def switch_times(plans_done: list[tuple[Any, float]]) -> dict[str, dict[str, float]]:
    """Per direction (``to_training`` / ``to_rollout``): how many plans finished and their
    duration in seconds (p50 = the lower median, max)."""
    out: dict[str, dict[str, float]] = {}
    for direction in ("to_training", "to_rollout"):
        ds = sorted(d for p, d in plans_done if p.direction.value == direction)
        if ds:
            out[direction] = {
                "n": len(ds),
                "p50_s": round(ds[(len(ds) - 1) // 2], 3),
                "max_s": round(ds[-1], 3),
            }
    return out


def switch_steps(
    plans_done: list[tuple[Any, float]], step_log: list[dict]
) -> dict[str, dict[str, dict[str, float]]]:
    """Per direction, each plan step's cost (the actuator's measured duration of every run of
    that step kind in a finished plan): n, p50 (the lower median) and max, in seconds, in plan
    order, so a slow switch names its slow step."""
    direction = {p.plan_id: p.direction.value for p, _ in plans_done}
    by: dict[str, dict[str, list[float]]] = {}
    for rec in step_log:
        d = direction.get(rec["plan_id"])
        if d is not None:
            by.setdefault(d, {}).setdefault(rec["step"], []).append(rec["duration_s"])
    out: dict[str, dict[str, dict[str, float]]] = {}
    for d in ("to_training", "to_rollout"):
        for step, ds in by.get(d, {}).items():
            ds = sorted(ds)
            out.setdefault(d, {})[step] = {
                "n": len(ds),
                "p50_s": round(ds[(len(ds) - 1) // 2], 4),
                "max_s": round(ds[-1], 4),
            }
    return out


def summary(
    *,
    ctl: Controller,
    bursts: int,
    metrics: list[dict[str, Any]],
    version: int,
    bursts_s: float,
    group_size: int,
    results: list[ExecutionOutcome],
    stats: dict[str, Any],
    engines: list[dict],
    start_pids: dict[str, int],
    bridge: LedgerBridge,
    actuator: RayActuator,
    replaced: list[dict[str, Any]],
    resumed: dict[str, int] | None,
    closed_before: dict[str, int],
    publication: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``summary.json``: what the run did, from the figures of each part; the close reasons
    count the executions an earlier incarnation closed before the checkpoint it resumed."""
    s, reasons = ctl.summary(), merge_counts(close_reasons(results), closed_before)
    return {
        "policy": s["policy"],
        "bursts": bursts,
        "trainer_steps": len(metrics),
        "bursts_s": round(bursts_s, 2),
        "version": version,
        "switches_to_training": s["switches_to_training"],
        "switches_to_rollout": s["switches_to_rollout"],
        "plans_aborted": s["plans_aborted"],
        "final_roles": ctl.cells.describe(),
        # live model requests that went to another engine: in-flight ones retried
        # elsewhere, and next calls of executions whose engine left routing between calls
        "rerouted_requests": stats["retries"] + stats["rerouted_executions"],
        "retried_inflight_requests": stats["retries"],
        "rerouted_executions": stats["rerouted_executions"],
        "drained_requests": sum(d["moved"] for d in actuator.drains),
        "kv_handoffs": stats["kv_handoffs"],
        "engine_failures": stats["engine_failures"],
        # prompt tokens an engine computed again after a move without a KV handoff
        "reprefill_tokens": stats.get("reprefill_tokens", 0),
        # KV handoffs that did not land (re-prefilled instead), and moves between engine
        # kinds whose KV layouts differ (built-in <-> vLLM: re-prefilled by design)
        "kv_handoff_failures": stats.get("kv_handoff_failures", 0),
        "kv_mixed_moves": stats.get("kv_mixed_moves", 0),
        # re-tokenization drift and prefix-cache reuse (serving.records, Proxy._cache_share)
        **{
            k: stats[k]
            for k in (
                "chain_breaks_per_100_calls",
                "chain_breaks",
                "bridged_calls",
                "cached_token_share",
                "cached_token_share_by_engine",
            )
            if k in stats
        },
        # executions whose calls waited in the proxy's admission queue, measured there
        # (tidal.control.queued_waits): what an over-subscribed move cost
        **{k: stats[k] for k in QUEUED_KEYS if k in stats},
        "backend_by_engine": {e["name"]: e.get("backend", "builtin") for e in engines},
        "switch_s": switch_times(ctl.plans_done),
        "switch_steps_s": switch_steps(ctl.plans_done, actuator.step_log),
        # each version's write and each engine's load (carrier, GB/s), beside memcpy GB/s
        "publication": publication,
        "engine_memory": {e["name"]: e["memory"] for e in engines if e.get("memory")},
        "device_peak_mb": device_peaks(metrics, engines),
        "engine_step_failures": stats["engine_step_failures"],
        "failed_requests": reasons.get(CloseReason.FAILED, 0),
        "timed_out_executions": reasons.get(CloseReason.TIMEOUT, 0),
        "dispatched": bridge.n_dispatched,
        "closed": len(results),
        "close_reasons": reasons,
        "trained_executions": sum(
            m.get("n_executions", m["n_groups"] * group_size) for m in metrics
        ),
        "lost_executions": bridge.lost,
        "record_errors": bridge.record_errors[:10],
        "ledger_waterlevel_end": s["waterlevel"],
        "duplicate_closes": s["duplicate_closes"],
        "engines": {
            e["name"]: {
                "state": e["state"],
                "version": e["version"],
                "gpu_ids": e["gpu_ids"],
                "node_id": e.get("node_id"),
                "node_ip": e.get("node_ip"),
                "restarted": e["pid"] != start_pids[e["name"]],
            }
            for e in engines
        },
        "resumed": resumed,
        "cells_replaced": [r["name"] for r in replaced],
        "tokens_by_engine_version": bridge.tokens_by_engine_version,
        "engine_handoffs": bridge.engine_handoffs,
        "satellite_joins": sum(len(m["satellites"]) for m in metrics),
        "satellite_starts": actuator.satellite_starts,
        "micro_steps_by_cell": sum_by_cell(metrics),
        "mean_reward_per_step": [round(m["mean_reward"], 4) for m in metrics],
        "verl_metrics": [
            {k: round(v, 4) for k, v in row.items()}  # one per version
            for row in ctl.metrics.rows
        ],
        "mean_reward": mean_reward(results),
        # tidal.control.ledger's rule: a reward_error member trains nowhere, its group on its
        # scored members; a group with fewer than 2 scored members is dropped
        "reward_errors": reasons.get(CloseReason.REWARD_ERROR, 0),
        "groups_dropped": s["groups_dropped"],
    }
