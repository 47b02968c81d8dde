"""Published results as a file the simulator is checked against (``tidal validate``).

In: a YAML file (a path, or a name in ``configs/scenarios/published/``): ``name``, ``source``
and ``rows``; each row names a scenario, a policy spec, a metric (``makespan_h``, or
``reduction``: ``1 - makespan / baseline makespan``), the published figure and whether the
efficiencies are fitted on it (``calibrate``). Out: ``Outcome`` per row (predicted, published,
relative error, the seeds' spread), a text table. Runs of the same scenario, policy and
efficiencies are shared between rows.
"""

from __future__ import annotations

import statistics as st
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field

from tidal.config import Strict, read_yaml_mapping, validate_file_data
from tidal.errors import ConfigError
from tidal.sim import scenario as scenarios


class Row(Strict):
    id: str
    scenario: str
    policy: str
    metric: Literal["makespan_h", "reduction"] = "makespan_h"
    baseline: str | None = Field(None, description="the policy a reduction is measured against")
    published: float
    calibrate: bool = False


class PublishedFile(Strict):
    name: str
    source: str
    rows: list[Row] = Field(..., min_length=1)


def resolve(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.is_file():
        return p
    for d in scenarios.scenario_dirs():
        cand = d / "published" / f"{name_or_path}.yaml"
        if cand.is_file():
            return cand
    raise ConfigError("published", f"{name_or_path!r}: no such file of published results")


def load(name_or_path: str) -> PublishedFile:
    path = resolve(name_or_path)
    pf = validate_file_data(PublishedFile, read_yaml_mapping(path), path)
    for r in pf.rows:
        if r.metric == "reduction" and r.baseline is None:
            raise ConfigError(f"rows.{r.id}.baseline", "a reduction needs a baseline policy")
    return pf


@dataclass
class Outcome:
    row: Row
    predicted: float
    spread: float  # standard deviation over seeds (0 with one seed)

    @property
    def error(self) -> float:
        """Relative error of a makespan; absolute (points) of a reduction."""
        if self.row.metric == "reduction":
            return self.predicted - self.row.published
        return self.predicted / self.row.published - 1.0


Makespans = Callable[[str, str, int], float]  # (scenario, policy, seed) -> hours


def scenario_for(name: str, efficiencies: dict[str, float] | None, seed: int) -> scenarios.Scenario:
    """The row's scenario with the given efficiencies (``None``: as shipped) and seed (0: the
    scenario's own)."""
    sc = scenarios.load(name)
    if efficiencies and sc.costmodel is not None:
        eff = sc.costmodel.efficiency.model_copy(update=efficiencies)
        sc = sc.model_copy(update={"costmodel": sc.costmodel.model_copy(
            update={"efficiency": eff})})
    return sc.model_copy(update={"seed": seed}) if seed else sc


def makespan_runner(efficiencies: dict[str, float] | None = None) -> Makespans:
    """A cached ``(scenario, policy, seed) -> makespan hours`` at the given efficiencies;
    seed 0 means the scenario's own seed."""
    from tidal.sim.runner import run_policy

    cache: dict[tuple[str, str, int], float] = {}

    def run(name: str, policy: str, seed: int = 0) -> float:
        key = (name, policy, seed)
        if key not in cache:
            sc = scenario_for(name, efficiencies, seed)
            cache[key] = run_policy(sc, policy, keep_log=False).summary["makespan_s"] / 3600
        return cache[key]

    return run


def evaluate(pf: PublishedFile, run: Makespans, seeds: int = 1) -> list[Outcome]:
    out = []
    for r in pf.rows:
        vals = []
        for k in range(seeds):
            seed = 0 if k == 0 else scenarios.load(r.scenario).seed + 1000 * k
            m = run(r.scenario, r.policy, seed)
            if r.metric == "reduction":
                assert r.baseline is not None
                m = 1.0 - m / run(r.scenario, r.baseline, seed)
            vals.append(m)
        out.append(Outcome(r, vals[0], st.pstdev(vals) if len(vals) > 1 else 0.0))
    return out


def table(pf: PublishedFile, outcomes: list[Outcome]) -> str:
    lines = [f"{pf.name}: {pf.source}",
             f"{'row':<24} {'role':<11} {'mechanics':<26} {'metric':<11} {'published':>9} "
             f"{'predicted':>10} {'error':>8} {'seeds sd':>9}"]
    for o in outcomes:
        r = o.row
        role = "calibrated" if r.calibrate else "prediction"
        metric = r.metric if r.baseline is None else f"vs {r.baseline.split(':')[-1]}"
        err = f"{o.error:+.1%}" if r.metric == "makespan_h" else f"{o.error * 100:+.1f}pt"
        fmt = "{:.3f}" if r.metric == "makespan_h" else "{:.1%}"
        mech = scenarios.load(r.scenario).profile_for(r.policy.split(":")[0]).label()
        lines.append(f"{r.id:<24} {role:<11} {mech:<26} {metric:<11} "
                     f"{fmt.format(r.published):>9} "
                     f"{fmt.format(o.predicted):>10} {err:>8} "
                     f"{(fmt.format(o.spread) if o.spread else '-'):>9}")
    return "\n".join(lines)
