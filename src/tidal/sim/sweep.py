"""The best static split: every fixed split of a scenario's cells, run, and the fastest kept.

In: a scenario. Out: ``StaticSweep``: one ``RunResult`` per split (``static:cells=k``, the first
``k`` cells of the order train for the whole run; ``k`` from 1 to every cell, or to all but one
when no standalone engine is left to roll out) and the best of them, the baseline every
comparison of elastic policies is reported against (``saving``: the share of the best static
makespan a policy saves). Every split runs under the same mechanics as the scenario gives the
static policy (the verl family's unless ``mechanics`` says otherwise).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tidal.sim.oracle import OracleBound, oracle_bound
from tidal.sim.runner import RunResult, run_policy
from tidal.sim.scenario import Scenario


@dataclass
class StaticSweep:
    runs: list[RunResult]

    @property
    def best(self) -> RunResult:
        return min(self.runs, key=lambda r: r.summary["makespan_s"])

    @property
    def best_makespan_s(self) -> float:
        return float(self.best.summary["makespan_s"])

    def saving(self, makespan_s: float) -> float:
        """Share of the best static makespan saved (negative: slower than the best split)."""
        return 1.0 - makespan_s / self.best_makespan_s

    def split_label(self, r: RunResult) -> str:
        """``train+rollout`` GPUs of a split, e.g. ``8+24``."""
        w = r.world
        cells = w.controller.cells.cells
        k = int(r.spec.split("=")[1])
        train = sum(c.gpus for c in cells[:k])
        total = sum(c.gpus for c in cells) + sum(
            s.gpus for s in w.controller.cells.standalone.values()
        )
        return f"{train}+{total - train}"


def static_specs(sc: Scenario) -> list[str]:
    """``static:cells=k`` for every split that leaves something to roll out on."""
    n = len(sc.cluster.cell_specs())
    top = n if sc.cluster.standalone_count > 0 else n - 1
    return [f"static:cells={k}" for k in range(1, top + 1)]


def sweep_static(
    sc: Scenario,
    oracle: OracleBound | None = None,
    on_done: Callable[[RunResult], None] | None = None,
) -> StaticSweep:
    """Runs every static split of ``sc``; ``on_done`` after each."""
    oracle = oracle or oracle_bound(sc)
    runs = []
    for spec in static_specs(sc):
        res = run_policy(sc, spec, oracle=oracle, keep_log=False)
        runs.append(res)
        if on_done is not None:
            on_done(res)
    if not runs:
        from tidal.errors import ConfigError

        raise ConfigError("cluster", f"{sc.name}: no static split leaves a rollout engine")
    return StaticSweep(runs)
