"""``tidal calibrate RUN_DIR [--out SCENARIO.yaml] [--check | --against RUN]``.

In: a run directory of ``tidal run``. Out: a simulator scenario fitted on it (``--out``, else on
stdout) whose engine, trainer and transition costs are the run's (``tidal.sim.from_run``);
with ``--check`` the scenario is simulated under the run's policy and its burst times are
compared with the run's (``tidal.sim.vs_real``); ``--against RUN`` describes another run (its
config: cluster, control, policy, bursts) with the speeds fitted here and compares with it: a
prediction, not a refit. Exit 1 when the error is beyond ``--tolerance``.
``tidal calibrate --verl-log FILE --group-size N [--compare]`` fits a scenario on a verl run's
logged metrics instead (``tidal.sim.from_verl``) and, with ``--compare``, simulates every policy
on it against the best static split.
``tidal calibrate --published FILE [--fit decode,mfu] [--write]`` instead fits the cost model's
efficiencies on the rows of a file of published results marked ``calibrate`` (and on nothing
else), prints each value with its uncertainty and the residuals (``tidal.sim.calibration``).
"""

from __future__ import annotations

import click


@click.command(
    help="Fit a simulator scenario on a tidal run directory; optionally check "
    "the simulated burst times against a real run."
)
@click.argument("run_dir", type=click.Path(), required=False)
@click.option(
    "--published",
    default=None,
    metavar="FILE",
    help="Fit the cost model's efficiencies on this file's calibration rows "
    "(a path or a shipped name, e.g. verl-dapo) instead of a run directory.",
)
@click.option(
    "--fit",
    "fit_params",
    default="decode,mfu",
    show_default=True,
    help="With --published: the efficiencies to fit (decode, mfu, link).",
)
@click.option(
    "--write",
    is_flag=True,
    help="With --published: store the fit in the scenario's costmodel.efficiency.",
)
@click.option(
    "--out",
    "-o",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the scenario YAML here (default: print it, unless checking).",
)
@click.option(
    "--check",
    is_flag=True,
    help="Simulate the scenario and compare its burst times with RUN_DIR's.",
)
@click.option(
    "--against",
    type=click.Path(),
    default=None,
    metavar="RUN",
    help="Describe this other run (its config.yaml) with RUN_DIR's speeds and "
    "compare with its burst times.",
)
@click.option(
    "--tolerance",
    type=float,
    default=0.15,
    show_default=True,
    help="Largest relative error of the mean time per burst.",
)
@click.option("--per-burst", is_flag=True, help="Apply the tolerance to every burst.")
@click.option(
    "--seeds",
    type=click.IntRange(1, 100),
    default=3,
    show_default=True,
    help="Simulated runs to average (seeds; they matter with --fitted-workload).",
)
@click.option(
    "--fitted-workload",
    is_flag=True,
    help="Draw executions from the fitted lognormals instead of replaying the run's "
    "own (by default written beside --out as SCENARIO.trace.jsonl).",
)
@click.option(
    "--verl-log",
    default=None,
    metavar="FILE",
    help="Fit a scenario on a verl run's logged metrics (its file logger's JSONL, "
    "console lines or a CSV export of verl's metric keys) instead.",
)
@click.option(
    "--group-size",
    type=int,
    default=None,
    help="With --verl-log: the run's GRPO group size (actor_rollout_ref.rollout.n).",
)
@click.option(
    "--gpus",
    type=int,
    default=None,
    help="With --verl-log: the run's GPUs (default: from perf/throughput).",
)
@click.option(
    "--cell-gpus",
    type=int,
    default=8,
    show_default=True,
    help="With --verl-log: GPUs per cell of the fitted scenario.",
)
@click.option(
    "--compare",
    is_flag=True,
    help="With --verl-log: simulate every policy on the fitted scenario against the "
    "best static split (what each policy would save on this workload).",
)
def command(
    run_dir: str | None,
    published: str | None,
    fit_params: str,
    write: bool,
    out: str | None,
    check: bool,
    against: str | None,
    tolerance: float,
    per_burst: bool,
    seeds: int,
    fitted_workload: bool,
    verl_log: str | None,
    group_size: int | None,
    gpus: int | None,
    cell_gpus: int,
    compare: bool,
) -> None:
    if out is not None:  # a fresh clone has no runs/: the written scenario makes its folder
        from pathlib import Path

        Path(out).parent.mkdir(parents=True, exist_ok=True)
    if verl_log is not None:
        _fit_verl(verl_log, group_size, gpus, cell_gpus, out, compare)
        return
    if published is not None:
        _fit_published(
            published, tuple(p.strip() for p in fit_params.split(",") if p.strip()), seeds, write
        )
        return
    if run_dir is None:
        from tidal.errors import ConfigError

        raise ConfigError("RUN_DIR", "give a run directory, or --published FILE")
    import tempfile
    from pathlib import Path

    import yaml

    from tidal.errors import ConfigError
    from tidal.sim.from_run import scenario_from_run

    describe = None
    if against is not None:
        describe = Path(against) / "config.yaml"
        if not describe.is_file():
            raise ConfigError("--against", f"{against} is not a run directory (no config.yaml)")
    with tempfile.TemporaryDirectory() as tmp:
        trace = None
        if not fitted_workload and (out or check or against):
            trace = Path(out).with_suffix(".trace.jsonl") if out else Path(tmp) / "trace.jsonl"
        sc, notes = scenario_from_run(run_dir, describe, trace)
        data = sc.model_dump(mode="json")
        if trace is not None and out is not None:  # beside the scenario: they move together
            data["workload"]["trace"] = trace.name
        text = yaml.safe_dump(data, sort_keys=False)
        if out is not None:
            Path(out).write_text(text)
            click.echo(f"scenario: {out}" + (f" (workload: {trace})" if trace else ""))
        elif not (check or against):
            click.echo(text, nl=False)
            return
        _check(sc, notes, run_dir, against, check, tolerance, per_burst, seeds)


def _check(
    sc,
    notes,
    run_dir: str,
    against: str | None,
    check: bool,
    tolerance: float,
    per_burst: bool,
    seeds: int,
) -> None:
    import json

    from tidal.sim.vs_real import PredictionOff, compare

    click.echo(f"fit on {run_dir}: " + json.dumps(notes))
    if not (check or against):
        return
    target = against or run_dir
    cmp = compare(sc, sc.policies[0], target, seeds=seeds)
    click.echo(
        f"{sc.policies[0]} on {target}: simulated vs real burst times "
        f"({seeds} seed{'s' if seeds > 1 else ''})"
    )
    click.echo(cmp.table())
    if not cmp.within(tolerance, per_burst):
        what = "worst burst" if per_burst else "mean time per burst"
        err = cmp.worst_burst_error if per_burst else cmp.error
        raise PredictionOff(f"{what} off by {err:+.1%}, beyond the tolerance ±{tolerance:.0%}")
    click.echo(f"within ±{tolerance:.0%}")


def _fit_published(name: str, params: tuple[str, ...], seeds: int, write: bool) -> None:
    from tidal.sim import calibration
    from tidal.sim import published as P

    pf = P.load(name)
    fit = calibration.fit(pf, params, seeds=seeds, echo=click.echo)
    click.echo(f"fitted on {', '.join(fit.residuals)} of {pf.name} ({fit.scenario}):")
    for p, v in fit.values.items():
        click.echo(f"  efficiency.{p} = {v:.4f} ± {fit.sd[p]:.4f}")
    for p, v in fit.fixed.items():
        click.echo(f"  efficiency.{p} = {v:g} (prior, not fitted)")
    click.echo("residuals: " + ", ".join(f"{k} {v:+.2%}" for k, v in fit.residuals.items()))
    if write:
        click.echo(f"wrote {calibration.write_efficiencies(fit.scenario, fit.values)}")


def _fit_verl(
    path: str,
    group_size: int | None,
    gpus: int | None,
    cell_gpus: int,
    out: str | None,
    compare: bool,
) -> None:
    import json
    from pathlib import Path

    from tidal.config import dump_yaml
    from tidal.errors import ConfigError
    from tidal.sim.from_verl import scenario_from_verl

    if group_size is None:
        raise ConfigError(
            "--group-size",
            "give the run's GRPO group size (verl's "
            "actor_rollout_ref.rollout.n); the metrics lack it",
        )
    sc, fit = scenario_from_verl(path, group_size, gpus, cell_gpus)
    click.echo(f"fit on {path}: " + json.dumps(fit.notes()))
    if fit.logged_s is not None:
        click.echo(
            f"the run's own time: {fit.logged_s / 3600:.3f} h over {fit.steps} steps "
            f"(compare the colocate row)"
        )
    if out is not None:
        Path(out).write_text(dump_yaml(sc))
        click.echo(f"scenario: {out}")
    elif not compare:
        click.echo(dump_yaml(sc), nl=False)
    if compare:
        from tidal.commands.simulate import run_and_report, sweep_and_report

        run_and_report(sc, list(sc.policies), None, plots=False, baseline=sweep_and_report(sc))
