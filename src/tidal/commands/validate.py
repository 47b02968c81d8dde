"""``tidal validate [PUBLISHED ...] [--seeds N] [--tolerance T]``: the simulator against
published results.

In: files of published results (paths, or names in ``configs/scenarios/published/``; none:
every shipped file): per row a scenario, a policy, a metric and the published figure.
Out: per file a table of predicted vs published with the error per row, each row marked as
calibrated (the efficiencies were fitted on it), a prediction (judged: its workload is known)
or unjudged (the table's runs differ in workload and it is not published: printed with its
error, never judged), and per file the count within the tolerance of each kind; with
``--seeds N`` the spread over N workload seeds; then the summary over every file (judged rows
within the tolerance, 10% by default, the calibration rows apart, the unjudged rows, each
kind's worst row) and what the dapo saving rests on; files with published ``phases`` also
print the simulated vs published seconds per version of each run, whole step and training
(diagnostics). Exit 1 when any judged row (makespan, reduction or speed-up, relative to the
published figure) is off by more than ``--tolerance`` (if given); unjudged rows never fail.
"""

from __future__ import annotations

import click


@click.command(
    help="Run files of published results through the simulator (all shipped ones "
    "by default) and print predicted vs published with the error of each row "
    "and a one-line summary."
)
@click.argument("published", nargs=-1)
@click.option(
    "--seeds",
    type=click.IntRange(1, 20),
    default=1,
    show_default=True,
    help="Workload seeds per row (the first is the scenario's own).",
)
@click.option(
    "--tolerance",
    type=float,
    default=None,
    help="Fail (exit 1) when any judged row is off by more than this, relative to the "
    "published figure (e.g. 0.1).",
)
def command(published: tuple[str, ...], seeds: int, tolerance: float | None) -> None:
    from tidal.errors import TidalError
    from tidal.sim import published as P

    names = list(published) or P.shipped()
    outcomes: list[P.Outcome] = []
    dapo_run = None
    for name in names:
        pf = P.load(name)
        run = P.makespan_runner(pf=pf)
        if pf.name == "verl-dapo":
            dapo_run = run
        rows = P.evaluate(pf, run, seeds=seeds)
        phases = P.phase_table(pf, run)
        tol = 0.1 if tolerance is None else tolerance
        click.echo(
            P.table(pf, rows)
            + "\n"
            + P.counts(rows, tol)
            + ("\n" + phases if phases else "")
            + "\n"
        )
        outcomes += rows
    click.echo(P.summary(outcomes, 0.1 if tolerance is None else tolerance))
    if dapo_run is not None:
        from tidal.sim.saving import dapo_saving

        click.echo("\n" + dapo_saving(dapo_run))
    if tolerance is not None:
        off = [o for o in outcomes if o.row.judged and abs(o.relative_error) > tolerance]
        if off:
            raise TidalError(
                f"{', '.join(o.row.id for o in off)} off by more than ±{tolerance:.0%}"
            )
