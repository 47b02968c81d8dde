"""``tidal validate [PUBLISHED] [--seeds N]``: the simulator against published results.

In: a file of published results (a path, or a name in ``configs/scenarios/published/``; the
project ships ``verl-dapo``): per row a scenario, a policy, a metric and the published figure.
Out: a table of predicted vs published with the error per row, each row marked as calibrated
(the efficiencies were fitted on it) or a prediction; with ``--seeds N`` the spread over N
workload seeds. Exit 1 when a prediction is off by more than ``--tolerance`` (if given).
"""

from __future__ import annotations

import click


@click.command(help="Run a file of published results through the simulator and print "
                    "predicted vs published with the error of each row.")
@click.argument("published", default="verl-dapo")
@click.option("--seeds", type=click.IntRange(1, 20), default=1, show_default=True,
              help="Workload seeds per row (the first is the scenario's own).")
@click.option("--tolerance", type=float, default=None,
              help="Fail (exit 1) when a makespan prediction is off by more than this "
                   "(relative, e.g. 0.1).")
def command(published: str, seeds: int, tolerance: float | None) -> None:
    from tidal.errors import TidalError
    from tidal.sim import published as P

    pf = P.load(published)
    outcomes = P.evaluate(pf, P.makespan_runner(), seeds=seeds)
    click.echo(P.table(pf, outcomes))
    if tolerance is not None:
        off = [o for o in outcomes if o.row.metric == "makespan_h"
               and abs(o.error) > tolerance]
        if off:
            raise TidalError(f"{', '.join(o.row.id for o in off)} off by more than "
                             f"±{tolerance:.0%}")
