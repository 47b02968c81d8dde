"""Simulated against real burst times (``tidal calibrate --check`` / ``--against``).

In: a calibrated ``Scenario`` (``from_run``), its policy spec and the real run directory it
describes. Out: per burst the real and the simulated time and the relative error
``(sim - real) / real``, and the same for the whole run (its mean time per burst).

Burst time, identical on both sides: a burst ends when its weights are published; its time runs
from the previous burst's end (or the first dispatch, t = 0) to its end. Real: the ``t`` of the
burst's final line in ``metrics.jsonl`` (written right after the publication, in seconds since
the first dispatch; ``tidal.rundir.burst_rows``). Simulated: the virtual time of the
burst's final optimizer step plus the publication (``costs.sync_s``); the world starts the next
burst then (its last burst ends the simulation without one, so it is added here too). With
several seeds the simulated times are means over the seeds (workloads drawn anew each time;
a replayed trace is simulated once).
"""

from __future__ import annotations

import statistics as st
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal.errors import ConfigError, TidalError
from tidal.rundir import burst_rows, load_run
from tidal.sim.scenario import Scenario


class PredictionOff(TidalError):
    """The simulated burst times are further from the real ones than the tolerance."""


@dataclass
class Comparison:
    rows: list[dict[str, Any]]  # burst, real_s, sim_s, error
    real_total_s: float
    sim_total_s: float

    @property
    def error(self) -> float:
        """Relative error of the whole run (= of the mean time per burst)."""
        return (self.sim_total_s - self.real_total_s) / self.real_total_s

    @property
    def worst_burst_error(self) -> float:
        return max(abs(r["error"]) for r in self.rows)

    def within(self, tolerance: float, per_burst: bool = False) -> bool:
        worst = self.worst_burst_error if per_burst else abs(self.error)
        return worst <= tolerance

    def table(self) -> str:
        lines = [f"{'burst':>5} {'real s':>9} {'sim s':>9} {'error':>8}"]
        for r in self.rows:
            lines.append(
                f"{r['burst']:>5} {r['real_s']:>9.2f} {r['sim_s']:>9.2f} {r['error']:>+8.1%}"
            )
        n = len(self.rows)
        lines.append(
            f"{'all':>5} {self.real_total_s:>9.2f} {self.sim_total_s:>9.2f} "
            f"{self.error:>+8.1%}   (mean per burst: real {self.real_total_s / n:.2f}"
            f" s, sim {self.sim_total_s / n:.2f} s)"
        )
        return "\n".join(lines)


def real_burst_times(run_dir: str | Path) -> list[float]:
    run = load_run(run_dir)
    if not run.metrics:
        raise ConfigError(str(Path(run_dir) / "metrics.jsonl"), "missing or empty")
    if not run.relative_times():
        raise ConfigError(
            str(run_dir),
            "metrics.jsonl times are not relative to the first "
            "dispatch (a run written by an older runtime)",
        )
    return [float(r["time_s"]) for r in burst_rows(run)]


def sim_burst_times(scenario: Scenario, spec: str) -> list[float]:
    """Per burst, the simulated time from the previous publication to this one."""
    from tidal.sim.world import World

    world = World(scenario, spec, keep_log=False).run()
    u = scenario.control.updates_per_burst
    ends = [
        s["t"] + scenario.costs.sync_s
        for s in world.trainer.steps_log
        if (int(s["step"]) + 1) % u == 0
    ]
    return [b - a for a, b in zip([0.0, *ends[:-1]], ends, strict=True)]


def compare(scenario: Scenario, spec: str, run_dir: str | Path, seeds: int = 1) -> Comparison:
    real = real_burst_times(run_dir)
    if scenario.control.bursts != len(real):
        raise ConfigError(
            "control.bursts",
            f"the scenario has {scenario.control.bursts} "
            f"bursts, the run {run_dir} finished {len(real)}",
        )
    n = 1 if scenario.workload.trace else max(1, seeds)  # a replayed trace draws nothing
    runs = [
        sim_burst_times(scenario.model_copy(update={"seed": scenario.seed + k}), spec)
        for k in range(n)
    ]
    sim = [st.fmean(r[b] for r in runs) for b in range(len(real))]
    rows = [
        {"burst": b, "real_s": r, "sim_s": s, "error": (s - r) / r if r > 0 else 0.0}
        for b, (r, s) in enumerate(zip(real, sim, strict=True))
    ]
    return Comparison(rows, sum(real), sum(sim))
