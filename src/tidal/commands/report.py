"""``tidal report RUN_DIR [RUN_DIR ...] [--out DIR]``: plots and report of finished runs.

In: run directories written by ``tidal run``. Out: in each, ``roles.png``, ``reward.png``,
``waterlevel.png``, ``utilization.png``, ``trace.json`` (Perfetto) and ``report.md``; with
several runs also
``reward_compare.png``, ``compare.md`` and ``compare.json`` in DIR (default: the first run
directory's parent / ``compare``) and the comparison table on stdout.
"""

from __future__ import annotations

import click


@click.command(
    "report",
    help="Plots and report.md of finished `tidal run` directories; "
    "several directories are also compared side by side.",
)
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path())
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Where the comparison goes (several runs only; default: the first run "
    "directory's parent / compare).",
)
def command(run_dirs: tuple[str, ...], out_dir: str | None) -> None:
    from pathlib import Path

    from rich.console import Console

    from tidal.rundir import load_run
    from tidal.viz.run_compare import compare_runs, comparison_table
    from tidal.viz.run_report import write_report

    if len(run_dirs) == 1 and out_dir is not None:
        raise click.UsageError("--out names the comparison's directory: give two or more runs")
    for d in run_dirs:  # every directory checked before anything is written
        load_run(d)
    for d in run_dirs:
        files = write_report(d)
        click.echo(f"{d}: " + ", ".join(p.name for p in files))
    if len(run_dirs) > 1:
        target = Path(out_dir) if out_dir else Path(run_dirs[0]).resolve().parent / "compare"
        comp = compare_runs(list(run_dirs), target)
        console = Console()
        if not console.is_terminal:  # piped: wide enough for every column
            console = Console(width=160)
        console.print(comparison_table(comp))
        for note in comp.notes:
            click.echo(f"note: {note}")
        click.echo(f"{target}: " + ", ".join(p.name for p in comp.files))
