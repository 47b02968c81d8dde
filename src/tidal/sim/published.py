"""Published results as a file the simulator is checked against (``tidal validate``).

In: a YAML file (a path, or a name in ``configs/scenarios/published/``): ``name``, ``source``,
optional ``scenarios`` defined inline (each a scenario mapping; ``extends: NAME`` starts from
another inline or shipped scenario and deep-merges the rest over it) and ``rows``; each row
names a scenario, a policy spec, a metric and the published figure, and whether the
efficiencies are fitted on it (``calibrate``). Metrics: ``makespan_h``; ``reduction``
(``1 - time / baseline time``); ``speedup`` (``baseline time / time``); a row's baseline is a
policy on the row's scenario or on ``baseline_scenario``. Times are whole makespans, or with
``per_version`` the steady seconds per weight version (the run after ``warmup_versions``
versions), for published "time to N steps" figures of runs far longer than simulated.
Out: ``Outcome`` per row (predicted, published, error, the seeds' spread), a text table and a
one-line summary. Runs of the same scenario, policy, measure and efficiencies are shared.
Optional ``phases``: per scenario the published seconds per weight version of the whole step
and of training (the trainer's passes), printed against the simulation's (``phase_table``) so
a row's error can be traced to the side and the phase that carries it; diagnostics only, never
in the summary or the tolerance.
"""

from __future__ import annotations

import statistics as st
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from tidal.config import Strict, read_yaml_mapping, validate_file_data, validate_model
from tidal.errors import ConfigError
from tidal.sim import scenario as scenarios


class Row(Strict):
    id: str
    scenario: str
    policy: str
    metric: Literal["makespan_h", "reduction", "speedup"] = "makespan_h"
    baseline: str | None = Field(
        None, description="the policy a reduction or speed-up is measured against"
    )
    baseline_scenario: str | None = Field(
        None, description="the baseline's scenario (None: the row's)"
    )
    per_version: bool = Field(
        False, description="compare steady seconds per weight version, not makespans"
    )
    warmup_versions: int = Field(1, ge=0, description="versions left out of per_version")
    published: float
    calibrate: bool = False
    workload: Literal["known", "unpublished"] = Field(
        ...,
        description="known: the run's workload is an input of its scenario (published "
        "lengths quoted in the file's header, or one workload shared by every run of the "
        "table and pinned by its calibration rows): the row is judged; unpublished: the "
        "table's runs differ in workload and it is not published: printed with its error, "
        "never judged",
    )

    @property
    def judged(self) -> bool:
        return self.workload == "known"


class Phases(Strict):
    """Published seconds per weight version of one scenario's run (verl's timing_s/*)."""

    step_s: float = Field(..., gt=0.0, description="wall seconds per version")
    train_s: float | None = Field(
        None, gt=0.0, description="trainer passes per version (old_log_prob + update_actor)"
    )
    source: str = ""


class PublishedFile(Strict):
    name: str
    source: str
    scenarios: dict[str, dict[str, Any]] = Field(default_factory=dict)
    rows: list[Row] = Field(..., min_length=1)
    phases: dict[str, Phases] = Field(
        default_factory=dict,
        description="per scenario the published phases (diagnostics, not rows)",
    )


def resolve(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.is_file():
        return p
    for d in scenarios.scenario_dirs():
        cand = d / "published" / f"{name_or_path}.yaml"
        if cand.is_file():
            return cand
    raise ConfigError("published", f"{name_or_path!r}: no such file of published results")


def shipped() -> list[str]:
    """Names of the shipped files of published results."""
    names: set[str] = set()
    for d in scenarios.scenario_dirs():
        names.update(p.stem for p in (d / "published").glob("*.yaml"))
    return sorted(names)


def load(name_or_path: str) -> PublishedFile:
    path = resolve(name_or_path)
    pf = validate_file_data(PublishedFile, read_yaml_mapping(path), path)
    for r in pf.rows:
        if r.metric != "makespan_h" and r.baseline is None:
            raise ConfigError(f"rows.{r.id}.baseline", f"a {r.metric} needs a baseline policy")
        if r.calibrate and (r.metric != "makespan_h" or r.per_version):
            raise ConfigError(f"rows.{r.id}.calibrate", "only makespan_h rows calibrate")
        if r.calibrate and not r.judged:
            raise ConfigError(f"rows.{r.id}.workload", "a calibration row needs its workload known")
        for name in (r.scenario, r.baseline_scenario):
            if name is not None:
                scenario_in(pf, name)  # every scenario a row names loads
    for name in pf.phases:
        if not any(name in (r.scenario, r.baseline_scenario) for r in pf.rows if r.per_version):
            raise ConfigError(f"phases.{name}", "names no scenario of a per_version row")
    return pf


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _inline_data(pf: PublishedFile, name: str, seen: tuple[str, ...] = ()) -> dict[str, Any]:
    if name in seen:
        raise ConfigError(f"scenarios.{name}.extends", "extends itself (a cycle)")
    data = dict(pf.scenarios[name])
    parent = data.pop("extends", None)
    if parent is None:
        return {"name": name, **data}
    if not isinstance(parent, str):
        raise ConfigError(f"scenarios.{name}.extends", "must name a scenario")
    base = (
        _inline_data(pf, parent, (*seen, name))
        if parent in pf.scenarios
        else scenarios.load(parent).model_dump(mode="json")
    )
    return _merge(base, {"name": name, **data})


def scenario_in(pf: PublishedFile | None, name: str) -> scenarios.Scenario:
    """A scenario defined inline in ``pf``, else a shipped name or a path."""
    if pf is None or name not in pf.scenarios:
        return scenarios.load(name)
    return validate_model(scenarios.Scenario, _inline_data(pf, name), f"scenarios.{name}")


@dataclass
class Outcome:
    row: Row
    predicted: float
    spread: float  # standard deviation over seeds (0 with one seed)

    @property
    def error(self) -> float:
        """Relative error of a makespan or a speed-up; absolute (points) of a reduction."""
        if self.row.metric == "reduction":
            return self.predicted - self.row.published
        return self.predicted / self.row.published - 1.0

    @property
    def relative_error(self) -> float:
        """The error relative to the published figure, for every metric (a reduction's
        time ratio ``1 - r``)."""
        if self.row.metric == "reduction":
            return (1.0 - self.predicted) / (1.0 - self.row.published) - 1.0
        return self.error


# (scenario, policy, seed[, warm-up versions for seconds per version]) -> hours (or seconds)
Makespans = Callable[..., float]


def scenario_for(
    name: str, efficiencies: dict[str, float] | None, seed: int, pf: PublishedFile | None = None
) -> scenarios.Scenario:
    """The row's scenario with the given efficiencies (``None``: as shipped) and seed (0: the
    scenario's own)."""
    sc = scenario_in(pf, name)
    if efficiencies and sc.costmodel is not None:
        eff = sc.costmodel.efficiency.model_copy(update=efficiencies)
        sc = sc.model_copy(
            update={"costmodel": sc.costmodel.model_copy(update={"efficiency": eff})}
        )
    return sc.model_copy(update={"seed": seed}) if seed else sc


def version_seconds(steps_log: list[dict[str, float]], per_version: int, warmup: int) -> float:
    """Mean seconds per weight version after the first ``warmup`` versions."""
    ends = [s["t"] for s in steps_log if (int(s["step"]) + 1) % per_version == 0]
    if len(ends) <= warmup:
        raise ConfigError(
            "warmup_versions", f"{warmup} warm-up versions leave none of the {len(ends)} simulated"
        )
    start = ends[warmup - 1] if warmup else 0.0
    return (ends[-1] - start) / (len(ends) - warmup)


def version_train_seconds(
    steps_log: list[dict[str, float]], per_version: int, warmup: int
) -> float:
    """Mean trainer-busy seconds (passes, updates, fixed costs) per weight version after the
    first ``warmup`` versions."""
    versions = len([s for s in steps_log if (int(s["step"]) + 1) % per_version == 0])
    busy = sum(
        s["compute_s"]
        for s in steps_log
        if int(s["step"]) >= warmup * per_version and int(s["step"]) < versions * per_version
    )
    return busy / max(1, versions - warmup)


def makespan_runner(
    efficiencies: dict[str, float] | None = None, pf: PublishedFile | None = None
) -> Makespans:
    """A cached ``(scenario, policy, seed, warmup=None, train=False)`` -> makespan hours, or
    with a ``warmup`` the steady seconds per weight version (with ``train``: the trainer's
    busy seconds per version), at the given efficiencies; seed 0 means the scenario's own
    seed; scenarios inline in ``pf`` come first."""
    from tidal.sim.runner import run_policy

    cache: dict[tuple[str, str, int], Any] = {}

    def run(
        name: str, policy: str, seed: int = 0, warmup: int | None = None, train: bool = False
    ) -> float:
        key = (name, policy, seed)
        if key not in cache:
            sc = scenario_for(name, efficiencies, seed, pf)
            res = run_policy(sc, policy, keep_log=False)
            cache[key] = (
                res.summary["makespan_s"] / 3600,
                res.world.trainer.steps_log,
                sc.control.updates_per_burst,
            )
        hours, log, per = cache[key]
        if warmup is None:
            return hours
        return (version_train_seconds if train else version_seconds)(log, per, warmup)

    return run


def evaluate(pf: PublishedFile, run: Makespans, seeds: int = 1) -> list[Outcome]:
    out = []
    for r in pf.rows:
        vals = []
        for k in range(seeds):
            seed = 0 if k == 0 else scenario_in(pf, r.scenario).seed + 1000 * k
            warm = r.warmup_versions if r.per_version else None
            m = (
                run(r.scenario, r.policy, seed)
                if warm is None
                else run(r.scenario, r.policy, seed, warm)
            )
            if r.metric != "makespan_h":
                assert r.baseline is not None
                bs = r.baseline_scenario or r.scenario
                b = run(bs, r.baseline, seed) if warm is None else run(bs, r.baseline, seed, warm)
                m = 1.0 - m / b if r.metric == "reduction" else b / m
            vals.append(m)
        out.append(Outcome(r, vals[0], st.pstdev(vals) if len(vals) > 1 else 0.0))
    return out


def _kind_line(label: str, outcomes: list[Outcome], tolerance: float) -> str:
    if not outcomes:
        return f"{label}: none"
    worst = max(outcomes, key=lambda o: abs(o.relative_error))
    within = sum(abs(o.relative_error) <= tolerance for o in outcomes)
    return (
        f"{label}: {within}/{len(outcomes)} within {tolerance:.0%}, worst {worst.row.id} "
        f"{worst.relative_error:+.1%}"
    )


def counts(outcomes: list[Outcome], tolerance: float = 0.1) -> str:
    """Per kind of row, how many are within ``tolerance``: judged (calibration rows apart)
    and unjudged (workload unpublished)."""
    judged = [o for o in outcomes if o.row.judged]
    cal = [o for o in judged if o.row.calibrate]
    pred = [o for o in judged if not o.row.calibrate]
    return "; ".join(
        [
            _kind_line("calibration rows", cal, tolerance),
            _kind_line("judged rows (workload known)", pred, tolerance),
            _kind_line(
                "unjudged rows (workload unpublished)",
                [o for o in outcomes if not o.row.judged],
                tolerance,
            ),
        ]
    )


def summary(outcomes: list[Outcome], tolerance: float = 0.1) -> str:
    """The closing lines: judged rows within ``tolerance`` (relative, every metric; the
    calibration rows counted apart), the unjudged ones, each kind's worst row."""
    judged = [o for o in outcomes if o.row.judged]
    within = sum(abs(o.relative_error) <= tolerance for o in judged)
    pred = [o for o in judged if not o.row.calibrate]
    return (
        f"all files: {within}/{len(judged)} judged rows within {tolerance:.0%} "
        f"({sum(abs(o.relative_error) <= tolerance for o in pred)}/{len(pred)} outside "
        f"the {len(judged) - len(pred)} calibration rows); "
        f"{sum(not o.row.judged for o in outcomes)} unjudged rows (workload unpublished)"
        f"\n{counts(outcomes, tolerance)}"
    )


def table(pf: PublishedFile, outcomes: list[Outcome]) -> str:
    w = max(24, *(len(o.row.id) for o in outcomes))
    lines = [
        f"{pf.name}: {pf.source}",
        f"{'row':<{w}} {'role':<11} {'mechanics':<26} {'metric':<11} {'published':>9} "
        f"{'predicted':>10} {'error':>8} {'seeds sd':>9}",
    ]
    for o in outcomes:
        r = o.row
        role = "calibrated" if r.calibrate else "prediction" if r.judged else "unjudged"
        metric = r.metric if r.baseline is None else f"vs {r.baseline.split(':')[-1]}"
        if r.metric == "speedup":
            metric = "speed-up"
        err = f"{o.error * 100:+.1f}pt" if r.metric == "reduction" else f"{o.error:+.1%}"
        fmt = {"makespan_h": "{:.3f}", "reduction": "{:.1%}", "speedup": "{:.2f}x"}[r.metric]
        mech = scenario_in(pf, r.scenario).profile_for(r.policy.split(":")[0]).label()
        lines.append(
            f"{r.id:<{w}} {role:<11} {mech:<26} {metric:<11} "
            f"{fmt.format(r.published):>9} "
            f"{fmt.format(o.predicted):>10} {err:>8} "
            f"{(fmt.format(o.spread) if o.spread else '-'):>9}"
            + ("" if r.judged else "  workload unpublished")
        )
    return "\n".join(lines)


def phase_table(pf: PublishedFile, run: Makespans) -> str:
    """Simulated vs published seconds per version, whole step and training, of every scenario
    with published ``phases`` (the policy and warm-up of the per_version row that runs it)."""
    if not pf.phases:
        return ""
    lines = [
        f"phases (s per version)  {'scenario':<20} {'policy':<16} {'step pub':>8} "
        f"{'sim':>7} {'err':>7} {'train pub':>9} {'sim':>7} {'err':>7}"
    ]
    for name, ph in pf.phases.items():
        row = next(
            r for r in pf.rows if r.per_version and name in (r.scenario, r.baseline_scenario)
        )
        policy = row.policy if name == row.scenario else str(row.baseline)
        step = run(name, policy, 0, row.warmup_versions)
        train = run(name, policy, 0, row.warmup_versions, train=True)
        tp = (
            f"{ph.train_s:>9.0f} {train:>7.0f} {train / ph.train_s - 1:>+7.0%}"
            if ph.train_s
            else f"{'-':>9} {train:>7.0f} {'':>7}"
        )
        lines.append(
            f"{'':<23} {name:<20} {policy:<16} {ph.step_s:>8.0f} {step:>7.0f} "
            f"{step / ph.step_s - 1:>+7.0%} {tp}"
        )
    return "\n".join(lines)
