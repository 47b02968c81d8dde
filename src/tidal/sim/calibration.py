"""Fits the cost model's efficiencies on the published rows marked ``calibrate`` and nothing else.

In: a ``PublishedFile`` (``tidal.sim.published``), the efficiencies to fit (by default
``decode`` and ``mfu``: as many as calibration rows) and a number of seeds. Out: ``Fit``: the
fitted values, their standard deviations, the residual per row and a log line per round.

Method: Gauss-Newton in logs (``log makespan`` against ``log efficiency``) with the Jacobian
taken once by forward differences at the start (a chord method: the makespans are nearly
power laws of the efficiencies), stopped when every row is within ``tol``. Uncertainty: the
published run is one draw of its workload, so each row is re-simulated at the fit with
``seeds`` other seeds; the spread of ``log makespan`` goes through the pseudo-inverse of the
Jacobian (``cov = J+ diag(s^2) J+^T``). The link efficiency is not pinned by two makespans:
it stays at its prior and is reported as such.
"""

from __future__ import annotations

import math
import statistics as st
from collections.abc import Callable
from dataclasses import dataclass, field

from tidal.errors import ConfigError
from tidal.sim import published as P
from tidal.sim import scenario as scenarios

FITTABLE = ("decode", "mfu", "link")


@dataclass
class Fit:
    scenario: str
    values: dict[str, float]
    sd: dict[str, float]
    fixed: dict[str, float]
    residuals: dict[str, float]
    log: list[str] = field(default_factory=list)


def fit(
    pf: P.PublishedFile,
    params: tuple[str, ...] = ("decode", "mfu"),
    seeds: int = 4,
    tol: float = 0.003,
    rounds: int = 8,
    echo: Callable[[str], None] | None = None,
    runner_for: Callable[[dict[str, float]], P.Makespans] = P.makespan_runner,
) -> Fit:
    """``runner_for(efficiencies)`` gives the makespans at those efficiencies (the simulator
    by default)."""
    import numpy as np

    rows = [r for r in pf.rows if r.calibrate]
    if not rows or any(r.metric != "makespan_h" for r in rows):
        raise ConfigError(
            "rows.calibrate", "calibration needs makespan_h rows marked calibrate: true"
        )
    names = {r.scenario for r in rows}
    if len(names) != 1:
        raise ConfigError("rows.scenario", "calibration rows must share one scenario")
    name = names.pop()
    cm = scenarios.load(name).costmodel
    if cm is None:
        raise ConfigError(
            "costmodel", f"{name}: a scenario without a cost model has no efficiencies to fit"
        )
    bad = [p for p in params if p not in FITTABLE]
    if bad or len(params) > len(rows):
        raise ConfigError(
            "--fit", f"fit at most {len(rows)} of {', '.join(FITTABLE)} (got {', '.join(params)})"
        )
    start = cm.efficiency.model_dump()
    x = np.log([start[p] for p in params])
    target = np.log([r.published for r in rows])
    out = Fit(name, {}, {}, {k: v for k, v in start.items() if k not in params}, {})

    def say(line: str) -> None:
        out.log.append(line)
        if echo:
            echo(line)

    def logm(xv, seed: int = 0) -> np.ndarray:
        eff = {p: min(1.0, float(math.exp(v))) for p, v in zip(params, xv, strict=True)}
        run = runner_for(eff)
        return np.log([run(name, r.policy, seed) for r in rows])

    f0 = logm(x)
    h = 0.05
    jac = np.column_stack([(logm(x + h * np.eye(len(x))[j]) - f0) / h for j in range(len(x))])
    pinv = np.linalg.pinv(jac)
    f = f0
    for i in range(rounds):
        err = np.exp(f - target) - 1
        say(
            f"round {i}: "
            + "  ".join(f"{p} {math.exp(v):.4f}" for p, v in zip(params, x, strict=True))
            + "  "
            + "  ".join(
                f"{r.id} {math.exp(v):.3f} h ({e:+.2%})"
                for r, v, e in zip(rows, f, err, strict=True)
            )
        )
        if np.all(np.abs(err) < tol):
            break
        x = np.minimum(0.0, x - pinv @ (f - target))
        f = logm(x)
    base = scenarios.load(name).seed
    spread = np.array([logm(x, base + 1000 * k) for k in range(1, seeds + 1)] + [f])
    s2 = np.var(spread, axis=0, ddof=1) if len(spread) > 1 else np.zeros(len(rows))
    cov = pinv @ np.diag(s2) @ pinv.T
    for j, p in enumerate(params):
        out.values[p] = round(float(math.exp(x[j])), 4)
        out.sd[p] = round(float(math.exp(x[j]) * math.sqrt(max(0.0, cov[j, j]))), 4)
    out.residuals = {
        r.id: round(float(math.exp(v - t) - 1), 4) for r, v, t in zip(rows, f, target, strict=True)
    }
    say(
        "seeds' spread of the calibration rows (sd of makespan): "
        + ", ".join(f"{r.id} {st.pstdev(np.exp(spread[:, i])):.3f} h" for i, r in enumerate(rows))
    )
    return out


def write_efficiencies(name: str, values: dict[str, float]) -> str:
    """Stores fitted efficiencies in the scenario file (its ``efficiency:`` line)."""
    import re

    path = scenarios.resolve(name)
    text = path.read_text()
    eff = scenarios.load(name).costmodel.efficiency.model_dump()  # type: ignore[union-attr]
    eff.update(values)
    line = "efficiency: {" + ", ".join(f"{k}: {v:g}" for k, v in eff.items()) + "}"
    new, n = re.subn(r"efficiency: \{[^}]*\}", line, text)
    if n != 1:
        raise ConfigError(
            "costmodel.efficiency", f"{path}: expected one 'efficiency: {{...}}' line to update"
        )
    path.write_text(new)
    return str(path)
