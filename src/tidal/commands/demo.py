"""``tidal demo --out DIR``: the showcase ``make demo`` runs (until the runtime lands).

A scaled-down embedded scenario (``dapo-math-32gpu``, 10 bursts = 40 optimizer steps) under six
policies — two static splits, colocated, verl's default, QwenGyre's waterlevel and tidal's
own — simulated with the real control plane; prints the comparison table and writes
summary.json, decisions.jsonl, trace.json (Perfetto) and the PNG plots to DIR. Finishes in
well under a minute.
"""

from __future__ import annotations

import click

DEMO_SCENARIO = "dapo-math-32gpu"
DEMO_BURSTS = 10
DEMO_POLICIES = [
    "static:train=16",
    "static:train=8",
    "colocate",
    "verl-default",
    "waterlevel",
    "tidal",
]


@click.command(help="Showcase: compare scheduling policies on a small simulated scenario.")
@click.option(
    "--out",
    "-o",
    "out_dir",
    type=click.Path(file_okay=False),
    default="runs/demo",
    show_default=True,
    help="Directory for the summary, decision log and plots.",
)
def command(out_dir: str) -> None:
    from tidal.commands.simulate import run_and_report
    from tidal.sim import scenario as scenarios

    sc = scenarios.load(DEMO_SCENARIO).scaled(1.0, bursts=DEMO_BURSTS)
    click.echo(
        f"tidal demo: {sc.name} scaled to {sc.total_steps} optimizer steps, "
        f"{len(DEMO_POLICIES)} policies, simulated in virtual time"
    )
    run_and_report(sc, DEMO_POLICIES, out_dir)
